"""What a Triton kernel will make an H100 or H200 execute, counted without a GPU: compile it for sm_90
with Triton's own ptxas, disassemble the cubin with its cuobjdump, find the loop that runs once per
tile (the longest one), and count its instructions by opcode. Hand-written tool.

At one row a 4-bit GEMV issues several instructions for each code it reads, and Hopper's integer
pipe (shifts, LOP3, IMAD, PRMT) takes 64 of them per cycle and multiprocessor against 128 float32
multiply-adds: the count says whether a kernel can keep up with its own bytes before a GPU is lent.
The arguments are compiled as a launch would specialize them (pointers and sizes divisible by 16).

    python tools/sass_census.py int_gemv docs/benchmarks/gemv_sass_cpu.json [CANDIDATE.py]
        chapter 10's int GEMV at one row on its 8B tile (int4 in groups of 128); CANDIDATE.py: another
        copy of kernels/quant.py whose _int_gemv_kernel is counted beside it on several tiles (the GEMV
        written by this count and then timed slower: `git show 022e284:miniinfer/kernels/quant.py`)
"""

import collections
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from benchlib import Results, commands, load_file, version
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
# Hopper's integer pipe: half the rate of float32 adds and multiply-adds (CUDA guide, throughput table)
INTEGER = ("LOP3", "SHF", "IMAD", "IADD3", "PRMT", "LEA", "SEL", "ISETP", "SGXT", "VIADD", "MOV")


def compile_sm90(kernel, signature: dict[str, str], constexprs: dict, **options):
    """kernel compiled for sm_90, its non-constexpr integers and pointers taken as multiples of 16."""
    sig = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t[0] in "*i"}
    return triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def hot_loop(cubin: bytes) -> collections.Counter:
    """Opcodes of the longest loop (a backward branch's span) in the cubin's SASS, counted."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([BIN / "cuobjdump", "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    lines = [(int(m.group(1), 16), m.group(2)) for m in
             re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;\n]*);", sass)]
    where = {at: i for i, (at, _) in enumerate(lines)}
    spans = []
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA[^;\n]*?(0x[0-9a-f]+)", sass):
        at, target = int(m.group(1), 16), int(m.group(2), 16)
        if target <= at and target in where:
            spans.append((where[target], where[at]))
    first, last = max(spans, key=lambda s: s[1] - s[0])
    return collections.Counter(op.split(".")[0] for _, op in lines[first:last + 1])


def census(compiled, codes: float) -> dict:
    """The hot loop's counts per code (codes: what one pass of the loop decodes in one thread)."""
    ops = hot_loop(compiled.asm["cubin"])
    total = sum(ops.values())
    return {"per_code": round(total / codes, 2),
            "integer_per_code": round(sum(n for op, n in ops.items() if op in INTEGER) / codes, 2),
            "spills": "LDL" in ops or "STL" in ops,
            "top": dict(ops.most_common(10))}


SIGNATURE = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16", M="i32", N="i32",
                 K="i32", x_stride="i32")
# The candidate's (022e284's), in its arguments' order: a split of K's sums, their counters, two masks
CANDIDATE_SIGNATURE = dict(x_ptr="*bf16", w_ptr="*i32", s_ptr="*bf16", b_ptr="*bf16", out_ptr="*bf16",
                           part_ptr="*fp32", count_ptr="*i32", M="i32", N="i32", K="i32", x_stride="i32",
                           m15="i32", m19="i32")
# (bits, gated, BLOCK_N, WORDS, STAGES, num_warps): columns of words a thread 4, 8 and 16, one warp and four
CANDIDATE_TILES = [(4, False, 128, 8, 2, 1), (4, False, 256, 8, 2, 1), (4, False, 512, 8, 2, 1),
                   (4, False, 512, 8, 2, 4), (4, False, 1024, 8, 2, 4), (4, False, 2048, 8, 2, 4),
                   (4, False, 1024, 16, 3, 4), (4, True, 512, 8, 2, 4), (8, False, 1024, 8, 2, 4)]


def int_gemv(out: str, candidate: str | None = None) -> None:
    from miniinfer.kernels import quant
    res = Results(out, ptxas=subprocess.run([BIN / "ptxas", "--version"], capture_output=True,
                                            text=True).stdout.strip().splitlines()[-1], target="sm_90",
                  triton_compiler=version("triton"))
    # chapter 10's GEMV at its 8B tile: a program per 16 channels over all of K, tiles of 256 words, 8 warps
    compiled = compile_sm90(quant._int_gemv_kernel, SIGNATURE, dict(
        ROWS=1, HAS_BIAS=False, GATED=False, BITS=4, GROUP=128, BLOCK_N=16, WORDS=256, PDL=True), num_warps=8)
    row = census(compiled, 256 * 8 * 16 / 256)
    print("shipped", row, flush=True)
    res.save("int_gemv", {"int4 BLOCK_N=16 WORDS=256 warps=8": row})
    if candidate:  # another GEMV's _int_gemv_kernel, on its tiles
        other, rows = load_file(candidate), {}
        for bits, gated, block_n, words, stages, warps in CANDIDATE_TILES:
            compiled = compile_sm90(other._int_gemv_kernel, CANDIDATE_SIGNATURE, dict(
                ROWS=1, HAS_BIAS=False, GATED=gated, BITS=bits, GROUP=128 if bits == 4 else 4096, BLOCK_N=block_n,
                WORDS=words, SPLIT_K=4, STAGES=stages, EXACT=False, PDL=True), num_warps=warps)
            codes = words * (32 // bits) * block_n * (2 if gated else 1) / (32 * warps)
            key = f"int{bits}{' gated' if gated else ''} BLOCK_N={block_n} WORDS={words} STAGES={stages} warps={warps}"
            rows[key] = census(compiled, codes)
            print(key, rows[key], flush=True)
        res.save("int_gemv_candidate", {**rows, "source": candidate})


if __name__ == "__main__":
    commands(int_gemv=int_gemv)
