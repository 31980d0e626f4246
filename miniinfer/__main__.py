"""Command line: `python -m miniinfer generate "def fibonacci(n):"`. Hand-written module."""

import argparse
import time

import torch

import miniinfer as mi


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m miniinfer")
    sub = ap.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help="checkpoint folder (default: the course model)")
    gen.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)

    params = mi.SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                               max_tokens=args.max_tokens, seed=args.seed)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = mi.load_model(args.model, device=args.device, dtype=dtype)
    tok = mi.load_tokenizer(args.model)
    t0 = time.perf_counter()
    new = mi.generate_cached(model, tok(args.prompt).input_ids, params)
    seconds = time.perf_counter() - t0
    print(args.prompt + tok.decode(new))
    print(f"\n[{len(new)} tokens in {seconds:.2f} s on {args.device}]")


if __name__ == "__main__":
    main()
