# ruff: noqa  (kept as it ran on the GPU: the source of int4_dot_h100.json, removed from the tree after this commit)
"""Candidate: int4 matmul for 1-16 rows on the tensor cores, codes decoded two per LOP3 as bf16 (128 + u)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _int4_dot_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, x_stride, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, GROUP: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr,
                     BF16_DOT: tl.constexpr):
    W: tl.constexpr = GROUP // 8  # words of a group in one column
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, W)
    groups = K // GROUP
    per = tl.cdiv(groups, SPLIT_K)
    g0 = pid_k * per
    g1 = tl.minimum(g0 + per, groups)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    xmask = rm[:, None] < M
    for g in tl.range(g0, g1, num_stages=STAGES):
        words = tl.load(w_ptr + (g * W + rw)[:, None] * N + rn[None, :], mask=rn[None, :] < N, other=0,
                        eviction_policy="evict_first")
        s = tl.load(s_ptr + g * N + rn, mask=rn < N, other=0.0).to(tl.float32)
        xg = tl.load(x_ptr + rm[:, None] * x_stride + g * GROUP + tl.arange(0, GROUP)[None, :], mask=xmask, other=0.0)
        xs = tl.sum(xg.to(tl.float32), 1)
        part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for p in tl.static_range(4):
            pair = ((words >> (4 * p)) & 0x000F000F) | 0x43004300  # bf16 128 + code p, 128 + code p + 4
            lo = (pair << 16).to(tl.float32, bitcast=True).to(tl.bfloat16)
            hi = (pair & -65536).to(tl.float32, bitcast=True).to(tl.bfloat16)
            k = g * GROUP + rw * 8 + p
            xlo = tl.load(x_ptr + rm[:, None] * x_stride + k[None, :], mask=xmask, other=0.0)
            xhi = tl.load(x_ptr + rm[:, None] * x_stride + k[None, :] + 4, mask=xmask, other=0.0)
            if BF16_DOT:
                part = tl.dot(xlo, lo, part)
                part = tl.dot(xhi, hi, part)
            else:  # the CPU interpreter multiplies bf16 operands' bits as integers
                part = tl.dot(xlo.to(tl.float32), lo.to(tl.float32), part, input_precision="ieee")
                part = tl.dot(xhi.to(tl.float32), hi.to(tl.float32), part, input_precision="ieee")
        acc += (part - 136.0 * xs[:, None]) * s[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out_ptr + rm[:, None] * N + rn[None, :], acc, mask=mask, sem="relaxed")


def int4_dot(x, packed, scale, block_n=32, split_k=1, stages=3, num_warps=4, out32=None):
    K, N = packed.shape[0] * 8, packed.shape[1]
    M = x.shape[0]
    group = K // scale.shape[0]
    if split_k > 1:
        out = out32 if out32 is not None else torch.zeros(M, N, device=x.device, dtype=torch.float32)
    else:
        out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(N, block_n), split_k)
    _int4_dot_kernel[grid](x, packed, scale, out, M, N, K, x.stride(0), BLOCK_M=16, BLOCK_N=block_n,
                           GROUP=group, SPLIT_K=split_k, STAGES=stages,
                           BF16_DOT=x.device.type == 'cuda', num_warps=num_warps)
    return out


@triton.jit
def _split_bf16(pair, ASM: tl.constexpr):
    """An int32 holding two bf16 -> (low, high) as bf16 tensors."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [pair],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    else:
        lo = (pair << 16).to(tl.float32, bitcast=True).to(tl.bfloat16)
        hi = (pair & -65536).to(tl.float32, bitcast=True).to(tl.bfloat16)
    return lo, hi


@triton.jit
def _int4_dot2_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, x_stride, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, GROUP: tl.constexpr, SPLIT_K: tl.constexpr, STAGES: tl.constexpr,
                      BF16_DOT: tl.constexpr, ASM: tl.constexpr):
    """Layout: word w of a group holds the codes of inputs j * W + w (j = 0..7) of that group."""
    W: tl.constexpr = GROUP // 8
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rw = tl.arange(0, W)
    c = tl.arange(0, 2 * W)  # the dot's inputs: 2w + h, h = 0 the low code of word w, 1 the high
    groups = K // GROUP
    per = tl.cdiv(groups, SPLIT_K)
    g0 = pid_k * per
    g1 = tl.minimum(g0 + per, groups)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    xmask = rm[:, None] < M
    for g in tl.range(g0, g1, num_stages=STAGES):
        words = tl.load(w_ptr + (g * W + rw)[:, None] * N + rn[None, :], mask=rn[None, :] < N, other=0,
                        eviction_policy="evict_first")
        s = tl.load(s_ptr + g * N + rn, mask=rn < N, other=0.0).to(tl.float32)
        xg = tl.load(x_ptr + rm[:, None] * x_stride + g * GROUP + tl.arange(0, GROUP)[None, :], mask=xmask, other=0.0)
        xs = tl.sum(xg.to(tl.float32), 1)
        part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for p in tl.static_range(4):
            pair = ((words >> (4 * p)) & 0x000F000F) | 0x43004300  # bf16 128 + code p, 128 + code p + 4
            lo, hi = _split_bf16(pair, ASM)
            b = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (2 * W, BLOCK_N))
            k = g * GROUP + (p + 4 * (c % 2)) * W + c // 2
            xp = tl.load(x_ptr + rm[:, None] * x_stride + k[None, :], mask=xmask, other=0.0)
            if BF16_DOT:
                part = tl.dot(xp, b, part)
            else:  # the CPU interpreter multiplies bf16 operands' bits as integers
                part = tl.dot(xp.to(tl.float32), b.to(tl.float32), part, input_precision="ieee")
        acc += (part - 136.0 * xs[:, None]) * s[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT_K == 1:
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(out_ptr + rm[:, None] * N + rn[None, :], acc, mask=mask, sem="relaxed")


def interleave(packed: torch.Tensor, group: int) -> torch.Tensor:
    """[K/8, N] words (word w: inputs 8w..8w+7) -> word w of each group holding inputs j * W + w."""
    from miniinfer.layers.quant_formats import pack, unpack
    K = packed.shape[0] * 8
    codes = unpack(packed.t().contiguous(), 4)  # [N, K]
    N = codes.shape[0]
    W = group // 8
    codes = codes.reshape(N, K // group, 8, W).transpose(2, 3).reshape(N, K)  # position 8w + j <- input j*W + w
    return pack(codes, 4).t().contiguous()


def int4_dot2(x, packed_il, scale, block_n=32, split_k=1, stages=3, num_warps=4, out32=None, asm=None):
    K, N = packed_il.shape[0] * 8, packed_il.shape[1]
    M = x.shape[0]
    group = K // scale.shape[0]
    cuda = x.device.type == "cuda"
    if split_k > 1:
        out = out32 if out32 is not None else torch.zeros(M, N, device=x.device, dtype=torch.float32)
    else:
        out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    _int4_dot2_kernel[(triton.cdiv(N, block_n), split_k)](
        x, packed_il, scale, out, M, N, K, x.stride(0), BLOCK_M=16, BLOCK_N=block_n, GROUP=group, SPLIT_K=split_k,
        STAGES=stages, BF16_DOT=cuda, ASM=cuda if asm is None else asm, num_warps=num_warps)
    return out
