"""The problem-set checks catch plausible mistakes: a check that passes a wrong answer teaches nothing."""

import functools
import re
import sys
from pathlib import Path

import pytest
import torch
from mutants import (  # noqa: E402
    ch01,
    ch02,
    ch03,
    ch04,
    ch05,
    ch06,
    ch07,
    ch08,
    ch09,
    ch10,
    ch11,
    ch12,
    ch13,
    ch14,
    ch15,
    ch16,
    ch17,
    ch99,
)
from mutants.ch03 import Blocks, FreeLeaks, NeverGrows  # noqa: E402
from mutants.ch09 import keep_counting_every_accepted, ngram_at_the_earliest_place, rejection_sample_residual_is_p  # noqa: E402
from mutants.ch10 import KernelsOn, gemv_first_group_scale_only, gptq_error_not_divided  # noqa: E402
from mutants.ch11 import (  # noqa: E402
    ColumnOfTheFirstPieceOnly,
    EmbeddingWithoutZeros,
    HeadInReverse,
    RowWithoutTheSum,
    ShardOneHeadEach,
    ShardWithoutReplication,
)
from mutants.ch12 import (  # noqa: E402
    MatcherFirstCharOnly,
    bitmask_most_significant_first,
    penalize_openai_first,
    prompt_rows_from_the_chunk_start,
    rank_from_zero,
)

import miniinfer as mi
import miniinfer.worker.speculative as spec
from miniinfer.course import checks as testing
from miniinfer.course.checks import ch09 as checks09
from miniinfer.course.checks import ch12 as checks12
from miniinfer.engine.disaggregated import PrefillEngine
from miniinfer.layers.parallel import ParallelLayers
from miniinfer.layers.quantization import gptq_columns
from miniinfer.worker.sample.logprobs import Logprobs, PromptLogprobs
from miniinfer.worker.sample.processors import Penalties
from miniinfer.worker.structured_output import Structured

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import build  # noqa: E402

CHAPTERS = (ch01, ch02, ch03, ch04, ch05, ch06, ch07, ch08, ch09, ch10, ch11, ch12, ch13, ch14, ch15, ch16, ch17,
            ch99)
ID_OF = {e.check: e.id for e in testing.EXERCISES.values()}
ALL = [(ID_OF[check], check, wrong) for module in CHAPTERS for check, wrong in module.MUTANTS]
# Each problem set's last exercise runs the model or the engine on the student's pieces: broken pieces below.
LAST_PARTS = {testing.last_part(f"{n:02}").id for n in range(1, 18)}


@pytest.fixture(autouse=True, scope="module")
def no_rank_left():
    """Problem set 11's checks keep their two rank processes for the next check: none outlives this
    module (tests/test_parallel.py, in the same worker, looks for processes left behind)."""
    yield
    testing.close_ranks()


def rejected(check, wrong) -> None:
    """The check raises AssertionError on the wrong answer: a wrong result, not a crash or a pass."""
    with pytest.raises(AssertionError):
        check(wrong)


@pytest.mark.parametrize("check, wrong", [(c, w) for _, c, w in ALL],
                         ids=[f"{i}-{getattr(w, '__name__', '?')}" for i, _, w in ALL])
def test_every_check_rejects_its_mutants(check, wrong):
    rejected(check, wrong)


def test_every_exercise_has_three_mutants():
    """At least three plausible wrong answers per exercise (a last part: a broken piece each; a speed
    item: slow variants, timed on a GPU by tools/bench_grade.py)."""
    counts = {e: sum(i == e for i, _, _ in ALL) for e, ex in testing.EXERCISES.items() if not ex.speed}
    assert {e: n for e, n in counts.items() if n < 3 and e not in LAST_PARTS} == {}


def test_the_right_block_manager_passes():
    testing.check_block_manager(Blocks)
    testing.check_append_token(Blocks)


def test_reference_scheduler_helpers_agree_with_the_engine_scheduler():
    """The admit reference is the engine's admission (watermark aside), on one concrete case."""
    bm = mi.BlockManager(10, 4)
    sched = mi.Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=30)
    lens = [9, 12, 5, 2]
    for i, n in enumerate(lens):
        sched.add(mi.Sequence(str(i), [1] * n, mi.SamplingParams(max_tokens=1), arrival=i))
    out = sched.schedule()
    assert len(out.num_new_tokens) == testing._admit_ref(lens, 10, 4, 3, 30) == 3


solved = functools.cache(build.solution_globals)  # one kernel's globals per problem set


@pytest.mark.parametrize("chapter, piece, wrong, says", [
    ("01", "rms_norm", ch01.rms_norm_over_the_whole_tensor, "the tokens differ"),
    ("01", "apply_rope", ch01.rope_interleaved, "the tokens differ"),
    ("01", "causal_attention", ch01.attention_without_mask, "the tokens differ"),
    ("01", "top_p_filter", ch01.top_p_without_sorting, "the tokens differ"),
    ("02", "write_kv", ch02.write_kv_one_slot_early, "the tokens differ"),
    ("02", "cached_attention", ch02.cached_attention_without_the_newest, "the tokens differ"),
    ("03", "MyBlockManager", FreeLeaks, "blocks were not given back"),
    ("03", "MyBlockManager", NeverGrows, "your code raised IndexError"),
    ("03", "slot_mapping", ch03.slots_from_zero, "the tokens differ"),
    ("03", "gather_kv", ch03.gather_one_short, "the tokens differ"),
    ("04", "rms_norm", ch04.norm_kernel_mean_over_the_padded_block, "the tokens differ"),
    ("04", "apply_rope", ch04.rope_kernel_interleaved, "the tokens differ"),
    ("05", "store_kv", ch05.store_kv_keys_into_both, "the tokens differ"),
    ("05", "decode_program", ch05.decode_program_from_zero, "the tokens differ"),
    ("05", "merge_splits", ch05.merge_splits_first_only, "the tokens differ"),
    ("06", "sample_rows", ch06.sample_without_temperature, "seed 1: the tokens differ"),
    ("06", "varlen_metadata", ch06.varlen_positions_from_zero, "the tokens differ"),
    ("07", "chain_hashes", ch07.hashes_chained_from_another_root, "prompt tokens found in the cache"),
    ("07", "longest_cached_prefix", ch07.prefix_by_unchained_hashes, "prompt tokens found in the cache"),
    ("08", "sse_event", ch08.sse_without_the_blank_line, "each must end with a blank line"),
    ("08", "Detokenizer", ch08.EverythingSoFar, "the events' text is not the tokens' text"),
    ("08", "stream_request", ch08.stream_without_abort, "told to drop 0 requests, expected 1"),
    ("08", "stream_request", ch08.stream_that_always_aborts, "told to drop 2 requests, expected 1"),
    ("13", "route_tokens", ch13.softmax_over_the_top_k_only, "through your router, align and experts"),
    ("13", "align_pairs", ch13.pairs_by_token_not_expert, "through your router, align and experts"),
    ("13", "experts_kernel", ch13.KernelWithHalvesSwapped(), "through your router, align and experts"),
    ("13", "experts_forward", ch13.experts_unweighted, "through your router, align and experts"),
    ("13", "YourShard", ch13.SharesDropTheRemainder, "two ranks, each with your share of the experts"),
    ("14", "decompress", ch14.values_before_keys, "through your decompression, absorption and kernel"),
    ("14", "absorb_query", ch14.heads_reversed, "through your decompression, absorption and kernel"),
    ("14", "absorb_output", ch14.w_uv_heads_reversed, "through your decompression, absorption and kernel"),
    ("14", "latent_decode_kernel", ch14.KernelWithoutScale(), "through your decompression, absorption and kernel"),
    ("14", "latent_decode", ch14.blocks_in_pool_order, "through your decompression, absorption and kernel"),
    ("14", "cache_bytes", ch14.kv_heads_checked_first, "the engine's pool holds 480 bytes a token, received"),
    ("15", "gather_blocks", ch15.gather_in_pool_order, "through your pair, in one process"),
    ("15", "scatter_blocks", ch15.scatter_in_pool_order, "through your pair, in one process"),
    ("15", "YourPrefill", type("YourPrefill", (PrefillEngine,), {"scheduler_class": ch15.ReleaseForgetsTheFork}),
     "the prefill engine: .* blocks were not given back"),
    ("15", "YourDecode", ch15.ScattersIntoItsTableReversed, "through your pair, in one process"),
    ("15", "after_prefill", ch15.keep_everything_on_the_prefill_side, "through your pair, in one process"),
    ("15", "transfer_time", ch15.keys_without_values, "the link carried"),
    ("16", "cache_aware", ch16.balance_ignored, "the loads differed by 24 requests"),
    ("16", "YourGuess", ch16.KeepsTheLastPromptOnly, "of the prompt tokens cached"),
    ("16", "replica_configs", ch16.replicas_keep_data_parallel_size, "starting them raised ValueError"),
    ("16", "split_layers", ch16.equal_counts, "through your split_layers the stages held"),
    ("16", "keep_stage", ch16.head_on_every_stage, "through your keep_stage, stage 0"),
    ("17", "waits_for", ch17.o_waits_for_qkv, "may read attention before"),
    ("17", "schedule", ch17.tasks_with_gate_up_before_o, "wait forever"),
    ("17", "run_programs", ch17.programs_one_after_another, "may read"),
    ("17", "run_programs", ch17.stuck_programs_dropped, "expected ScheduleError, the proof passed"),
    ("17", "gate_up", ch17.silu_of_up, "decode step 1 through your pieces"),
], ids=lambda v: getattr(v, "__name__", v) if not isinstance(v, str) or len(v) < 24 else "")
def test_last_parts_fail_on_a_broken_piece(chapter, piece, wrong, says, monkeypatch):
    """The last part runs the course model or the engine on the student's pieces (their names looked
    up in the notebook's globals when called, as in a student's kernel): each one broken fails it. 13's
    runs in one process and on two ranks, 14's serves prompts through decompress and decodes through
    the absorption and the kernel, and counts its pool with cache_bytes; 15's pair runs in one process
    (where a broken piece shows first), then in two; 16's pipeline runs two stages, then its replicas route
    chats and one hot prefix."""
    if piece == "YourShard" and torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("the two ranks' part needs two GPUs on a GPU machine")
    if torch.cuda.is_available():  # a piece that reads the device on the host may fail the engine's graph first
        says = f"{says}|as a CUDA graph failed"
    ns = solved(chapter)
    monkeypatch.setitem(ns, piece, wrong)
    last = testing.last_part(chapter)
    with pytest.raises((AssertionError, testing.AnswerError), match=says):
        last.check(*eval(f"({last.argument},)", ns))


# For each problem set: an exercise its last part calls, left as it is handed out in the test below.
UNANSWERED = {"01": "01.apply_rope", "02": "02.cached_attention", "03": "03.append_token", "04": "04.rope_kernel",
              "05": "05.decode_program", "06": "06.sample_rows", "07": "07.chain_hashes", "08": "08.stream_request",
              "09": "09.keep_accepted", "10": "10.gptq_columns", "11": "11.YourRow", "12": "12.prompt_rows",
              "13": "13.experts_kernel", "14": "14.latent_decode_kernel", "15": "15.after_prefill",
              "16": "16.YourGuess", "17": "17.gate_up"}


@pytest.mark.parametrize("chapter, missing", UNANSWERED.items())
def test_last_part_names_the_unanswered_exercise(chapter, missing):
    """Every exercise answered but one, whose cell is as the exercise notebook hands it out (its
    solution replaced by `raise NotImplementedError()`): the last part fails naming that exercise."""
    ns = build.solution_globals(chapter, handed_out=missing)
    last = testing.last_part(chapter)
    with pytest.raises(testing.NotAnswered, match="^" + re.escape(
            f"{testing.EXERCISES[missing].label} is not answered yet: finish it (and run its check) before this part")):
        last.check(*eval(f"({last.argument},)", ns))


def runner_with(**pieces) -> type:
    return type("Broken", (spec.SpeculativeRunner,), {k: staticmethod(v) for k, v in pieces.items()})


class EarliestNgram(mi.NgramProposer):
    def propose(self, runner, out, room):
        return {rid: ngram_at_the_earliest_place(runner.requests[rid].token_ids, k, 3) for rid, k in room.items()}, None


@pytest.mark.parametrize("runner, law, says", [
    (runner_with(rejection_sample=rejection_sample_residual_is_p), checks09.same_law, "follow different laws"),
    (runner_with(keep_accepted=keep_counting_every_accepted), checks09.same_law, "greedy, prompt"),
    (type("Broken", (spec.SpeculativeRunner,), {"proposers": {"ngram": EarliestNgram}}), checks09.same_law,
     "not the package's guesses"),
    (spec.SpeculativeRunner, lambda a, b: 0.0, "follow different laws"),
], ids=["rejection_sample", "keep_accepted", "ngram_guesses", "same_law"])
def test_chapter_09_last_part_fails_on_each_broken_piece(runner, law, says):
    """The last part runs the engine on the student's pieces: each one broken fails it, by name."""
    with pytest.raises(AssertionError, match=says):
        testing.check_speculative_engine(runner, law)


@pytest.mark.parametrize("columns, kernels", [
    (gptq_error_not_divided, KernelsOn()),
    (lambda W, U, bits, g: gptq_columns(W, U, bits, g, block=W.shape[1]), KernelsOn(gemv_first_group_scale_only)),
], ids=["gptq_columns", "int4_gemv_kernel"])
def test_chapter_10_last_part_fails_on_each_broken_piece(columns, kernels):
    """The last part serves the course model quantized by the student's GPTQ loop on their kernel:
    either one broken fails it."""
    with pytest.raises(AssertionError, match="greedy tokens against the package.s: the tokens differ"):
        testing.check_quantized_engine(columns, kernels)


@pytest.mark.parametrize("broken, says", [
    (dict(column=ColumnOfTheFirstPieceOnly), "ColumnOfTheFirstPieceOnly.load_weight returned"),
    (dict(row=RowWithoutTheSum), "the course model, prompt 1 of 2"),
    (dict(embedding=EmbeddingWithoutZeros), "the course model, prompt 1 of 2"),
    (dict(lm_head=HeadInReverse), "the course model, prompt 1 of 2"),
    (dict(shard=ShardWithoutReplication), "(?s)a model with one KV head: .*kv_heads\\(1\\) is slice\\(0, 0, None\\)"),
    (dict(shard=ShardOneHeadEach), "a model with four KV heads"),
], ids=["column", "row", "embedding", "lm_head", "shard", "shard_one_head_each"])
def test_chapter_11_last_part_fails_on_each_broken_piece(broken, says):
    """The last part runs the engine's two ranks on the student's layers: each one broken fails it."""
    with pytest.raises((AssertionError, testing.AnswerError), match=says):
        testing.check_parallel_engine(ParallelLayers(**broken))


TOKENIZER = mi.load_tokenizer()  # once: each load reads its files again (4,096 loads took 76 s)
VOCAB = [TOKENIZER.decode([i]) for i in range(4096)]


def processor(base: type, **pieces) -> type:
    return type("Broken", (base,), {k: v if callable(v) and k == "matcher" else staticmethod(v)
                                    for k, v in pieces.items()})


def number_matcher(cls):
    return lambda self, structure: cls(checks12.NUMBER_DFA, checks12.NUMBER_ACCEPTING, VOCAB, {0})


@pytest.mark.parametrize("pieces, says", [
    ((processor(Penalties, penalize=penalize_openai_first),), "repetition_penalty"),
    ((processor(Logprobs, scorer=rank_from_zero),), "logprobs of token"),
    ((processor(PromptLogprobs, rows_for=prompt_rows_from_the_chunk_start),), "prompt_logprobs of token"),
    ((processor(Structured, mask=bitmask_most_significant_first),), "regex"),
    ((processor(Structured, matcher=number_matcher(MatcherFirstCharOnly)),), "regex"),
], ids=["penalize", "top_logprobs", "prompt_rows", "apply_bitmask", "ToyMatcher"])
def test_chapter_12_last_part_fails_on_each_broken_piece(pieces, says):
    """The last part runs the engine on the student's processors (the right matcher where the piece
    broken is not the matcher): each broken piece fails it, naming the request."""
    right = processor(Structured, matcher=number_matcher(checks12.ToyMatcher))
    if not any(issubclass(p, Structured) for p in pieces):
        pieces += (right,)
    with pytest.raises(AssertionError, match=says):
        testing.check_sampling_engine(pieces)


def test_an_exception_in_the_answer_names_the_case_and_its_inputs():
    def shape_error(x, weight, eps):
        return x @ weight[:-1]

    with pytest.raises(testing.AnswerError, match=r"rms_norm, case 1 of \d+\n  inputs: tensor \(\d+(, \d+)*\) "
                                                  r"float32, tensor \(\d+,\) float32, 1e-05\n.*\n  your code raised "
                                                  r"RuntimeError"):
        testing.check_rms_norm(shape_error)
    x, weight, eps = testing.last_failure["inputs"]  # the case, to call the answer on again
    assert isinstance(x, torch.Tensor) and eps == 1e-05


def test_an_unanswered_exercise_says_which():
    def unanswered(x, weight, eps):
        raise NotImplementedError()

    with pytest.raises(testing.NotAnswered, match=r"^exercise 1 \(rms_norm\) is not answered yet"):
        testing.check_rms_norm(unanswered)


def test_the_kill_report_lists_every_mutant():
    """docs/mutants.md (tests/mutants/report.py) names every mutant of tests/mutants/ and no other."""
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / "docs" / "mutants.md").read_text()
    listed = {line.split("`")[3] for line in text.splitlines() if line.startswith("| `")}
    assert listed == {w.__name__ for _, _, w in ALL}


def test_a_list_of_the_wrong_length_is_shown_as_a_list():
    """A list answer that is too long reads as values, not as a tensor's shape."""
    from mutants.ch09 import keep_the_last_tokens_block
    listed = r"expected \d+ values, received \d+\n  expected \[[\d, ]+\]\n  received \["
    with pytest.raises(AssertionError, match=listed):
        testing.check_keep_accepted(keep_the_last_tokens_block)
