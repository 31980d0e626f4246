"""Chapter 06: the scheduler as a hypothesis state machine (random arrivals, lengths, aborts, pool
sizes, both policies and both preemption modes), with a fake model that emits token 7."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import miniinfer as mi
from miniinfer.block_manager import blocks_needed


def check_pool(bm: mi.BlockManager) -> None:
    """Each block is free or owned: reference counts match the tables, nothing is in both."""
    owners = [0] * bm.num_blocks
    for table in bm.tables.values():
        for b in table:
            owners[b] += 1
    assert owners == bm.ref_count
    assert len(set(bm.free_list)) == len(bm.free_list) and all(owners[b] == 0 for b in bm.free_list)
    assert len(bm.free_list) + sum(o > 0 for o in owners) == bm.num_blocks
    assert max(owners, default=0) <= 1  # no forks here: a block has at most one owner


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 40), block_size=st.sampled_from([1, 2, 4, 16]),
                max_num_seqs=st.integers(1, 6), extra_budget=st.integers(0, 40),
                policy=st.sampled_from(["fcfs", "priority"]), mode=st.sampled_from(["recompute", "swap"]),
                cpu_blocks=st.integers(1, 20))
    def setup(self, num_blocks, block_size, max_num_seqs, extra_budget, policy, mode, cpu_blocks):
        self.bm = mi.BlockManager(num_blocks, block_size)
        self.cpu = mi.BlockManager(cpu_blocks, block_size) if mode == "swap" else None
        # As LLMEngine: the budget holds any admissible request whole (its prompt + outputs - 1).
        self.capacity = min(num_blocks * block_size, 24)
        self.budget = max(max_num_seqs, self.capacity) + extra_budget
        self.s = mi.Scheduler(self.bm, max_num_seqs, self.budget, policy, mode, self.cpu)
        self.seqs: list[mi.Sequence] = []

    def unfinished(self) -> list[mi.Sequence]:
        return [s for s in self.seqs if s.status is not mi.Status.FINISHED]

    @rule(data=st.data(), priority=st.integers(0, 3))
    def add(self, data, priority):
        total = data.draw(st.integers(2, self.capacity))
        prompt = data.draw(st.integers(1, total - 1))
        seq = mi.Sequence(str(len(self.seqs)), [1] * prompt, mi.SamplingParams(max_tokens=total - prompt),
                          priority, arrival=len(self.seqs))
        self.seqs.append(seq)
        self.s.add(seq)

    @precondition(lambda self: self.unfinished())
    @rule(data=st.data())
    def abort(self, data):
        self.s.finish(data.draw(st.sampled_from(self.unfinished())), "abort")

    @rule()
    def step(self):
        out = self.s.schedule()
        assert out.num_batched_tokens == sum(out.num_new_tokens) <= self.budget
        assert len(out.seqs) == len(set(map(id, out.seqs))) == len(self.s.running) <= self.s.max_num_seqs
        for seq, n, table in zip(out.seqs, out.num_new_tokens, out.block_tables):
            assert seq.status is mi.Status.RUNNING and table == self.bm.tables[seq]
            assert self.bm.lengths[seq] == seq.num_computed_tokens + n == seq.num_tokens
        for seq, n in zip(out.seqs, out.num_new_tokens):  # the model "runs": each gets token 7
            seq.num_computed_tokens += n
            seq.append(7, [])
            if seq.finish_reason:
                self.s.finish(seq)

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
            if on_device:
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
            self.step()
        assert all(s.status is mi.Status.FINISHED for s in self.seqs)
        assert all(s.finish_reason == "abort" or len(s.output_token_ids) == s.params.max_tokens for s in self.seqs)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.cpu is None or self.cpu.num_free_blocks == self.cpu.num_blocks


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_scheduler_state_machine = SchedulerMachine.TestCase
