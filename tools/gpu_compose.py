"""Features composed on GPUs: the course model and the tests' Llama / Qwen2 / Qwen3 shapes (random
weights, float32, Triton kernels, CUDA graphs), served with tensor_parallel_size=2 x quantization x
n-gram speculation x logprobs, against one GPU with the same quantization and no speculation: the
same greedy tokens, log-probabilities within 1e-3, every block back.

    python tools/gpu_compose.py run OUT.json
"""

import json
import tempfile
from pathlib import Path

import torch
from benchlib import commands, header

import miniinfer as mi
from miniinfer.course.parity import make_hf_model

PROMPTS = [[1, 5, 9, 5, 9, 5, 9, 2, 7], [3, 4, 3, 4, 3, 4, 8], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


def serve(folder, prompts, params, **config) -> tuple[list, bool, object]:
    # the head kept whole in both: two ranks cannot quantize it (EngineConfig.lm_head_format)
    engine = mi.LLMEngine(mi.EngineConfig(model=folder, device="cuda", dtype=torch.float32, num_blocks=256,
                                          max_num_seqs=8, quantize_lm_head=None, **config))
    try:
        outs = engine.generate(prompts, params, use_tqdm=False)
        return outs, engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, engine.spec
    finally:
        engine.close()


def gap(a: list, b: list) -> float:
    """The largest difference of a token's log-probability between two outputs' lists (inf: other tokens)."""
    if len(a) != len(b) or any(x.token != y.token for x, y in zip(a, b)):
        return float("inf")
    return max((abs(x.logprob - y.logprob) for x, y in zip(a, b)), default=0.0)


def compose(name: str, folder, prompts, quantization: str) -> dict:
    params = mi.SamplingParams(temperature=0, max_tokens=32, logprobs=2)
    one, free1, _ = serve(folder, prompts, params, quantization=quantization)
    two, free2, spec = serve(folder, prompts, params, quantization=quantization, tensor_parallel_size=2,
                             speculative_method="ngram", num_speculative_tokens=3)
    same = sum(a.token_ids == b.token_ids for a, b in zip(one, two))
    worst = max(gap(a.logprobs, b.logprobs) for a, b in zip(one, two))
    res = {"quantization": quantization, "requests": len(prompts), "same_tokens": same, "max_logprob_gap": worst,
           "guesses_proposed": spec.proposed, "guesses_kept": spec.accepted, "all_blocks_back": free1 and free2}
    print(f"{name} {quantization}: {same}/{len(prompts)} same tokens, logprob gap {worst:.2e}, "
          f"guesses kept {spec.accepted}/{spec.proposed}, blocks back {free1 and free2}", flush=True)
    return res


def run(res: dict, name: str, fn, *args) -> None:
    try:
        res["runs"][name] = fn(*args)
    except (ValueError, RuntimeError) as err:  # a scheme the shape cannot take, said by the engine
        res["runs"][name] = {"refused": str(err)}
        print(f"{name}: refused: {err}", flush=True)


def main(out_path: str) -> None:
    res = header(what=__doc__.split("\n\n")[0], runs={})
    course = [mi.load_tokenizer()(p).input_ids for p in ["def fibonacci(n):\n", "for i in range(10):\n    print(i)\n"]]
    for quant in ("int8", "int4", "fp8"):
        run(res, f"course-{quant}", compose, "course model", None, course, quant)
    for kind in ("llama", "qwen2", "qwen3"):
        with tempfile.TemporaryDirectory() as folder:
            make_hf_model(kind).save_pretrained(folder)
            run(res, f"{kind}-int8", compose, kind, folder, PROMPTS, "int8")
    Path(out_path).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    commands(run=main)
