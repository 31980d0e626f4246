"""Chapter 11's one-shot all-reduce, its kernel under Triton's CPU interpreter with one process playing
rank 0 (its buffer as the peer would leave it: the interpreter has no second GPU);
the dispatch by size; and a row-parallel layer's and the LM head's one-row GEMV against their forward,
in a gloo group of one."""

import pytest
import torch
import torch.distributed as dist

from miniinfer.kernels.allreduce import BLOCK, PROGRAMS, one_shot
from miniinfer.kernels.gemv import layer_gemv
from miniinfer.layers import parallel
from miniinfer.layers.parallel import ParallelLMHead, RowParallelLinear, Shard, all_reduce, use_one_shot

HALF = PROGRAMS * BLOCK + 4096  # room for a message that loops


class Rank0:
    """Rank 0's buffer as the peer leaves it (-0.0 where unwritten), and the peer's."""

    def __init__(self, dtype=torch.float32):
        self.mine, self.peer = torch.full((2 * HALF,), -0.0, dtype=dtype), torch.full((2 * HALF,), -0.0, dtype=dtype)
        self.counts = torch.zeros(PROGRAMS, dtype=torch.int32)

    def call(self, x: torch.Tensor, y: torch.Tensor, call: int) -> None:
        """The peer's part y of call `call` stored into rank 0's half, then rank 0's kernel."""
        base = (call % 2) * HALF
        self.mine[base:base + y.numel()] = y
        one_shot(x, self.mine, self.peer, self.counts)


def unwritten(t: torch.Tensor) -> bool:
    """Whether every slot of t is -0.0."""
    return bool(((t == 0) & torch.signbit(t)).all())


@pytest.mark.parametrize("n", [1, 5, BLOCK - 1, BLOCK + 1, 3 * BLOCK + 17, PROGRAMS * BLOCK + 4095])
def test_the_one_shot_adds_the_peers_part_call_after_call(n):
    rank, gen = Rank0(), torch.Generator().manual_seed(n)
    programs = min(PROGRAMS, -(-n // BLOCK))
    for call in (1, 2, 3):
        x, y = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        x_before, want = x.clone(), x + y
        rank.call(x, y, call)
        assert torch.equal(x, want)
        base = (call % 2) * HALF  # this call's half: rank 0 stores its part there for the peer
        assert torch.equal(rank.peer[base:base + n], x_before)
        assert unwritten(rank.mine[base:base + n]), "read slots are marked unwritten again"
        assert rank.counts[:programs].tolist() == [call] * programs and not rank.counts[programs:].any()
    assert unwritten(rank.mine), "the whole buffer unwritten after the calls"


def test_a_part_of_negative_zero_is_sent_as_zero():
    """-0.0 marks a slot not yet written, so a part that is -0.0 goes over as +0.0 (the same number),
    on both sides of the sum."""
    for dtype in (torch.float32, torch.bfloat16):
        rank = Rank0(dtype)
        x = torch.tensor([-0.0, -0.0, 1.0, -2.0], dtype=dtype)
        y = torch.tensor([0.0, 3.0, 0.0, 0.5], dtype=dtype)  # as the peer sends its -0.0: +0.0
        rank.call(x, y, 1)
        assert x.tolist() == [0.0, 3.0, 1.0, -1.5] and not torch.signbit(x[0])
        sent = rank.peer[HALF:HALF + 4]
        assert sent.tolist() == [0.0, 0.0, 1.0, -2.0] and not torch.signbit(sent[:2]).any()


def test_both_ranks_get_the_same_bits():
    """Rank 0 adds x + y, rank 1 y + x: the same sum, as each rank samples its own tokens from it."""
    for dtype in (torch.float32, torch.bfloat16):
        x, y = torch.randn(3000).to(dtype), torch.randn(3000).to(dtype)
        a, b = x.clone(), y.clone()
        Rank0(dtype).call(a, y, 1)
        Rank0(dtype).call(b, x, 1)
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def group_of_one(tmp_path_factory):
    store = tmp_path_factory.mktemp("dist") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Recorder:
    """A one-shot stand-in that serves messages up to max_bytes and notes their sizes."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.sizes = max_bytes, []

    def serves(self, x):
        return x.numel() * x.element_size() <= self.max_bytes

    def __call__(self, x):
        self.sizes.append(x.numel())
        return x


def test_all_reduce_sends_small_messages_to_the_one_shot_and_large_ones_to_the_group(group_of_one):
    recorder = Recorder(max_bytes=4 * 1000)
    use_one_shot(recorder)  # type: ignore[arg-type]
    try:
        small, large = torch.ones(1000), torch.ones(1001)
        all_reduce(small), all_reduce(large)
        assert recorder.sizes == [1000]
    finally:
        use_one_shot(None)
    assert parallel._one_shot is None


def test_a_row_parallel_layer_and_the_lm_head_take_the_gemv_in_a_step_of_one_row(group_of_one):
    torch.manual_seed(0)
    row = RowParallelLinear(slice(0, 48), 48, 40, bias=True, first=True)
    head = ParallelLMHead(301, 40, Shard(0, 1))
    for layer in (row, head):
        torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(row.bias)
    x, h, residual, norm = torch.randn(1, 48), torch.randn(1, 40), torch.randn(1, 40), torch.rand(40)
    out, total = layer_gemv(row, x)
    assert total is None and torch.allclose(out, row(x), atol=1e-4)
    logits, total = layer_gemv(head, h, residual=residual, norm=(norm, 1e-6))
    s = h + residual
    want = head(s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * norm)
    assert torch.allclose(total, s) and torch.allclose(logits, want, atol=1e-4)
    assert layer_gemv(row, torch.randn(2, 48)) is None  # two rows: the layer's own forward
