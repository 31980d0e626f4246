"""An evaluation harness against the server, as an evaluator runs it: EleutherAI's lm-evaluation-harness
(`lm_eval --model local-completions`) scores the course model through `miniinfer serve` on two local
tasks (no dataset download): a multiple-choice task (loglikelihood requests: echo + logprobs) and a
generation task (generate_until). Then each loglikelihood it logged is checked against the engine's
own prompt log-probabilities for the same tokens, computed in this process.

    pip install lm_eval   # into any environment; give its lm_eval with --lm-eval
    python tools/eval_harness.py docs/benchmarks/lm_eval_cpu.json --lm-eval /path/to/lm_eval
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from bench_serve import start_server
from benchlib import header

import miniinfer as mi
from miniinfer.model.loader import course_model_path

# Python a small code model has seen: which continuation does it find likeliest?
CHOICES = [
    ("def add(a, b):\n    return a", [" + b", " - b", " * b"], 0),
    ("def is_even(n):\n    return n % 2", [" == 0", " == 1", " != 0"], 0),
    ("import numpy as", [" np", " pd", " plt"], 0),
    ("import matplotlib.pyplot as", [" plt", " np", " pd"], 0),
    ("for i in range(", ["10):", "10]:", "10}:"], 0),
    ("if __name__ ==", [" \"__main__\":", " \"main\":", " __main__:"], 0),
    ("class Point:\n    def __init__(self, x, y):\n        self.x =", [" x", " y", " self"], 0),
    ("with open(path) as", [" f:", " f;", " f"], 0),
    ("try:\n    x = int(s)\nexcept", [" ValueError:", " ValueError;", " Value:"], 0),
    ("def square(x):\n    return x", [" * x", " + x", " - x"], 0),
]
GENERATIONS = [
    ("def is_even(n):\n    return", " n % 2 == 0"),
    ("import numpy", " as np"),
    ("def add(a, b):\n    return", " a + b"),
    ("if __name__ ==", " '__main__':"),
]

TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_target: {target}
"""
MC = TASK + """output_type: multiple_choice
doc_to_choice: "{{{{choices}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""
GEN = TASK + """output_type: generate_until
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
metric_list:
  - metric: exact_match
"""


def write_tasks(folder: Path) -> None:
    """The two tasks' data (JSON lines) and their YAML, for lm_eval --include_path."""
    mc, gen = folder / "mc.jsonl", folder / "gen.jsonl"
    mc.write_text("".join(json.dumps({"context": c, "choices": ch, "answer": a}) + "\n" for c, ch, a in CHOICES))
    gen.write_text("".join(json.dumps({"context": c, "answer": a}) + "\n" for c, a in GENERATIONS))
    (folder / "pycode_mc.yaml").write_text(MC.format(name="pycode_mc", data=mc, target="answer"))
    (folder / "pycode_gen.yaml").write_text(GEN.format(name="pycode_gen", data=gen, target='"{{answer}}"'))


def engine_logliks(contexts_and_continuations: list[tuple[str, str]]) -> list[float]:
    """log P(continuation | context) from the engine's prompt log-probabilities, with the harness's
    tokenization (context and continuation encoded whole, split at the context's length)."""
    tok = mi.load_tokenizer()
    engine = mi.LLMEngine(mi.EngineConfig())
    encode = lambda s: tok(s, add_special_tokens=False).input_ids  # noqa: E731  (as lm_eval encodes)
    pairs = [(encode(c + x), len(encode(c))) for c, x in contexts_and_continuations]
    outs = engine.generate([ids for ids, _ in pairs], mi.SamplingParams(temperature=0, max_tokens=1,
                                                                         prompt_logprobs=0), use_tqdm=False)
    return [sum(lp.logprob for lp in o.prompt_logprobs[n:]) for (_, n), o in zip(pairs, outs)]


def main(out_path: str, lm_eval: str, port: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_tasks(folder)
        proc, model = start_server(course_model_path(), port, folder / "server.log", name="pycoder"), "pycoder"
        try:
            args = [lm_eval, "--model", "local-completions", "--model_args",
                    f"model={model},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={course_model_path()},"
                    "tokenizer_backend=huggingface,num_concurrent=4,max_retries=1,tokenized_requests=True",
                    "--tasks", "pycode_mc,pycode_gen", "--include_path", str(folder), "--limit", "10",
                    "--log_samples", "--output_path", str(folder / "out")]
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
            t0 = time.time()
            run = subprocess.run(args, env=env, capture_output=True, text=True)
            seconds = time.time() - t0
        finally:
            proc.terminate()
            proc.wait()
        print(run.stdout[-3000:], run.stderr[-3000:], sep="\n")
        if run.returncode:
            raise SystemExit(f"lm_eval failed (exit code {run.returncode})")
        results = json.loads(next((folder / "out").rglob("results_*.json")).read_text())
        samples, generated = ([json.loads(line) for line in next((folder / "out").rglob(f"samples_{t}_*.jsonl")).open()]
                              for t in ("pycode_mc", "pycode_gen"))
        command = " ".join(["lm_eval"] + args[1:]).replace(tmp, "<tmp>")
    # Each request's (context, continuation) as lm_eval sent it, and the loglikelihood it logged (as text).
    theirs = {(a["arg_0"], a["arg_1"]): float(r[0][0]) for s in samples
              for a, r in zip(s["arguments"].values(), s["resps"])}
    ours = dict(zip(theirs, engine_logliks(list(theirs))))
    worst = max(abs(theirs[k] - ours[k]) for k in theirs)
    res = {
        "what": "lm_eval local-completions against `miniinfer serve` (course model, CPU): a multiple-choice "
                "(loglikelihood) and a generate_until task, 10 and 4 local examples; each loglikelihood "
                "lm_eval logged compared with the engine's prompt logprobs for the same tokens",
        "lm_eval": results.get("lm_eval_version"),
        "command": command,
        "results": {t: {k: v for k, v in r.items() if k != "alias"} for t, r in results["results"].items()},
        "generations": [{"context": g["doc"]["context"], "target": g["target"], "got": g["filtered_resps"][0]}
                        for g in generated],
        "loglikelihoods_compared": len(theirs), "max_abs_difference": worst, "seconds": round(seconds, 1),
        **header(),
    }
    print(json.dumps(res, indent=1))
    assert worst < 1e-4, f"lm_eval's loglikelihoods differ from the engine's by up to {worst}"
    Path(out_path).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="where the JSON record goes")
    ap.add_argument("--lm-eval", default="lm_eval", help="the lm_eval command (default: on PATH)")
    ap.add_argument("--port", type=int, default=8765)
    a = ap.parse_args()
    main(a.out, a.lm_eval, a.port)
