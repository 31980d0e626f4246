"""Chapters 06 and 07: the token-budget scheduler as a hypothesis state machine (random arrivals,
lengths, aborts, pool sizes, both policies, both preemption modes, prefix caching and chunked prefill
on or off, room for guesses as chapter 09's speculation asks, overlap on or off), with a fake runner
that knows only the plain data the scheduler sends, guesses into some of the room it is given,
accepts some of its guesses and returns them and one token more, and returns 1 to 3 tokens for
each other request whose known tokens it reached (one, with overlap: the next step is scheduled
before this one's tokens are read), and a fake pool that records which token each slot holds."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import miniinfer as mi


def check_pool(bm: mi.BlockManager) -> None:
    """Each block is free (or cached and unused) or owned: reference counts match the tables,
    nothing is in two places."""
    owners = [0] * bm.num_blocks
    for table in bm.tables.values():
        for b in table:
            owners[b] += 1
    assert owners == bm.ref_count
    unused = bm.free_list + list(getattr(bm, "evictable", []))
    assert len(set(unused)) == len(unused) == bm.num_free_blocks and all(owners[b] == 0 for b in unused)
    assert bm.num_free_blocks + sum(o > 0 for o in owners) == bm.num_blocks
    if not hasattr(bm, "cached"):
        assert max(owners, default=0) <= 1  # no forks here: only a cached block has two owners


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 40), block_size=st.sampled_from([1, 2, 4, 16]),
                max_num_seqs=st.integers(1, 6), extra_budget=st.integers(0, 40),
                policy=st.sampled_from(["fcfs", "priority"]), mode=st.sampled_from(["recompute", "swap"]),
                cpu_blocks=st.integers(1, 20), caching=st.booleans(), chunked=st.booleans(), overlap=st.booleans(),
                spec=st.integers(0, 3), context=st.integers(0, 8))
    def setup(self, num_blocks, block_size, max_num_seqs, extra_budget, policy, mode, cpu_blocks, caching,
              chunked, overlap, spec, context):
        self.bm = (mi.PrefixCachingBlockManager if caching else mi.BlockManager)(num_blocks, block_size)
        self.cpu = mi.BlockManager(cpu_blocks, block_size) if mode == "swap" else None
        self.capacity = min(num_blocks * block_size, 24)
        # As LLMEngine: unchunked, the budget holds any admissible request whole (prompt + outputs - 1).
        self.budget = max_num_seqs + extra_budget if chunked else max(max_num_seqs, self.capacity) + extra_budget
        # As LLMEngine: speculation turns the overlap off.
        # The model's context may be longer than the pool holds: guesses' room reaches to the context.
        self.s = mi.Scheduler(self.bm, max_num_seqs, self.budget, mi.POLICIES[policy], self.cpu, chunked, (),
                              0 if overlap else spec, max_model_len=self.capacity + context)
        self.runner: dict[str, dict] = {}  # the fake runner's copy of each request it knows
        self.seqs: list[mi.Sequence] = []
        self.pool: dict[int, int] = {}  # device slot -> the token whose K/V it holds
        self.cpu_pool: dict[int, int] = {}
        self.rejected = 0
        self.overlap, self.in_flight = overlap, None  # with overlap: a step launched, its tokens not yet read

    def unfinished(self) -> list[mi.Sequence]:
        return [s for s in self.seqs if s.status is not mi.Status.FINISHED]

    @rule(data=st.data(), priority=st.integers(0, 3), turn=st.integers(0, 3))
    def add(self, data, priority, turn):
        total = data.draw(st.integers(2, self.capacity))
        prompt = data.draw(st.lists(st.sampled_from([1, 2]), min_size=1, max_size=total - 1))  # prefixes repeat
        # A turn above 0: a later sequence of a client's request, which a new request's first outranks.
        seq = mi.Sequence(str(len(self.seqs)), prompt, mi.SamplingParams(max_tokens=total - len(prompt)),
                          priority, arrival=len(self.seqs), turn=turn)
        self.seqs.append(seq)
        self.s.add(seq)

    @precondition(lambda self: self.unfinished())
    @rule(data=st.data())
    def abort(self, data):
        self.s.finish(data.draw(st.sampled_from(self.unfinished())), "abort")

    def slot(self, seq, position: int) -> int:
        return self.bm.tables[seq][position // self.bm.block_size] * self.bm.block_size + position % self.bm.block_size

    def move(self, pairs, src: dict, dst: dict) -> None:
        bs = self.bm.block_size
        for a, b in pairs:
            for i in range(bs):
                if a * bs + i in src:
                    dst[b * bs + i] = src[a * bs + i]

    @rule(data=st.data())
    def step(self, data):
        self.run_step(lambda: data.draw(st.lists(st.sampled_from([1, 2]), min_size=1, max_size=3)),
                      lambda guesses: data.draw(st.integers(0, len(guesses))),
                      lambda room: data.draw(st.lists(st.sampled_from([1, 2]), max_size=room)))

    def run_step(self, tokens, accept, guess) -> None:
        """One step; with overlap, the next is launched before this one's tokens are read."""
        if not self.overlap:
            return self.update(*self.launch(tokens, accept, guess))
        if self.in_flight is None:
            self.in_flight = self.launch(lambda: [1], accept, guess)
        done, self.in_flight = self.in_flight, self.launch(lambda: tokens()[:1], accept, guess)
        self.update(*done)

    def launch(self, tokens, accept, guess) -> tuple:
        """Schedule a step and run it on the fake runner. A request with room guesses(room) into it,
        keeps the first accept(guesses) of them and one token more (other than the guess it rejects);
        any other that reached the end of its known tokens produces tokens()."""
        out = self.s.schedule()
        assert out.num_batched_tokens <= self.budget
        assert len(out.num_new_tokens) <= len(self.s.running) <= self.s.max_num_seqs
        for rid in out.finished_ids:
            del self.runner[rid]
        for r in out.new_requests:
            assert r.request_id not in self.runner
            seq = self.s.requests[r.request_id]  # it comes with all its tokens: no step under way samples it
            assert seq.num_pending == (seq.num_computed_tokens >= seq.num_tokens)
            self.runner[r.request_id] = {"tokens": r.prompt_token_ids + r.output_token_ids, "blocks": r.block_ids,
                                         "computed": r.num_computed_tokens}
        for rid, blocks in out.new_block_ids.items():
            self.runner[rid]["blocks"] += blocks
        self.move(out.swap_out, self.pool, self.cpu_pool)
        self.move(out.swap_in, self.cpu_pool, self.pool)
        sampled = {}
        rejected = {}
        for rid, n in out.num_new_tokens.items():
            seq, r = self.s.requests[rid], self.runner[rid]
            room = out.num_spec_tokens.get(rid, 0)
            guesses = guess(room)
            # What the runner holds from the plain data is the scheduler's state.
            assert seq.status is mi.Status.RUNNING and n >= 1
            # The runner may know more tokens than the scheduler: those of the step under way.
            assert r["blocks"] == self.bm.tables[seq]
            assert r["tokens"][:seq.num_tokens] == seq.token_ids(0, seq.num_tokens)
            known = r["tokens"] + guesses + [-1] * (room - len(guesses))  # -1: room left unguessed
            assert r["computed"] + n == seq.num_computed_tokens == self.bm.lengths[seq] <= len(known)
            assert not room or r["computed"] + n == len(known)  # room only after a request's last token
            # No step is spent on a request that the steps under way bring to max_tokens.
            assert len(seq.output_token_ids) + seq.num_pending <= seq.params.max_tokens
            # The K/V it attends to, whether computed, swapped back or found in the cache, are its own
            # tokens': a cached block is never handed out for other tokens.
            assert [self.pool.get(self.slot(seq, i)) for i in range(r["computed"])] == r["tokens"][:r["computed"]]
            for i in range(r["computed"], r["computed"] + n):
                assert self.bm.ref_count[self.bm.tables[seq][i // self.bm.block_size]] == 1  # never a shared block
                self.pool[self.slot(seq, i)] = known[i]
            r["computed"] += n
            # A piece inside the known tokens yields nothing; reaching their end, the accepted
            # guesses, then 1 to 3 tokens.
            if r["computed"] < len(known):
                continue
            a, more = accept(guesses), tokens()[:1] if room else tokens()
            if a < len(guesses):
                more[0] = 3 - guesses[a]  # the token sampled where a guess is rejected differs from it
            sampled[rid] = guesses[:a] + more
            r["computed"] -= room - a
            del r["blocks"][-(-r["computed"] // self.bm.block_size):]  # those past its accepted guesses only
            r["tokens"] += sampled[rid]
            rejected[rid] = room - a
        self.rejected += sum(rejected.values())
        return out, sampled

    def update(self, out, sampled) -> None:
        alive = {rid for rid in sampled if rid in self.s.requests}  # not aborted since
        changed = self.s.update_from_output(out, sampled)
        assert {s.request_id for s in changed} == alive
        for seq in changed:
            assert self.overlap or seq.num_computed_tokens == self.runner[seq.request_id]["computed"]

    @invariant()
    def consistent(self):
        if not hasattr(self, "s"):
            return
        check_pool(self.bm)
        if self.cpu:
            check_pool(self.cpu)
        queues = {mi.Status.WAITING: self.s.waiting, mi.Status.RUNNING: self.s.running,
                  mi.Status.SWAPPED: self.s.swapped}
        for seq in self.seqs:
            for status, queue in queues.items():
                assert (seq in queue) == (seq.status is status)
            on_device = seq in self.bm.tables
            assert on_device == (seq.status is mi.Status.RUNNING)
            assert (self.cpu is not None and seq in self.cpu.tables) == (seq.status is mi.Status.SWAPPED)
            if on_device:  # between steps: slots for its computed tokens, no more
                assert self.bm.lengths[seq] == seq.num_computed_tokens
            if seq.status is mi.Status.WAITING:
                assert seq.num_computed_tokens == 0
        for queue in queues.values():  # each queue in policy order
            keys = [self.s.policy.key(q) for q in queue]
            assert queue is self.s.running or keys == sorted(keys)

    def teardown(self):
        if not hasattr(self, "s"):
            return
        for _ in range(10_000):  # every request finishes: nothing starves, nothing is stuck
            if not self.s.has_unfinished():
                break
            self.run_step(lambda: [1], len, lambda room: [1] * room)
        if self.in_flight is not None:  # only finished requests ran in it
            self.update(*self.in_flight)
        assert all(s.status is mi.Status.FINISHED for s in self.seqs)
        assert all(s.finish_reason == "abort" or len(s.output_token_ids) == s.params.max_tokens for s in self.seqs)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.cpu is None or self.cpu.num_free_blocks == self.cpu.num_blocks


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_scheduler_state_machine = SchedulerMachine.TestCase


def test_a_request_preempted_while_its_step_runs_comes_back_with_that_steps_token():
    """Overlap: step 2 is scheduled before step 1's tokens are read. An urgent arrival preempts V in
    the schedule of step 2; the pool would then hold V again at once, but its token from step 1 is
    not known yet: V joins only after it is, and is sent to the runner with it."""
    bm = mi.BlockManager(num_blocks=8, block_size=4)
    s = mi.Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, policy=mi.POLICIES["priority"])
    a = mi.Sequence("a", [1, 2, 3, 4], mi.SamplingParams(max_tokens=10), priority=0, arrival=0)
    v = mi.Sequence("v", list(range(1, 13)), mi.SamplingParams(max_tokens=10), priority=2, arrival=1)
    s.add(a)
    s.add(v)
    s.update_from_output(s.schedule(), {"a": [5], "v": [13]})
    step1 = s.schedule()  # both decode: 6 of 8 blocks in use, their tokens not read
    assert step1.num_new_tokens == {"a": 1, "v": 1} and v.num_pending == 1
    s.add(mi.Sequence("u", [7, 7, 7, 7], mi.SamplingParams(max_tokens=10), priority=1, arrival=2))
    step2 = s.schedule()  # scheduled while step 1 runs
    assert step2.preempted_ids == ["v"] and "u" in step2.num_new_tokens and "v" not in step2.num_new_tokens
    s.update_from_output(step1, {"a": [6], "v": [14]})
    assert v.output_token_ids == [13, 14] and v.num_pending == 0 and v.status is mi.Status.WAITING
    s.update_from_output(step2, {"a": [7], "u": [8]})
    step3 = s.schedule()
    (back,) = [r for r in step3.new_requests if r.request_id == "v"]
    assert back.prompt_token_ids + back.output_token_ids == list(range(1, 15)) and step3.num_new_tokens["v"] == 14


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_later_requests_first_turn_outranks_an_earlier_requests_later_turns(policy):
    """One client request's 4 sequences (turns 0-3) fill max_num_seqs; a later request of one (turn 0)
    preempts the earlier request's last turn at the next step instead of waiting for all four; that
    one then waits without preempting back."""
    bm = mi.BlockManager(num_blocks=64, block_size=4)
    s = mi.Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, policy=mi.POLICIES[policy])
    params = mi.SamplingParams(max_tokens=50)
    for turn in range(4):
        s.add(mi.Sequence(f"big{turn}", [1, 2, 3], params, arrival=turn, turn=turn))
    s.update_from_output(s.schedule(), {f"big{t}": [5] for t in range(4)})
    s.add(mi.Sequence("small", [4, 4], params, arrival=4))
    out = s.schedule()
    assert out.preempted_ids == ["big3"] and "small" in out.num_new_tokens
    s.update_from_output(out, {r: [6] for r in out.num_new_tokens})
    again = s.schedule()
    assert not again.preempted_ids and set(again.num_new_tokens) == {"big0", "big1", "big2", "small"}
    assert [q.request_id for q in s.waiting] == ["big3"]
