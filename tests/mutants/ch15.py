"""Wrong answers to problem set 15 that its checks must reject: each named (or documented) for its mistake."""

import torch

from miniinfer.core.sequence import Status
from miniinfer.course import checks as testing
from miniinfer.engine.disaggregated import DecodeEngine, HandoffScheduler


def gather_in_pool_order(pools, block_ids):
    """Gathers the blocks in the order of their ids in the pool, not the table's: the prompt's blocks shuffled."""
    return torch.stack([pool[:, sorted(block_ids)] for pool in pools])


def gather_keys_only(pools, block_ids):
    """Sends the first pool alone: the values never leave (right only for chapter 14's keys-only pool)."""
    return torch.stack([pools[0][:, block_ids]])


def gather_all_but_the_last_block(pools, block_ids):
    """Leaves the last block out, as if it were not full: its tokens' K/V never arrive."""
    return torch.stack([pool[:, block_ids[:-1]] for pool in pools])


def scatter_into_the_first_blocks(pools, block_ids, kv):
    """Writes into blocks 0, 1, 2, ... of the pool: the decode engine's own block table is ignored."""
    for pool, part in zip(pools, kv):
        pool[:, :len(block_ids)] = part


def scatter_in_pool_order(pools, block_ids, kv):
    """Writes the i-th block into the i-th smallest id: the table's order lost on the way in."""
    for pool, part in zip(pools, kv):
        pool[:, sorted(block_ids)] = part


def scatter_keys_only(pools, block_ids, kv):
    """Scatters the first pool's part alone: the decode engine's values stay what they were."""
    pools[0][:, block_ids] = kv[0]


def bytes_of_whole_tokens(cfg, num_tokens, block_size, itemsize, gbps, latency_s):
    """Counts the prompt's tokens, not its blocks: the last block goes whole, however full."""
    import miniinfer as mi
    nbytes = num_tokens * mi.read_config(cfg).cache_bytes_per_token(itemsize)
    return nbytes, latency_s + nbytes / (gbps * 1e9)


def keys_without_values(cfg, num_tokens, block_size, itemsize, gbps, latency_s):
    """Counts a key per KV head and no value: half the bytes of a grouped-query model's blocks."""
    import miniinfer as mi
    per = mi.read_config(cfg).cache_bytes_per_token(itemsize)
    per = per if "kv_lora_rank" in cfg else per // 2
    nbytes = -(-num_tokens // block_size) * block_size * per
    return nbytes, latency_s + nbytes / (gbps * 1e9)


def gigabytes_as_gibibytes(cfg, num_tokens, block_size, itemsize, gbps, latency_s):
    """Reads GB/s as 2^30 bytes a second: every transfer 7% short."""
    import miniinfer as mi
    nbytes = -(-num_tokens // block_size) * block_size * mi.read_config(cfg).cache_bytes_per_token(itemsize)
    return nbytes, latency_s + nbytes / (gbps * 2**30)


def latency_forgotten(cfg, num_tokens, block_size, itemsize, gbps, latency_s):
    """Leaves the fixed latency out: a small prompt's transfer looks free."""
    import miniinfer as mi
    nbytes = -(-num_tokens // block_size) * block_size * mi.read_config(cfg).cache_bytes_per_token(itemsize)
    return nbytes, nbytes / (gbps * 1e9)


def hand_on_every_length(max_tokens, finish_reason, aborted):
    """Hands on every request that ended by length, also one that asked for one token: the decode engine
    then waits for K/V that never comes."""
    handed = finish_reason == "length"
    return ["decode"] * handed + ["abort decode"] * (handed and aborted) + ["client"] * (not aborted)


def keep_everything_on_the_prefill_side(max_tokens, finish_reason, aborted):
    """Never hands a request on: every client gets its first token and nothing more."""
    return [] if aborted else ["client"]


def answer_the_client_who_left(max_tokens, finish_reason, aborted):
    """Passes the output on even when the client has left: a reused request id gets another's tokens."""
    handed = finish_reason == "length" and max_tokens > 1
    return ["decode"] * handed + ["abort decode"] * (handed and aborted) + ["client"]


def no_abort_on_the_decode_side(max_tokens, finish_reason, aborted):
    """Forgets to abort on the decode side a request handed on after its client left: it is decoded to the
    end for nobody."""
    handed = finish_reason == "length" and max_tokens > 1
    return ["decode"] * handed + ["client"] * (not aborted)


class HandsOnAfterAStop(HandoffScheduler):
    """Holds every handed-on request's blocks, whatever ended it: a stop token's too, never copied out."""

    def finish(self, seq, reason=None):
        if seq.request_id in self.handoff and seq.finish_reason != "length":
            seq.finish_reason = "length"
        super().finish(seq, reason)


class ReleaseForgetsTheFork(HandoffScheduler):
    """Forgets the held table on release but never frees the fork: the blocks are lost to the pool."""

    def release(self, request_id):
        del self.held[request_id]


class HandoffNeverForgets(HandoffScheduler):
    """Holds as it should but leaves the request in `handoff`: a later request with its id would be held too."""

    def finish(self, seq, reason=None):
        rid, handed = seq.request_id, seq.request_id in self.handoff
        super().finish(seq, reason)
        if handed:
            self.handoff.add(rid)


class LandsWrongly(DecodeEngine):
    """DecodeEngine.land with one of its rules broken, as each subclass below says."""
    past_a_blocked_one = any_number_running = lands_the_aborted = blocks_reversed = False

    def land(self, wait):
        s, bm = self.scheduler, self.block_manager
        for a in list(self.arrivals):
            if not a.dropped or self.lands_the_aborted:
                need = bm.blocks_for(a.seq.num_computed_tokens) + (s.watermark if s.running else 0)
                full = len(s.running) >= s.max_num_seqs and not self.any_number_running
                if full or need > bm.num_free_blocks:
                    if self.past_a_blocked_one:
                        continue
                    return
            a.receiving.wait()
            self.arrivals.remove(a)
            if a.dropped and not self.lands_the_aborted:
                continue
            table = bm.allocate(a.seq, a.seq.num_computed_tokens)
            self.scatter(self.pools, table[::-1] if self.blocks_reversed else table, a.kv)
            a.seq.status, s.requests[a.seq.request_id] = Status.RUNNING, a.seq
            s.running.append(a.seq)


class LandsPastABlockedOne(LandsWrongly):
    """Lets later arrivals land past one that does not fit yet: their K/V came in order, their landing must too."""
    past_a_blocked_one = True


class LandsPastMaxNumSeqs(LandsWrongly):
    """Checks the free blocks but not max_num_seqs: more requests run than the engine was sized for."""
    any_number_running = True


class LandsTheAborted(LandsWrongly):
    """Lands an arrival that was aborted before it landed: blocks for a request no one waits for."""
    lands_the_aborted = True


class ScattersIntoItsTableReversed(LandsWrongly):
    """Scatters the message into the request's new blocks in reverse order: each block holds another's K/V."""
    blocks_reversed = True


# (the check, the wrong answer)
MUTANTS = [
    (testing.check_gather_blocks, gather_in_pool_order),
    (testing.check_gather_blocks, gather_keys_only),
    (testing.check_gather_blocks, gather_all_but_the_last_block),
    (testing.check_scatter_blocks, scatter_into_the_first_blocks),
    (testing.check_scatter_blocks, scatter_in_pool_order),
    (testing.check_scatter_blocks, scatter_keys_only),
    (testing.check_transfer_time, bytes_of_whole_tokens),
    (testing.check_transfer_time, keys_without_values),
    (testing.check_transfer_time, gigabytes_as_gibibytes),
    (testing.check_transfer_time, latency_forgotten),
    (testing.check_handoff, HandsOnAfterAStop),
    (testing.check_handoff, ReleaseForgetsTheFork),
    (testing.check_handoff, HandoffNeverForgets),
    (testing.check_land, LandsPastABlockedOne),
    (testing.check_land, LandsPastMaxNumSeqs),
    (testing.check_land, LandsTheAborted),
    (testing.check_land, ScattersIntoItsTableReversed),
    (testing.check_after_prefill, hand_on_every_length),
    (testing.check_after_prefill, keep_everything_on_the_prefill_side),
    (testing.check_after_prefill, answer_the_client_who_left),
    (testing.check_after_prefill, no_abort_on_the_decode_side),
]
