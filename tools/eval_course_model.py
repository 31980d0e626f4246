"""Does the course model write code? Greedy completions of 20 function signatures with one-line
docstrings, each prompt ending in a newline (as a person types it), scored by `ast`.

Hand-written tool. The prompts were written for this check and are kept out of training (the
corpus is library source; none of these functions is copied from one).

    python tools/eval_course_model.py [CHECKPOINT_FOLDER]    # default: the embedded course model
    python tools/eval_course_model.py --speed docs/benchmarks/course_model_cpu.json   # CPU timing
"""

from __future__ import annotations

import ast
import sys

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


def score(folder=None) -> tuple[int, list[str]]:
    """How many of PROMPTS get a real body from greedy decoding, and the cut completions."""
    engine = mi.LLMEngine(mi.EngineConfig(model=folder))
    outs = engine.generate(PROMPTS, mi.SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    sources = [cut_body(p, o.text, o.finish_reason == "stop") for p, o in zip(PROMPTS, outs)]
    return sum(map(writes_a_body, sources)), sources


def speed(threads: int = 2) -> dict:
    """Seconds for 64 greedy tokens after make demo's prompt on this CPU, float32, best of 3 after a
    warm-up: miniinfer's cached and naive paths and transformers' generate, for both course models."""
    import platform

    import torch
    import transformers

    torch.set_num_threads(threads)
    prompt = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    params = mi.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    result = {"cpu": platform.processor() or platform.machine(), "threads": threads, "torch": torch.__version__,
              "transformers": transformers.__version__, "tokens": 64, "seconds": {}}
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
    args = ap.parse_args()
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
