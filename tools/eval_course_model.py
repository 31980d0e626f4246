"""Does the course model write code? Greedy completions of 20 function signatures with one-line
docstrings, each prompt ending in a newline (as a person types it), scored by `ast`.

Hand-written tool. The prompts were written for this check and are kept out of training (the
corpus is library source; none of these functions is copied from one).

    python tools/eval_course_model.py [CHECKPOINT_FOLDER]    # default: the embedded course model
    python tools/eval_course_model.py --speed docs/benchmarks/course_model_cpu.json   # CPU timing
    python tools/eval_course_model.py --quant corpus docs/benchmarks/quant_quality_cpu.json
    python tools/eval_course_model.py --quant-head corpus docs/benchmarks/quant_lm_head_cpu.json
                                   # chapter 10: held-out bits per byte and the body check per weight format
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from benchlib import header

import miniinfer as mi

PROMPTS = [
    'def is_palindrome(s: str) -> bool:\n    """Return True if s reads the same forwards and backwards."""\n',
    'def count_vowels(text):\n    """Return the number of vowels in text."""\n',
    'def flatten(nested):\n    """Return a flat list of the items of a list of lists."""\n',
    'def celsius_to_fahrenheit(c):\n    """Convert a temperature from Celsius to Fahrenheit."""\n',
    'def read_lines(path):\n    """Return the lines of the file at path, without trailing newlines."""\n',
    'def chunked(items, size):\n    """Split items into lists of at most size elements."""\n',
    'def word_frequencies(text):\n    """Return a dict mapping each word of text to its count."""\n',
    'def safe_divide(a, b, default=None):\n    """Return a / b, or default when b is zero."""\n',
    'def merge_dicts(*dicts):\n    """Return one dict with the keys of all dicts; later ones win."""\n',
    'def clamp(value, low, high):\n    """Limit value to the range low..high."""\n',
    'def unique(items):\n    """Return the items without duplicates, keeping their first order."""\n',
    'def parse_int(text, default=0):\n    """Return text as an int, or default if it is not a number."""\n',
    'def find_max_index(numbers):\n    """Return the index of the largest number in a non-empty list."""\n',
    'def reverse_words(sentence):\n    """Return the sentence with its words in reverse order."""\n',
    'def is_prime(n):\n    """Return True if n is a prime number."""\n',
    'def list_python_files(folder):\n    """Return the paths of the .py files under folder."""\n',
    'def gcd(a, b):\n    """Return the greatest common divisor of a and b."""\n',
    'def running_sum(numbers):\n    """Return the list of running totals of numbers."""\n',
    'def strip_comments(source):\n    """Remove comments from each line of Python source code."""\n',
    'def to_snake_case(name):\n    """Convert a CamelCase name to snake_case."""\n',
]
MAX_TOKENS = 96


def cut_body(prompt: str, completion: str, finished: bool) -> str:
    """The prompt and the completion's lines up to where the body dedents; when generation stopped
    at the token limit, its last, possibly unfinished, line is dropped."""
    lines = completion.split("\n")
    if not finished and len(lines) > 1:
        lines = lines[:-1]
    kept = []
    for line in lines:
        if line.strip() and not line.startswith((" ", "\t")):
            break  # back at the def's level: the body is over
        kept.append(line)
    return prompt + "\n".join(kept).rstrip() + "\n"


def writes_a_body(source: str) -> bool:
    """Whether source parses and its function holds two or more distinct statements besides the
    docstring."""
    try:
        func = ast.parse(source).body[0]
    except (SyntaxError, IndexError):
        return False
    body = func.body[1:] if isinstance(func.body[0], ast.Expr) and isinstance(func.body[0].value, ast.Constant) \
        else func.body
    statements = {ast.dump(node) for stmt in body for node in ast.walk(stmt) if isinstance(node, ast.stmt)}
    return len(statements) >= 2


def score(folder=None, model=None, **config) -> tuple[int, list[str]]:
    """How many of PROMPTS get a real body from greedy decoding, and the cut completions."""
    tokenizer = mi.load_tokenizer(folder)
    engine = mi.LLMEngine(mi.EngineConfig(model=folder, **config), model=model)  # a model passed in: no tokenizer
    outs = engine.generate([tokenizer(p).input_ids for p in PROMPTS],
                           mi.SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    sources = [cut_body(p, tokenizer.decode(o.token_ids), o.finish_reason == "stop") for p, o in zip(PROMPTS, outs)]
    return sum(map(writes_a_body, sources)), sources


def speed(threads: int = 2) -> dict:
    """Seconds for 64 greedy tokens after make demo's prompt on this CPU, float32, best of 3 after a
    warm-up: miniinfer's cached and naive paths and transformers' generate, for both course models."""

    import torch
    import transformers

    torch.set_num_threads(threads)
    prompt = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    params = mi.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    result = header(threads=threads, tokens=64, seconds={})
    for name in ("pycoder", "pycoder-draft"):
        path = mi.course_model_path(name)
        model, ids = mi.load_model(path), mi.load_tokenizer(path)(prompt).input_ids
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        runs = {"generate_cached": lambda: mi.generate_cached(model, ids, params),
                "generate_naive": lambda: mi.generate_naive(model, ids, params),
                "transformers_generate": lambda: hf.generate(torch.tensor([ids]), max_new_tokens=64,
                                                             min_new_tokens=64, do_sample=False)}
        for run in runs.values():
            run()
        result["seconds"][name] = {k: min(timed(run) for _ in range(3)) for k, run in runs.items()}
    return result


# quality()'s rows: (name, the layers' scheme, GPTQ's calibration, the KV cache's dtype, the LM head's scheme)
FORMATS = (("float32", None, False, None, None), ("int8", "int8", False, None, None),
           ("int4 RTN", "int4", False, None, None), ("int4 GPTQ", "int4", True, None, None),
           ("fp8 weights (emulated)", "fp8", False, None, None), ("fp8 KV cache", None, False, "fp8", None))
# the LM head quantized too (round to nearest), alone and beside int4's layers
HEAD_FORMATS = (("float32", None, False, None, None), ("LM head int8", None, False, None, "int8"),
                ("LM head int4", None, False, None, "int4"), ("int4 RTN", "int4", False, None, None),
                ("int4 RTN, LM head int8", "int4", False, None, "int8"),
                ("int4 RTN, LM head int4", "int4", False, None, "int4"))


def quality(corpus: str, max_chars: int = 200_000, seq_len: int = 1024, formats: tuple = FORMATS) -> dict:
    """Chapter 10: each weight format of the course model, and the FP8 KV cache, against float32 on
    the CPU: bits per byte of the held-out packages (their first max_chars characters), the body
    check, and how many of its 20 greedy completions equal float32's. int4 twice: round to nearest,
    and GPTQ calibrated on 64 windows of 512 tokens of the standard library (training data, never the
    held-out packages). FP8 weights are emulated (their rounding, in float32); the FP8 KV cache is the
    engine's e4m3 pool, and in the bits per byte K and V rounded to e4m3 as the pool stores them."""
    import contextlib
    import sysconfig
    import time
    from types import SimpleNamespace

    import torch
    from course_corpus import read_split
    from train_course_model import bits_per_byte, corpus_files, encode, read_documents

    torch.manual_seed(0)
    docs, n = [], 0
    for d in read_split(Path(corpus), "val"):
        docs.append(d["text"])
        n += len(d["text"])
        if n >= max_chars:
            break
    tokenizer = mi.load_tokenizer()
    stream = encode(tokenizer, read_documents(corpus_files(Path(sysconfig.get_paths()["stdlib"]))[:400]))
    calibration = [stream[i * 512:(i + 1) * 512][None] for i in range(64)]

    def fp8_kv(layer, q, k, v, scale):  # causal attention over K/V as the e4m3 pool holds them
        k, v = (mi.worker.kv_cache.to_pool(t, torch.float8_e4m3fn).to(q.dtype) for t in (k, v))
        return mi.model.transformer.causal_attention(q, k, v, scale)

    class HFView:  # bits_per_byte calls a transformers model
        def __init__(self, model, attn=None):
            self.model, self.attn = model, attn

        def __call__(self, input_ids):
            return SimpleNamespace(logits=self.model(input_ids, attn=self.attn))

        def eval(self):
            pass

        train = eval

    res = header(held_out_chars=sum(map(len, docs)), held_out_docs=len(docs), formats={})
    completions = {}
    for fmt, scheme, calibrated, kv, head in formats:
        t0 = time.perf_counter()
        model = mi.load_model()
        mi.layers.quantization.quantize_model(model, scheme, calibration if calibrated else None, lm_head=head)
        with torch.no_grad():
            bpb = bits_per_byte(HFView(model, fp8_kv if kv else None), tokenizer, docs, seq_len, "cpu",
                                contextlib.nullcontext())
        bodies, completions[fmt] = score(model=model, kv_cache_dtype=kv)
        same = sum(a == b for a, b in zip(completions[fmt], completions["float32"]))
        res["formats"][fmt] = {"bits_per_byte": bpb, "body_check": bodies, "completions_equal_to_float32": same,
                               "seconds": time.perf_counter() - t0}
        print(f"{fmt:23s} {bpb:.4f} bits/byte, body check {bodies}/{len(PROMPTS)}, {same}/{len(PROMPTS)} "
              "completions as float32's", flush=True)
    base = res["formats"]["float32"]["bits_per_byte"]
    for r in res["formats"].values():
        r["vs_float32"] = r["bits_per_byte"] / base - 1
    return res


def timed(fn) -> float:
    import time

    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", help="checkpoint folder (default: the embedded course model)")
    ap.add_argument("--speed", metavar="JSON", help="instead, time 64 greedy tokens of both course models "
                    "on this CPU and write the seconds here")
    ap.add_argument("--quant", nargs=2, metavar=("CORPUS", "JSON"), help="instead, chapter 10's quality table: "
                    "a corpus folder of tools/course_corpus.py (its held-out split) and where to write it")
    ap.add_argument("--quant-head", nargs=2, metavar=("CORPUS", "JSON"), help="the same for the LM head quantized "
                    "too, alone and beside int4's layers")
    args = ap.parse_args()
    if args.quant or args.quant_head:
        corpus, out = args.quant or args.quant_head
        res = quality(corpus, formats=FORMATS if args.quant else HEAD_FORMATS)
        with open(out, "w") as f:
            json.dump(res, f, indent=1)
        sys.exit()
    if args.speed:
        res = speed()
        with open(args.speed, "w") as f:
            json.dump(res, f, indent=1)
        print(json.dumps(res["seconds"], indent=1))
        sys.exit()
    n, sources = score(args.folder)
    for s in sources:
        print(s, "-" * 40, sep="\n")
    print(f"{n} of {len(PROMPTS)} prompts completed with a function body that parses")
