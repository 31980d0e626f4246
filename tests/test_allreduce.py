"""Chapter 11's one-shot all-reduce, its kernel under Triton's CPU interpreter with one process playing
rank 0 (its buffer as the peer would leave it: the interpreter has no second GPU);
the dispatch by size; and a row-parallel layer's and the LM head's one-row GEMV against their forward,
in a gloo group of one."""

import pytest
import torch
import torch.distributed as dist

import miniinfer as mi
from miniinfer.kernels.allreduce import (
    BLOCK,
    PROGRAMS,
    ROW_PROGRAMS,
    OneShotAllReduce,
    one_shot,
    one_shot_add_rms_norm,
)
from miniinfer.kernels.gemv import gemv, layer_gemv
from miniinfer.layers import parallel
from miniinfer.layers.parallel import (
    ParallelLMHead,
    RowParallelLinear,
    Shard,
    all_reduce,
    shard_model,
    sum_at_norms,
    use_one_shot,
)
from miniinfer.model.transformer import add_rms_norm

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


@pytest.mark.parametrize("M", [1, 3, ROW_PROGRAMS + 2])
def test_the_one_shot_with_the_norm_adds_the_peers_rows_the_residual_and_normalizes(M):
    """Rank 0's kernel of the sum, the residual add and the norm, call after call, rows of 37 numbers (more
    rows than programs: a program loops over its rows), against the sum and chapter 01's add and norm."""
    H, half = 37, (ROW_PROGRAMS + 2) * 37
    for dtype in (torch.float32, torch.bfloat16):
        mine, peer = torch.full((2 * half,), -0.0, dtype=dtype), torch.full((2 * half,), -0.0, dtype=dtype)
        counts = torch.zeros(ROW_PROGRAMS, dtype=torch.int32)
        gen = torch.Generator().manual_seed(M)
        for call in (1, 2, 3):
            h, y, x = (torch.randn(M, H, generator=gen).to(dtype) for _ in range(3))
            w = torch.rand(H, generator=gen).to(dtype)
            base = (call % 2) * half
            mine[base:base + M * H] = y.flatten()
            normed, s = one_shot_add_rms_norm(h, x, w, 1e-6, mine, peer, counts)
            want_normed, want_s = add_rms_norm(h + y, x, w, 1e-6)
            if dtype == torch.float32:  # the interpreter rounds to bf16 its own way: a step apart at most there
                assert torch.equal(s, want_s), "the sum rounded as the one-shot stores it, then the residual's add"
            step = dict(atol=2 ** -6, rtol=2 ** -6) if dtype == torch.bfloat16 else {}  # two roundings
            torch.testing.assert_close(s, want_s, **step)
            torch.testing.assert_close(normed, want_normed, **step)
            assert torch.equal(peer[base:base + M * H], h.flatten())
            assert unwritten(mine)
            programs = min(M, ROW_PROGRAMS)
            assert counts[:programs].tolist() == [call] * programs and not counts[programs:].any()


def test_a_gemv_sends_its_row_where_the_row_kernel_looks_next_which_then_sends_nothing():
    """Chapter 06's GEMV with `send` stores its row into the peer's buffer, in the half the row kernel's
    next call takes (its count + 1), call after call; that call (sent=True) leaves the peer's buffer alone
    (a marker there stays) and sums as the kernels apart."""
    N, K, half = 37, 53, 64
    mine, peer = torch.full((2 * half,), -0.0), torch.full((2 * half,), -0.0)
    counts = torch.zeros(ROW_PROGRAMS, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(N, K, generator=gen), torch.randn(1, K, generator=gen)
    send = dict(peer=peer, counts=counts, half=half, programs=ROW_PROGRAMS)
    for call in (1, 2, 3):
        base = (call % 2) * half
        out, _ = gemv(x, weight, send=send)
        torch.testing.assert_close(out, x @ weight.T)
        assert torch.equal(peer[base:base + N], out[0]), "the row, in the half of the next call"
        assert unwritten(peer[half - base:half - base + N]), "the other half untouched"
        peer[base:base + N] = 7.0  # a marker: the row kernel must not send again
        y, res, w = (torch.randn(1, N, generator=gen) for _ in range(3))
        mine[base:base + N] = y[0]  # the peer's row
        normed, s = one_shot_add_rms_norm(out, res, w[0], 1e-6, mine, peer, counts, sent=True)
        want_normed, want_s = add_rms_norm(out + y, res, w[0], 1e-6)
        assert torch.equal(s, want_s)
        torch.testing.assert_close(normed, want_normed)
        assert (peer[base:base + N] == 7.0).all() and unwritten(mine) and counts[0] == call
        peer.fill_(-0.0)


def test_a_row_parallel_layer_sends_its_row_to_the_norm_after_it_and_nothing_is_left_unsummed(group_of_one):
    """The wiring, on the CPU (a one-shot made by hand: symmetric memory needs GPUs): a row-parallel layer
    that leaves its sum to the norm gets `send_args`, its GEMV stores the row into the peer's buffer and
    marks it `sent`; `add_rms_norm` of that row sums it without sending again; a row it cannot sum after
    sending, or another row summed first, is an error, not a silent wrong sum; rows past the buffer, or of
    a layer that does not send (the last, whose rows may be picked before the norm), are not sent at all."""
    N, K, half = 40, 48, 256
    one = object.__new__(OneShotAllReduce)
    one.dtype, one.max_bytes = torch.float32, half * 4
    mine, peer = torch.full((2 * half,), -0.0), torch.full((2 * half,), -0.0)
    one.row_buffers = (mine, peer, torch.zeros(ROW_PROGRAMS, dtype=torch.int32))
    torch.manual_seed(0)
    layer = RowParallelLinear(slice(0, K), K, N, bias=False, first=True)
    torch.nn.init.normal_(layer.weight)
    layer.reduce = False
    x, res, w, y = torch.randn(1, K), torch.randn(1, N), torch.rand(N), torch.randn(1, N)
    use_one_shot(one)
    try:
        h, _ = layer_gemv(layer, x)
        assert one.sent is h and torch.equal(peer[half:half + N], h[0])
        mine[half:half + N] = y[0]
        peer.fill_(-0.0)
        normed, s = one.add_rms_norm(h, res, w, 1e-6)
        assert one.sent is None and torch.equal(s, add_rms_norm(h + y, res, w, 1e-6)[1]) and unwritten(peer)
        h, _ = layer_gemv(layer, x)
        with pytest.raises(RuntimeError, match="cannot sum"):
            one.add_rms_norm(h, res.double(), w, 1e-6)
        layer_gemv(layer, x)
        with pytest.raises(RuntimeError, match="not the next one summed"):  # a copy of it, say: not what was sent
            one.add_rms_norm(res.clone(), res, w, 1e-6)
        assert one.sent is None and one.send_args(torch.randn(1, K), half + 1) is None
        assert one.send_args(x.double(), N) is None
        layer.sends = False  # the layer before the last norm: rows may be picked between
        peer.fill_(-0.0)
        layer_gemv(layer, x)
        assert one.sent is None and unwritten(peer)
    finally:
        use_one_shot(None)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
def test_a_rank_its_own_peer_sends_every_row_of_a_model_and_sums_each_once(group_of_one, device):
    """The sending through a whole model (compiled on a GPU, interpreted on the CPU): a group of one
    whose one-shot's peer buffer is its own, so each sum is its part twice, with the embedding, o and down
    at half weight (exact in any float): chapter 06's GEMVs and RankSums give the course model's own greedy
    tokens, and its own logits in a step of one row with logits_at (the rows picked before the last norm)
    and with none picked; every sent row is summed by the next norm, and the buffer ends unwritten."""
    from miniinfer.kernels.gemv import FusedOps
    from miniinfer.model.transformer import CausalAttention
    prompt, greedy = [5, 17, 200, 3, 99], mi.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    reference = mi.load_model(device=device)
    reference.ops = FusedOps()
    want = mi.generate_cached(reference, prompt, greedy)
    model = mi.load_model(device=device, prepare=lambda m: shard_model(m, Shard(0, 1)))
    model.ops = FusedOps()
    sum_at_norms(model)
    with torch.no_grad():
        for w in [model.model.embed_tokens.weight] + [p for layer in model.model.layers for p in
                                                       (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight)]:
            w.mul_(0.5)
    H = model.cfg.hidden_size
    one = object.__new__(OneShotAllReduce)
    one.dtype, one.max_bytes = model.dtype, 16 * H * model.dtype.itemsize
    buffer = torch.full((32 * H,), -0.0, dtype=model.dtype, device=device)
    one.row_buffers = (buffer, buffer, torch.zeros(ROW_PROGRAMS, dtype=torch.int32, device=device))
    sends = []
    send_args = one.send_args
    one.send_args = lambda x, n: sends.append(send_args(x, n)) or sends[-1]  # type: ignore[method-assign]
    use_one_shot(one)
    try:
        # eager: the LM head's gather over gloo cannot be captured in a CUDA graph
        assert mi.generate_static_batch(model, [prompt], greedy, cuda_graph=False) == [want]
        assert any(sends) and one.sent is None and unwritten(buffer)
        ids = torch.tensor([[7]], device=device)
        for at in (torch.tensor([0], device=device), torch.tensor([], dtype=torch.long, device=device)):
            got = model(ids, attn=CausalAttention(), logits_at=at)  # the LM head is the embedding (tied): half
            torch.testing.assert_close(2 * got, reference(ids, attn=CausalAttention(), logits_at=at))
            assert one.sent is None and unwritten(buffer)
    finally:
        use_one_shot(None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_two_ranks_on_one_gpu_sum_and_normalize_as_the_kernels_apart():
    """Both ranks' kernels on one GPU, on two streams, each the other's peer (each spins until the other's
    part arrives): the one-shot, then the one with the norm, against the sum and chapter 04's kernel."""
    from miniinfer.kernels.norm_rope import fused_add_rms_norm
    dev, dtype, H, half = torch.device("cuda"), torch.bfloat16, 4096, 256 * 4096
    buffers = [torch.full((4 * half,), -0.0, dtype=dtype, device=dev) for _ in range(2)]
    counts = [torch.zeros(PROGRAMS, dtype=torch.int32, device=dev) for _ in range(2)]
    row_counts = [torch.zeros(ROW_PROGRAMS, dtype=torch.int32, device=dev) for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in range(2)]
    gen = torch.Generator(device=dev).manual_seed(0)
    # Each kernel loaded first, alone (the peer's part already in place): loading a module while the other
    # rank's kernel spins could wait for the device to be idle, which it never would be.
    w = torch.ones(H, dtype=dtype, device=dev)
    for r in range(2):
        mine = buffers[r].chunk(2)
        for buffer in mine:
            buffer[buffer.numel() // 2:].fill_(1.0)  # the half of call 1
        one_shot(torch.ones(1, H, dtype=dtype, device=dev), mine[0], buffers[1 - r].chunk(2)[0], counts[r])
        one_shot_add_rms_norm(torch.ones(1, H, dtype=dtype, device=dev), w[None], w, 1e-6, mine[1],
                              buffers[1 - r].chunk(2)[1], row_counts[r])
    torch.cuda.synchronize()
    for t in buffers + counts + row_counts:
        t.fill_(-0.0) if t.is_floating_point() else t.zero_()
    for M in (1, 3, 256, 1):
        h, x = ([torch.randn(M, H, generator=gen, device=dev).to(dtype) for _ in range(2)] for _ in range(2))
        w = torch.rand(H, generator=gen, device=dev).to(dtype)
        summed = [t.clone() for t in h]
        out: list = [None, None]
        torch.cuda.synchronize()
        for r in range(2):
            with torch.cuda.stream(streams[r]):
                mine, peer = buffers[r].chunk(2), buffers[1 - r].chunk(2)
                one_shot(summed[r], mine[0], peer[0], counts[r])
                out[r] = one_shot_add_rms_norm(h[r], x[r], w, 1e-6, mine[1], peer[1], row_counts[r])
        torch.cuda.synchronize()
        assert torch.equal(summed[0], summed[1]) and torch.equal(summed[0], (h[0].float() + h[1].float()).to(dtype))
        for r in range(2):
            want_normed, want_s = fused_add_rms_norm(summed[r], x[r], w, 1e-6)
            assert torch.equal(out[r][1], want_s)
            torch.testing.assert_close(out[r][0], want_normed, atol=0, rtol=2 ** -7)
        assert all(unwritten(b.cpu().float()) for b in buffers)


@pytest.fixture(scope="module")
def group_of_one(tmp_path_factory):
    store = tmp_path_factory.mktemp("dist") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Recorder:
    """A one-shot stand-in that serves messages up to max_bytes and notes their sizes."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.sizes, self.sent = max_bytes, [], None

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


class OneShotStandIn(Recorder):
    """A one-shot in a group of one: the sum is the rank's own part; counts the norms it does."""

    def __init__(self):
        super().__init__(max_bytes=1 << 30)
        self.norms = 0

    def add_rms_norm(self, h, x, weight, eps):
        self.norms += 1
        return add_rms_norm(h, x, weight, eps)

    def send_args(self, x, n):
        return None  # nothing to send to


def test_sum_at_norms_leaves_each_sum_to_the_norm_after_it(group_of_one):
    """The embedding, o and down return their part; the model's ops add the parts at the norm after each,
    in the one-shot (2 per layer and the final norm, per forward); the tokens stay the same. A row-parallel
    subclass with a forward of its own (problem set 11's) keeps its sum, and its norm does not add again."""
    class OwnForward(RowParallelLinear):
        def forward(self, x):
            return all_reduce(torch.nn.functional.linear(x, self.weight, self.bias))

    prompt, greedy = [5, 17, 200, 3, 99], mi.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = mi.generate_cached(mi.load_model(), prompt, greedy)
    model = mi.load_model(prepare=lambda m: shard_model(m, Shard(0, 1)))
    layers = model.model.layers
    layers[1].self_attn.o_proj.__class__ = OwnForward
    sum_at_norms(model)
    assert not model.model.embed_tokens.reduce and not layers[0].mlp.down_proj.reduce
    assert layers[0].mlp.down_proj.sends and not layers[-1].mlp.down_proj.sends, "the last norm's rows may be picked"
    assert layers[1].self_attn.o_proj.reduce and layers[1].post_attention_layernorm not in model.ops.partial
    assert layers[0].post_attention_layernorm in model.ops.partial and model.model.norm in model.ops.partial
    stand_in, forwards = OneShotStandIn(), []
    layers[0].register_forward_pre_hook(lambda *_: forwards.append(1))
    use_one_shot(stand_in)  # type: ignore[arg-type]
    try:
        assert mi.generate_cached(model, prompt, greedy) == want
    finally:
        use_one_shot(None)
    assert len(model.ops.partial) == 2 * len(layers) and stand_in.norms == len(forwards) * 2 * len(layers)
