"""Chapter 09: speculative decoding. Greedy output is the output without speculation (draft and
n-gram, k = 1..8, three architectures, under preemption, prefix caching and chunked prefill); sampled
output follows the target's distribution (chi-square, thousands of seeded requests), and the test
that shows it fails when the residual is replaced by p; bad configurations are refused."""

import dataclasses
import json

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import miniinfer as mi
import miniinfer.worker.speculative as spec
from miniinfer.course.parity import hf_greedy, make_hf_model
from miniinfer.worker.sample.sampler import sampling_probs, sampling_row


def prompts_with_repeats(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Random prompts, each a random piece said twice: n-gram lookup finds something to propose."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        piece = torch.randint(1, vocab, (3 + i % 7,), generator=g).tolist()
        out.append(piece + torch.randint(1, vocab, (i % 5,), generator=g).tolist() + piece)
    return out


def engine_for(folder, **kw) -> mi.LLMEngine:
    base = dict(model=folder, num_blocks=24, block_size=4, max_num_seqs=4, enable_prefix_caching=True,
                enable_chunked_prefill=True, max_num_batched_tokens=24)
    return mi.LLMEngine(mi.EngineConfig(**{**base, **kw}))


def run_all(engine: mi.LLMEngine, prompts, params) -> list[list[int]]:
    outs = [o.token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    runner = engine.executor.runner
    if isinstance(runner, spec.SpeculativeRunner) and isinstance(runner.proposer, spec.DraftProposer):
        assert set(runner.proposer.computed) <= set(runner.requests)  # it forgets with the runner
    return outs


@pytest.fixture(scope="module")
def draft_of(tmp_path_factory):
    """kind -> a one-layer draft checkpoint of that architecture (other weights than the target's)."""
    folders = {}

    def make(kind):
        if kind not in folders:
            folders[kind] = tmp_path_factory.mktemp(f"{kind}-draft")
            torch.manual_seed(1)
            make_hf_model(kind, num_hidden_layers=1).save_pretrained(folders[kind])
        return folders[kind]
    return make


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_greedy_output_is_the_output_without_speculation(hf_checkpoint, draft_of, method):
    """Both methods on three architectures, under preemption (a pool of 24 blocks of 4 tokens for
    eight requests of up to 46 tokens), prefix caching and chunked prefill: the tokens of
    transformers' greedy decoding, and every block back."""
    kind, folder, hf = hf_checkpoint
    prompts = prompts_with_repeats(8, 300)
    params = mi.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [hf_greedy(hf, p, 24) for p in prompts]
    for k, mode in [(1, "recompute"), (3, "swap"), (8, "recompute")]:
        extra = dict(speculative_model=draft_of(kind)) if method == "draft" else dict(speculative_method="ngram")
        engine = engine_for(folder, num_speculative_tokens=k, preemption_mode=mode, **extra)
        assert run_all(engine, prompts, params) == expected, (k, mode)
        assert engine.spec.verified > 0


@pytest.mark.parametrize("k", range(1, 9))
def test_course_model_pair_greedy_for_every_k(k):
    """pycoder with pycoder-draft and with n-grams, k = 1..8: the tokens without speculation."""
    prompts = ['def add(a, b):\n    """Return a + b."""\n', "for i in range(10):\n    print(i)\nfor j in range(",
               "x = [1, 2, 3]\n", 'def is_even(n):\n    """Return True if n is even."""\n']
    params = mi.SamplingParams(temperature=0, max_tokens=40)
    base = dict(num_blocks=64, block_size=4, max_num_seqs=3)
    expected = run_all(mi.LLMEngine(mi.EngineConfig(**base)), prompts, params)
    for extra in (dict(speculative_model="pycoder-draft"), dict(speculative_method="ngram")):
        engine = mi.LLMEngine(mi.EngineConfig(**base, num_speculative_tokens=k, **extra))
        assert run_all(engine, prompts, params) == expected, extra


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against probs, cells expecting fewer than 5 pooled into one."""
    expected = probs.double() * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A target and a draft of 6 tokens whose distributions differ much (large random weights)."""
    folders = []
    for seed in (0, 1):
        folder = tmp_path_factory.mktemp(f"tiny{seed}")
        hf = make_hf_model("llama", vocab_size=6, initializer_range=0.6, num_hidden_layers=1)
        with torch.no_grad():
            torch.manual_seed(seed)
            for param in hf.parameters():
                param.add_(torch.randn_like(param) * 0.1)
        hf.save_pretrained(folder)
        folders.append(folder)
    return folders


def sampled_tokens(target, draft, params, n: int, runner: type | None = None) -> torch.Tensor:
    """The first 3 of the 4 tokens of n seeded requests of prompt [1, 2]: [n, 3]. The first is
    sampled after the prompt; the next two are guesses verified in one step (then one token more)."""
    config = mi.EngineConfig(model=target, speculative_model=draft, num_speculative_tokens=2,
                             max_num_seqs=256, speculative_max_batch=n, num_blocks=512, block_size=4)
    components = mi.worker.components.build_components(config)
    engine = mi.LLMEngine(config, components=dataclasses.replace(components, runner=runner or components.runner))
    prompts = [[1, 2]] * n
    each = [mi.SamplingParams(**{**params, "seed": i}) for i in range(n)]
    outs = torch.tensor(run_all(engine, prompts, each))
    s = engine.spec
    assert s.verified >= n and 0.1 < s.acceptance_rate < 0.9  # guesses kept and guesses rejected, many of each
    return outs[:, :3]


def exact_joint(target, params: dict) -> torch.Tensor:
    """P(x1, x2, x3 | prompt [1, 2]) of the target, sampled with params: [216]."""
    model = mi.load_model(target)
    sp = mi.SamplingParams(**params)
    values = np.array([sampling_row(sp, 0, 6)] * 3, dtype=np.float64).T
    batch = mi.SamplingBatch.build(values, np.zeros(3, dtype=np.int64), 6, "cpu")
    out = torch.zeros(6, 6, 6, dtype=torch.float64)
    with torch.no_grad():
        for x1 in range(6):
            for x2 in range(6):
                probs = sampling_probs(model(torch.tensor([[1, 2, x1, x2]]))[0, 1:], batch).double()
                out[x1, x2] = probs[0, x1] * probs[1, x2] * probs[2]
    return out.flatten()


PARAMS = [dict(temperature=1.0, max_tokens=4, ignore_eos=True),
          dict(temperature=0.7, top_k=4, top_p=0.9, max_tokens=4, ignore_eos=True)]


def joint_counts(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens[:, 0] * 36 + tokens[:, 1] * 6 + tokens[:, 2], minlength=216)


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.7-topk-topp"])
def test_sampled_tokens_follow_the_target_distribution(tiny_pair, params):
    """3,000 seeded requests: the joint law of their 3 tokens (the 2nd and 3rd verified against a
    draft that proposes from another distribution) passes a chi-square test against the target's."""
    target, draft = tiny_pair
    tokens = sampled_tokens(target, draft, params, 3000)
    assert chi_square_p_value(joint_counts(tokens), exact_joint(target, params)) > 1e-3


class ResidualIsP(spec.SpeculativeRunner):
    @staticmethod
    def rejection_sample(p, q, guesses, u, noise):
        return spec.rejection_sample(p, q, guesses, u, noise)[0], (p / noise).argmax(-1)


def test_the_chi_square_test_catches_a_wrong_residual(tiny_pair):
    """The same test fails when a rejected guess is replaced by a sample from p instead of from
    norm(max(0, p - q)) (a runner with that rule in its seam): the check has the power to see the residual."""
    target, draft = tiny_pair
    tokens = sampled_tokens(target, draft, PARAMS[0], 3000, ResidualIsP)
    assert chi_square_p_value(joint_counts(tokens), exact_joint(target, PARAMS[0])) < 1e-6


@pytest.mark.parametrize("method", [dict(speculative_model="pycoder-draft"), dict(speculative_method="ngram")])
def test_seeded_requests_are_the_same_in_any_batch(method):
    """A seeded request with speculation samples the same tokens alone and among others: where a
    tight token budget cannot give every request its room for guesses in every step, and where a
    pool of 16 blocks of 4 tokens for four requests of 44 preempts them."""
    params = [mi.SamplingParams(temperature=1.5, top_p=0.95, max_tokens=30, seed=s) for s in range(4)]
    prompt = 'def add(a, b):\n    """Return a + b."""\n'
    alone = [run_all(mi.LLMEngine(mi.EngineConfig(num_speculative_tokens=3, **method)), [prompt], p)[0]
             for p in params]
    for budget, blocks, mode in ((6, None, "recompute"), (64, None, "recompute"), (64, 16, "recompute"),
                                 (64, 16, "swap")):
        config = mi.EngineConfig(num_speculative_tokens=3, max_num_seqs=8, enable_chunked_prefill=True,
                                 max_num_batched_tokens=budget, block_size=4, num_blocks=blocks,
                                 preemption_mode=mode, **method)
        engine = mi.LLMEngine(config)
        assert run_all(engine, [prompt] * 4, params) == alone, (budget, blocks, mode)


def test_verify_greedy_rows_and_outright_guesses():
    """Greedy rows keep a guess equal to the argmax and give the argmax; q=None (a guess proposed
    outright) is the same as a one-hot q."""
    g = torch.Generator().manual_seed(0)
    R, V = 40, 7
    logits = torch.randn(R, V, generator=g) * 3
    guesses = torch.randint(-1, V, (R,), generator=g)
    temps = torch.rand(R, generator=g).numpy() * (torch.rand(R, generator=g) > 0.3).numpy()
    values = torch.stack([torch.tensor(temps), torch.ones(R), torch.full((R,), V), torch.arange(R)]).double().numpy()
    s = mi.SamplingBatch.build(values, torch.arange(R).numpy(), V, "cpu")
    accepted, tokens = spec.verify(logits, s, guesses, None)
    one_hot = torch.nn.functional.one_hot(guesses.clamp(min=0), V).float() * (guesses >= 0)[:, None]
    assert torch.equal(spec.verify(logits, s, guesses, one_hot)[0], accepted)
    greedy = torch.tensor(temps) == 0
    assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])
    assert torch.equal(accepted[greedy], ((guesses == logits.argmax(-1)) & (guesses >= 0))[greedy])
    assert not accepted[guesses < 0].any()


@given(st.lists(st.integers(0, 3), min_size=1, max_size=30), st.integers(1, 6), st.integers(1, 4))
def test_ngram_guesses_follow_the_latest_longest_match(tokens, k, max_n):
    """Against a brute-force search: the longest n (max_n down to 1) whose last n tokens occur
    earlier followed by a token; from its latest such occurrence, the next k tokens."""
    expected = []
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tail]
        if starts:
            expected = tokens[starts[-1] + n:starts[-1] + n + k]
            break
    assert spec.ngram_guesses(tokens, k, max_n) == expected


@given(st.lists(st.integers(0, 4), min_size=1, max_size=12),
       st.lists(st.tuples(st.lists(st.integers(0, 4), max_size=5), st.integers(0, 5)), min_size=1, max_size=25),
       st.integers(1, 3), st.integers(1, 6))
def test_the_ngram_index_guesses_what_the_scan_does(prompt, steps, min_n, k):
    """The proposer's index against ngram_guesses at every proposal of a request whose tokens grow as
    the engine grows them between two proposals: by the guesses a step kept and one token more."""
    index, tokens = spec.NgramIndex(3, min_n), list(prompt)
    for guesses, kept in steps:
        assert index.guesses(tokens, k) == spec.ngram_guesses(tokens, k, 3, min_n)
        tokens += guesses[:kept] + [kept]
    assert index.guesses(tokens, k) == spec.ngram_guesses(tokens, k, 3, min_n)


def test_the_ngram_proposer_forgets_a_request_that_ends():
    """A finished or preempted request's index goes: one that comes back (preempted, its tokens
    rebuilt) starts from its tokens again."""
    proposer = spec.NgramProposer(mi.EngineConfig())
    runner = type("Runner", (), {"requests": {"a": type("R", (), {"token_ids": [1, 2, 3, 1, 2]})()}})()
    assert proposer.propose(runner, None, {"a": 2}) == ({"a": [3, 1]}, None)
    proposer.forget("a")
    assert "a" not in proposer.index
    runner.requests["a"].token_ids = [7, 8, 7]
    assert proposer.propose(runner, None, {"a": 2}) == ({"a": [8, 7]}, None)


def test_bad_configurations_are_refused_before_loading(tmp_path, hf_checkpoint):
    _, folder, _ = hf_checkpoint
    with pytest.raises(ValueError, match="needs a speculative_model"):
        mi.EngineConfig(speculative_method="draft")
    with pytest.raises(ValueError, match="uses no model"):
        mi.EngineConfig(speculative_method="ngram", speculative_model="pycoder-draft")
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive int"):
        mi.EngineConfig(speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative_method must be one of"):
        mi.EngineConfig(speculative_method="eagle")
    # A draft of another vocabulary: refused from the config files alone.
    with pytest.raises(ValueError, match="vocabulary of 301 tokens"):
        spec.DraftProposer(mi.EngineConfig(speculative_model=folder))
    # Same vocabulary size, another tokenizer: the course tokenizer with two tokens swapped.
    other = tmp_path / "other"
    other.mkdir()
    course = mi.course_model_path("pycoder-draft")
    for f in course.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="another tokenizer"):
        spec.DraftProposer(mi.EngineConfig(speculative_model=other))
    with pytest.raises(ValueError, match="no embedded course model"):
        spec.DraftProposer(mi.EngineConfig(speculative_model="no-such-model"))


def test_metrics_count_guesses():
    engine = mi.LLMEngine(mi.EngineConfig(speculative_method="ngram", num_speculative_tokens=4))
    run_all(engine, ["for i in range(10):\n    print(i)\nfor i in range(10):\n"], mi.SamplingParams(temperature=0,
                                                                                                   max_tokens=30))
    s = engine.stats.spec
    assert s.verified > 0 and 0 <= s.accepted <= s.proposed <= 4 * s.verified
    assert s.acceptance_rate == s.accepted / s.proposed and 1 <= s.tokens_per_step <= 5



def test_speculation_only_in_small_batches():
    """Above speculative_max_batch unfinished requests a step gets no room for guesses, and the next one
    is launched while it runs (chapter 06's overlap); once the batch is small again, guesses come
    back and steps wait for each other. Greedy tokens are the plain engine's either way."""
    prompts = ["for i in range(10):\n    print(i)\nfor i in range(10):\n" + "#" * i for i in range(4)]
    params = [mi.SamplingParams(temperature=0, max_tokens=6 + 8 * i, ignore_eos=True) for i in range(4)]
    plain = run_all(mi.LLMEngine(mi.EngineConfig()), prompts, params)
    engine = mi.LLMEngine(mi.EngineConfig(speculative_method="ngram", num_speculative_tokens=3,
                                          speculative_max_batch=2))
    schedule, log = engine.scheduler.schedule, []

    def logged():
        running, ahead = len(engine.scheduler.running), bool(engine.in_flight)
        out = schedule()
        log.append((running, bool(out.num_spec_tokens), ahead))
        return out
    engine.scheduler.schedule = logged
    assert run_all(engine, prompts, params) == plain
    assert all(running <= 2 and not ahead for running, guesses, ahead in log if guesses), log
    assert any(guesses for _, guesses, _ in log) and any(ahead for running, _, ahead in log if running > 2), log


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7, 11])
def test_the_room_comes_whole_near_the_end(max_tokens):
    """Room for all k guesses a step (so every verifying step can replay one graph), past max_tokens
    and past a stop too, inside the context: no token past them is kept, and each kept token has its
    log-probabilities, no more."""
    prompts = ["for i in range(10):\n    print(i)\nfor i in range(10):\n", "x = [1, 2, 3]\nx = [1, 2, 3]\nx = [",
               'def f(a):\n    """a"""\n    return a\ndef f(a):\n    """']
    params = mi.SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, stop_token_ids=[29])
    base = dict(num_blocks=64, block_size=4, max_num_seqs=3, max_model_len=34)
    plain = mi.LLMEngine(mi.EngineConfig(**base)).generate(prompts, params, use_tqdm=False)
    engine = mi.LLMEngine(mi.EngineConfig(**base, speculative_method="ngram", num_speculative_tokens=4))
    schedule, rooms = engine.scheduler.schedule, []

    def logged():
        out = schedule()
        rooms.extend((room, engine.scheduler.requests[rid].num_tokens) for rid, room in out.num_spec_tokens.items())
        return out
    engine.scheduler.schedule = logged
    outs = engine.generate(prompts, params, use_tqdm=False)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    for o, p in zip(outs, plain):
        assert o.token_ids == p.token_ids and len(o.logprobs) == len(o.token_ids) <= max_tokens
        rounded = [[(t.token, round(t.logprob, 4)) for t in out.logprobs] for out in (o, p)]
        assert rounded[0] == rounded[1]
    # every room k, but where the context (34 tokens) cuts it
    assert all(room == min(4, 34 - known) for room, known in rooms), rooms
    # A guess at a request's last token could never be kept: such a step is not counted as verifying.
    assert (engine.stats.spec.verified > 0) == (max_tokens > 2)


@pytest.mark.parametrize("method", [dict(speculative_method="ngram"), dict(speculative_model="pycoder-draft")])
def test_a_request_that_fills_the_pool_still_finishes(method):
    """Its prompt and max_tokens fill the pool exactly, and the context is longer: the room for guesses
    stops at the pool's end, or the request would preempt itself for a block the pool does not have."""
    engine = mi.LLMEngine(mi.EngineConfig(num_blocks=8, block_size=4, max_model_len=64, num_speculative_tokens=4,
                                          **method))
    engine.add_request(list(range(5, 25)), mi.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    steps = 0
    while engine.has_unfinished_requests() and steps < 100:
        engine.step()
        steps += 1
    assert not engine.has_unfinished_requests(), "the request never finished"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_speculation_in_any_batch_when_unbounded():
    """speculative_max_batch=None: guesses in a batch of any size, and the verify graphs (on a GPU)
    for as many requests as a step holds."""
    config = mi.EngineConfig(speculative_method="ngram", num_speculative_tokens=2, max_num_seqs=4,
                             speculative_max_batch=None)
    engine = mi.LLMEngine(config)
    assert engine.executor.runner.max_verified() == 4
    run_all(engine, ["for i in range(10):\n    print(i)\nfor i in range(10):\n"] * 6,
            mi.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert engine.stats.spec.verified > 0
    bounded = mi.LLMEngine(dataclasses.replace(config, speculative_max_batch=3), model=engine.model)
    assert bounded.executor.runner.max_verified() == 3
