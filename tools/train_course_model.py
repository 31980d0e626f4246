"""Train the embedded course model: a small Llama-architecture model that completes Python code.

Hand-written tool (not exported from a notebook). Reproducible from a clean checkout:

    python tools/train_course_model.py --out /tmp/pycoder            # the real run (GPU, a few minutes)
    python tools/train_course_model.py --out /tmp/pycoder --stdlib /usr/lib/python3.11   # another stdlib
    python tools/train_course_model.py --tiny --out /tmp/t --device cpu   # smoke test (seconds)
    # version 2 (issue 11): the corpus of tools/course_corpus.py, then the draft with the same tokenizer
    python tools/train_course_model.py --corpus corpus --out /tmp/pycoder --compare miniinfer/assets/pycoder
    python tools/train_course_model.py --corpus corpus --draft --tokenizer /tmp/pycoder --out /tmp/pycoder-draft

Steps: corpus (the running interpreter's standard library), byte-level BPE tokenizer, a
`transformers.LlamaForCausalLM` with grouped-query attention and tied embeddings, bf16 training with a
held-out split. The checkpoint with the lowest validation loss is saved together with the tokenizer,
`train_log.json` (the loss curves and the settings) and `val_loss.png`.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import multiprocessing
import random
import sysconfig
import textwrap
import time
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path

import torch
from benchlib import header

EOS = "<|endoftext|>"
# Folders left out of the corpus: installed third-party code is not the standard library.
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class TrainConfig:
    vocab_size: int = 4096
    hidden_size: int = 384
    intermediate_size: int = 1024
    num_hidden_layers: int = 6
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    seq_len: int = 1024
    batch_size: int = 64
    steps: int = 1000
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    eval_every: int = 100
    eval_batches: int = 16
    val_fraction: float = 0.05
    max_files: int = 0  # 0: every file
    tokenizer_chars: int = 60_000_000  # the BPE is trained on an even sample of this many characters
    seed: int = 0


# The draft model for speculative decoding: same tokenizer, about 2.4M parameters (under 5 MB in bf16).
DRAFT = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=6,
             num_key_value_heads=2)
TINY = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, seq_len=64,
            batch_size=4, steps=4, warmup=1, eval_every=2, eval_batches=2, max_files=40)


def corpus_files(root: Path, max_files: int = 0) -> list[Path]:
    """The `.py` files of a standard library folder, tests included, in a fixed order."""
    files = sorted(p for p in root.rglob("*.py")
                   if not SKIP_DIRS.intersection(p.relative_to(root).parts))
    return files[:max_files] if max_files else files


def read_documents(files: list[Path]) -> list[str]:
    docs = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few test fixtures are deliberately mis-encoded
        if text.strip() and EOS not in text:
            docs.append(text)
    return docs


def functions_of(text: str) -> list[str]:
    """The functions of one file that have a docstring and a body of 2 to 20 statements, each cut out
    and dedented to column 0: a standalone view of the same code, shaped like a person's prompt (a
    signature, a docstring, then the body to write)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    return [textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno]))
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node)
            and 3 <= len(node.body) <= 21]


def function_documents(docs: list[str]) -> list[str]:
    """functions_of every document, without duplicates, in a fixed order."""
    with multiprocessing.Pool() as pool:
        found = pool.map(functions_of, docs, chunksize=16)
    return list(dict.fromkeys(f for funcs in found for f in funcs))


def train_tokenizer(docs: list[str], vocab_size: int, max_len: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # A newline is its own piece, and so is the indentation that starts a line: then a prompt cut at
    # any line break (what a person types) is a sequence of pieces the model saw in training. The
    # first tokenizer merged "\n" with the next line's indentation, and prompts ending in "\n" were
    # out of distribution.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"),
        pre_tokenizers.Split(Regex(r"^[ \t]+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(docs, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS,
                                   model_max_length=max_len, clean_up_tokenization_spaces=False)


def encode(tokenizer, docs: list[str]) -> torch.Tensor:
    """One stream of token ids, each document followed by EOS."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def build_model(cfg: TrainConfig, tokenizer):
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu",
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id, do_sample=False)
    return model


def batches(stream: torch.Tensor, cfg: TrainConfig, gen: torch.Generator, device: str,
            line_ends: list[int]):
    """Random windows of seq_len + 1 tokens (inputs and shifted targets), each starting at the
    beginning of a line: a prompt starts at one too, and its first line's indentation (or its lack of
    any) is then as unambiguous to the model as it was in training."""
    n = cfg.seq_len + 1
    after = torch.nonzero(torch.isin(stream[:-n], torch.tensor(line_ends))).flatten() + 1
    while True:
        starts = after[torch.randint(0, len(after), (cfg.batch_size,), generator=gen)]
        chunk = torch.stack([stream[s:s + n] for s in starts.tolist()]).to(device, non_blocking=True)
        yield chunk[:, :-1], chunk[:, 1:]


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def loss_of(model, x: torch.Tensor, y: torch.Tensor, autocast) -> torch.Tensor:
    with autocast:
        logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def evaluate(model, val_batches, autocast) -> float:
    model.eval()
    losses = [loss_of(model, x, y, autocast).item() for x, y in val_batches]
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def bits_per_byte(model, tokenizer, docs: list[str], seq_len: int, device: str, autocast) -> float:
    """Cross-entropy of every token of docs (EOS-joined, in windows of seq_len) per UTF-8 byte, in
    bits: unlike loss per token, it compares models whose tokenizers differ."""
    model.eval()
    stream = encode(tokenizer, docs)
    nats = 0.0
    for start in range(0, len(stream) - 1, seq_len):
        chunk = stream[start:start + seq_len + 1].to(device)[None]
        with autocast:
            logits = model(input_ids=chunk[:, :-1]).logits
        nats += torch.nn.functional.cross_entropy(logits.float()[0], chunk[0, 1:], reduction="sum").item()
    model.train()
    n_bytes = sum(len(d.encode()) + 1 for d in docs)  # + 1: the document separator
    return nats / math.log(2) / n_bytes


SAMPLE_PROMPTS = ["def fibonacci(n):\n", "import os\n", "class Stack:\n"]


@torch.no_grad()
def complete(model, tokenizer, prompts: list[str], device: str, max_new_tokens: int = 64) -> dict:
    """Greedy completions, to judge the model by eye."""
    model.eval()
    out = {}
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
        new = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0, ids.shape[1]:]
        out[prompt] = tokenizer.decode(new)
    return out


def plot(logs: dict[str, dict], path: Path) -> None:
    """Training and validation curves of one or more runs (name -> train_log.json contents)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for name, log in logs.items():
        line, = ax.plot(*zip(*log["train_loss"][::10]), alpha=0.3, label=f"{name}: train (every 10th step)")
        ax.plot(*zip(*log["val_loss"]), "o-", ms=2, color=line.get_color(), label=f"{name}: held-out files")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(top=4)
    ax.set_title("Course model training")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny configuration for smoke tests")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--corpus", type=Path, help="a folder built by tools/course_corpus.py (train and held-out "
                    "splits); without it, the standard library alone, split by file")
    ap.add_argument("--draft", action="store_true", help="the small draft model's shape")
    ap.add_argument("--tokenizer", type=Path,
                    help="reuse this checkpoint's tokenizer (the draft shares the main one's)")
    ap.add_argument("--functions", action="store_true", help="also train on each documented function of the "
                    "training files, cut out and dedented (see functions_of)")
    ap.add_argument("--time-limit", type=float, default=float("inf"),
                    help="stop training after this many seconds (the learning-rate schedule is cut short)")
    ap.add_argument("--compare", type=Path, help="also report this checkpoint's bits per byte on the held-out files")
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                    help="standard library folder to train on (default: this interpreter's)")
    ap.add_argument("--plot", nargs="+", type=Path, metavar="TRAIN_LOG",
                    help="only draw these runs' train_log.json curves into the file --out and stop")
    args = ap.parse_args(argv)
    if args.plot:
        return plot({p.stem.removesuffix("_train_log"): json.loads(p.read_text()) for p in args.plot}, args.out)
    cfg = TrainConfig(**(TINY if args.tiny else {}), **(DRAFT if args.draft else {}))
    if args.steps:
        cfg.steps = args.steps

    t0 = time.time()
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if args.corpus:  # validation: whole packages that no training file comes from
        from course_corpus import read_split
        train_docs, val_docs = ([d["text"] for d in read_split(args.corpus, s)] for s in ("train", "val"))
    else:  # split by file, so validation measures completion of code the model never saw
        docs = read_documents(corpus_files(args.stdlib, cfg.max_files))
        order = list(range(len(docs)))
        random.Random(cfg.seed).shuffle(order)
        n_val = max(1, int(len(docs) * cfg.val_fraction))
        val_docs = [docs[i] for i in order[:n_val]]
        train_docs = [docs[i] for i in order[n_val:]]
    docs, n_val = train_docs + val_docs, len(val_docs)

    if args.tokenizer:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        every = max(1, sum(map(len, train_docs)) // cfg.tokenizer_chars)
        tokenizer = train_tokenizer(train_docs[::every], cfg.vocab_size, cfg.max_position_embeddings)
    if args.functions:
        train_docs = train_docs + function_documents(train_docs)
    train_ids, val_ids = encode(tokenizer, train_docs), encode(tokenizer, val_docs)
    n_chars = sum(map(len, docs))
    print(f"corpus: {len(docs)} files, {n_chars / 1e6:.1f}M chars, "
          f"{len(train_ids) / 1e6:.2f}M train + {len(val_ids) / 1e6:.2f}M val tokens "
          f"({time.time() - t0:.0f}s)", flush=True)

    model = build_model(cfg, tokenizer).to(args.device)
    # Compiled on the GPU: the elementwise work of a model this small is fused into few kernels
    forward = torch.compile(model) if args.device.startswith("cuda") else model
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)
    use_bf16 = args.device.startswith("cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_bf16) if use_bf16 \
        else torch.autocast("cpu", enabled=False)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), fused=use_bf16)

    line_ends = [tokenizer.backend_tokenizer.encode("\n").ids[0], tokenizer.eos_token_id]
    gen = torch.Generator().manual_seed(cfg.seed)
    val_gen = torch.Generator().manual_seed(cfg.seed + 1)
    val_batches = list(islice(batches(val_ids, cfg, val_gen, args.device, line_ends), cfg.eval_batches))
    log = {"train_loss": [], "val_loss": []}
    best = float("inf")
    t_train = time.time()
    train_iter = batches(train_ids, cfg, gen, args.device, line_ends)
    for step in range(cfg.steps + 1):
        if step % cfg.eval_every == 0 or step == cfg.steps:
            val = evaluate(forward, val_batches, autocast)
            log["val_loss"].append((step, val))
            print(f"step {step:5d}  val {val:.4f}  ({time.time() - t_train:.0f}s)", flush=True)
            if val < best:  # keep the best weights, in the bf16 they ship in
                best, best_step = val, step
                best_state = {k: v.detach().to("cpu", torch.bfloat16, copy=True)
                              for k, v in model.state_dict().items()}
        if step == cfg.steps or time.time() - t_train > args.time_limit:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        x, y = next(train_iter)
        loss = loss_of(forward, x, y, autocast)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        log["train_loss"].append((step, loss.item()))
    train_seconds = time.time() - t_train

    model.load_state_dict(best_state)
    model.to(torch.bfloat16).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    # The generic class name loads in transformers 4.x as well as 5.x.
    tok_cfg_path = args.out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg.update(tokenizer_class="PreTrainedTokenizerFast")
    for key in ("backend", "is_local", "local_files_only"):  # where this run read it from: not for users
        tok_cfg.pop(key, None)
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    val_bpb = bits_per_byte(model, tokenizer, val_docs, cfg.seq_len, args.device, autocast)
    print(f"held-out bits per byte: {val_bpb:.4f}", flush=True)
    if args.compare:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        old = AutoModelForCausalLM.from_pretrained(args.compare).to(args.device)
        log["compare"] = {"checkpoint": str(args.compare), "val_bits_per_byte": bits_per_byte(
            old, AutoTokenizer.from_pretrained(args.compare), val_docs, cfg.seq_len, args.device, autocast)}
        print(f"{args.compare}: {log['compare']['val_bits_per_byte']:.4f} bits per byte", flush=True)
    samples = complete(model.float(), tokenizer, SAMPLE_PROMPTS, args.device)
    for prompt, text in samples.items():
        print(f"--- {prompt!r}\n{prompt}{text}", flush=True)
    log.update(config=asdict(cfg), parameters=n_params, best_val_loss=best, best_step=best_step, steps_trained=step,
               val_bits_per_byte=val_bpb, corpus=str(args.corpus or args.stdlib),
               train_seconds=round(train_seconds, 1), total_seconds=round(time.time() - t0, 1),
               files=len(docs), val_files=n_val, chars=n_chars,
               train_tokens=len(train_ids), val_tokens=len(val_ids),
               stdlib=str(args.stdlib), samples=samples, **header())
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1))
    plot({args.out.name: log}, args.out / "val_loss.png")
    print(f"best val {best:.4f} at step {best_step}; trained {train_seconds:.0f}s", flush=True)
    return log


if __name__ == "__main__":
    main()
