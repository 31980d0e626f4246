"""SamplingParams validation, the sampler, and the stopping rules of generation."""

import numpy as np
import pytest
import torch
from conftest import eos_is

import miniinfer as mi
from miniinfer.core.sampling_params import GREEDY_BELOW, FieldError, sample, top_p_filter
from miniinfer.kernels.argmax import chunked_argmax
from miniinfer.kernels.sampling import fused_sample
from miniinfer.worker.sample.sampler import exponential_noise, hash32, row_keys, sampling_probs, sampling_row


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(temperature=float("nan")), "temperature must be >= 0"),
    (dict(temperature=float("inf")), "temperature must be finite"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be an int >= 0"),
    (dict(top_k=2.5), "top_k must be an int >= 0"),
    (dict(max_tokens=0), "max_tokens must be an int >= 1"),
])
def test_invalid_params_raise(kwargs, message):
    """Each refusal names its field (FieldError, a ValueError), which a server passes on as `param`."""
    with pytest.raises(FieldError, match=message) as err:
        mi.SamplingParams(**kwargs)
    assert err.value.field == next(iter(kwargs))


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    assert torch.equal(sample(logits, mi.SamplingParams(temperature=0)), logits.argmax(-1))


@pytest.mark.parametrize("block", [1, 4, 16, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_argmax_is_torchs(block, dtype):
    """The GPU's argmax (a kernel of chunks, under the interpreter here) against torch.argmax on random rows
    of odd lengths: few distinct values, so ties fall within chunks and across them; rows of -inf only;
    a NaN (the largest, as in torch), and a row longer than the chunk, shorter, and of one logit. Where
    torch differs: a NaN beside a +inf."""
    gen = torch.Generator().manual_seed(block)
    for B, V in [(1, 1), (1, 37), (3, 100), (5, 3), (2, 129)]:
        x = torch.randint(-2, 3, (B, V), generator=gen).to(dtype)
        if B > 2:
            x[1] = float("-inf")
            x[2, V // 2] = float("nan")
        assert torch.equal(chunked_argmax(x, block), x.argmax(-1)), (B, V)
        assert torch.equal(chunked_argmax(x[:, :V - V // 3], block), x[:, :V - V // 3].argmax(-1)), "a view's rows"
    assert chunked_argmax(torch.empty(0, 7, dtype=dtype), block).shape == (0,)
    inf, nan = float("inf"), float("nan")  # a NaN counts as +inf: the first of them (torch's takes the first NaN)
    both = torch.tensor([[1.0, inf, 2.0, nan], [nan, 0.0, inf, 1.0]], dtype=dtype)
    assert chunked_argmax(both, block).tolist() == [1, 0]


def test_top_k_only_draws_from_the_k_best():
    logits = torch.randn(1, 100).expand(2000, 100)
    drawn = sample(logits, mi.SamplingParams(temperature=5.0, top_k=3, seed=0),
                   mi.SamplingParams(seed=0).generator())
    assert set(drawn.tolist()) == set(logits[0].topk(3).indices.tolist())


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(top_p_filter(logits, 0.8)).tolist() == [[False, False, True, True]]
    assert torch.isinf(top_p_filter(logits, 0.81)).tolist() == [[False, False, False, True]]
    assert torch.isinf(top_p_filter(logits, 0.01)).tolist() == [[False, True, True, True]]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    drawn = sample(probs.log().expand(20000, 3), mi.SamplingParams(temperature=1.0),
                   torch.Generator().manual_seed(0))
    freq = torch.bincount(drawn, minlength=3) / 20000
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)


@pytest.fixture(scope="module")
def course():
    return mi.load_model(), mi.load_tokenizer()


def test_seed_makes_sampling_reproducible(course):
    model, tok = course
    prompt = tok("def main():\n").input_ids
    params = mi.SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, ignore_eos=True, seed=7)
    a, b = mi.generate_naive(model, prompt, params), mi.generate_naive(model, prompt, params)
    c = mi.generate_naive(model, prompt, mi.SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20,
                                                           ignore_eos=True, seed=8))
    assert a == b and a != c and len(a) == 20


def test_generation_stops_at_eos_unless_ignored(course):
    model, tok = course
    prompt = tok("x = 1\n").input_ids
    full = mi.generate_naive(model, prompt, mi.SamplingParams(temperature=0, max_tokens=12,
                                                              ignore_eos=True))
    with eos_is(model, full[5]):  # the sixth token
        out = mi.generate_naive(model, prompt, mi.SamplingParams(temperature=0, max_tokens=12))
        ignored = mi.generate_naive(model, prompt, mi.SamplingParams(temperature=0, max_tokens=12,
                                                                     ignore_eos=True))
    assert out == full[:full.index(full[5]) + 1] and ignored == full


def test_prompt_that_cannot_fit_is_refused(course):
    model, _ = course
    ctx = model.cfg.max_position_embeddings
    with pytest.raises(ValueError, match=f"exceeds the model's context of {ctx} tokens"):
        mi.generate_naive(model, [1] * (ctx - 3), mi.SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="the prompt is empty"):
        mi.generate_naive(model, [], mi.SamplingParams())


# Chapter 06: the engine's vectorized sampler.

def batch_of(params: list[mi.SamplingParams], seeds: list[int], steps: list[int], vocab: int) -> mi.SamplingBatch:
    values = np.array([sampling_row(p, s, vocab) for p, s in zip(params, seeds)], dtype=np.float64).T
    return mi.SamplingBatch.build(values, np.array(steps), vocab, "cpu")


def test_exponential_race_samples_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0])
    n = 20000
    b = batch_of([mi.SamplingParams(temperature=1.0)] * n, list(range(n)), [0] * n, 6)
    counts = torch.bincount(mi.sample_batch(logits.expand(n, -1), b), minlength=6).float()
    p = logits.softmax(-1)
    assert ((counts / n - p).abs() < 4 * (p * (1 - p) / n).sqrt() + 1e-3).all(), (counts / n, p)


def allowed_tokens(logits: torch.Tensor, p: mi.SamplingParams) -> set[int]:
    """The tokens chapter 01's single-request sampler can pick under p (its filters, in its order)."""
    if p.temperature == 0:
        return {logits.argmax().item()}
    x = logits.float() / p.temperature
    if p.top_k:
        x = x.masked_fill(x < x.topk(p.top_k).values[-1], float("-inf"))
    if p.top_p < 1:
        x = top_p_filter(x[None], p.top_p)[0]
    return set(torch.isfinite(x).nonzero().flatten().tolist())


def test_rows_follow_their_own_parameters():
    torch.manual_seed(0)
    vocab, n = 50, 400
    logits = torch.randn(1, vocab).expand(n, -1)
    kinds = [mi.SamplingParams(temperature=0), mi.SamplingParams(temperature=1.0, top_k=3),
             mi.SamplingParams(temperature=0.7, top_p=0.5), mi.SamplingParams(temperature=2.0, top_k=10, top_p=0.8)]
    params = [kinds[i % 4] for i in range(n)]
    tokens = mi.sample_batch(logits, batch_of(params, list(range(n)), [0] * n, vocab))
    for i, p in enumerate(params):
        assert tokens[i].item() in allowed_tokens(logits[0], p), (p, tokens[i].item())
    assert (tokens[0::4] == logits[0].argmax()).all()
    assert len(set(tokens[1::4].tolist())) == 3  # top-k 3: all three show up in 100 draws


def test_noise_depends_on_seed_and_step_only():
    vocab = 1000
    a = mi.worker.sample.sampler.exponential_noise(torch.tensor([5, 7, 5]), torch.tensor([3, 3, 4]), vocab)
    b = mi.worker.sample.sampler.exponential_noise(torch.tensor([1, 5]), torch.tensor([0, 3]), vocab)
    assert torch.equal(a[0], b[1]) and not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert (a > 0).all() and torch.isfinite(a).all()
    assert abs(a.mean().item() - 1) < 0.05  # Exponential(1) has mean 1


def test_seeds_fold_all_64_bits_into_the_noise_seed():
    from miniinfer.worker.sample.sampler import seed32
    assert [seed32(s) for s in (0, 5, 2 ** 32 - 1)] == [0, 5, 2 ** 32 - 1]  # as before, below 2^32
    assert len({seed32(s) for s in (5, 2 ** 32 + 5, 2 ** 40 + 5, 2 ** 63 + 5)}) == 4
    assert seed32(-1) == seed32(2 ** 64 - 1) and 0 <= seed32(2 ** 64 - 1) < 2 ** 32
    for bad in (2 ** 64, -(2 ** 63) - 1, 1.5):
        with pytest.raises(ValueError, match="seed must be an int"):
            mi.SamplingParams(seed=bad)
    assert mi.SamplingParams(seed=2 ** 64 - 1).generator() is not None  # what torch.Generator takes


@pytest.mark.parametrize("V, block, spread, dtype", [(1, 16, 1.0, torch.float32), (33, 16, 2.0, torch.float32),
                                                     (97, 32, 6.0, torch.bfloat16), (250, 64, 20.0, torch.float32)])
def test_the_fused_sampling_kernel_draws_the_sorts_tokens(V, block, spread, dtype):
    """Chapter 06's sampling kernel (under the interpreter) against sampling_probs' sorts and the noise's
    argmax: greedy rows get 0 (sample_batch takes their argmax), a row with no token allowed -1, and
    every other row the same token, for random temperatures, top-p (one that rounds to 0 in float32
    among them) and top-k, odd vocabularies and chunks of 16-64 logits."""
    torch.manual_seed(V)
    B = 12
    t = torch.tensor([0.0, 1e-8, 0.3, 0.7, 1.0, 1.0, 1.5, 2.0, 0.9, 1.2, 0.6, 1.0])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.5, 0.99, 1e-46, 1.0, 0.95, 0.8, 0.3, 1.0, 0.9])
    top_k = torch.tensor([V, 3, V, 5, V, V, 2, 40, 1, V, 7, V]).clamp(max=V)
    seeds, steps = torch.randint(0, 2 ** 31, (B,)), torch.randint(0, 1000, (B,))
    logits = (torch.randn(B, V) * spread).to(dtype)
    logits[3, max(1, V // 2):] = float("-inf")  # fewer tokens left than its top-k (a grammar's mask)
    logits[-1] = float("-inf")  # none left
    k_max = int(top_k[top_k < V].max()) if (top_k < V).any() else 0
    s = mi.SamplingBatch(t, top_k, top_p, seeds, steps, True, True, k_max)
    want = (sampling_probs(logits, s) / exponential_noise(seeds, steps, V)).argmax(-1)
    got = fused_sample(logits, t, top_k, top_p, row_keys(seeds, steps), k_max, GREEDY_BELOW, block=block)
    assert got[0] == 0 and got[-1] == -1
    assert torch.equal(got[1:-1], want[1:-1])


def test_no_token_draws_noise_of_zero():
    """The largest of the noise's 24-bit draws, 2^24 - 0.5 scaled by 2^-24, rounds to 1.0 in float32,
    and -log(1) = 0 would give its token p / 0 = -inf: never drawn, and a kernel walking its row for
    the next candidate would never end. Seed 3117471674 at step 0 gives token 0 that draw: its noise
    stays above 0, and the kernel draws the token the sorts do (token 0, whose noise is the smallest)."""
    seeds, steps = torch.tensor([3117471674]), torch.tensor([0])
    assert int(hash32(row_keys(seeds, steps))) >> 8 == 2 ** 24 - 1  # token 0's bits: the largest
    noise = exponential_noise(seeds, steps, 8)
    assert (noise > 0).all() and noise[0, 0] == noise.min()
    logits = torch.tensor([[3.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0]])
    t, top_k, top_p = torch.tensor([1.0]), torch.tensor([8]), torch.tensor([1.0])
    s = mi.SamplingBatch(t, top_k, top_p, seeds, steps, True, False, 0)
    want = (sampling_probs(logits, s) / noise).argmax(-1)
    assert want.item() == 0
    assert fused_sample(logits, t, top_k, top_p, row_keys(seeds, steps), 0, GREEDY_BELOW, block=4).item() == 0
