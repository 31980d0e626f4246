"""Run the chapter-05 kernels at the sizes where they miss their goals, for Nsight Compute:

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
        -k regex:"_decode|_merge|_prefill" python tools/profile_attention.py

Hand-written tool. Each kernel runs three times; profile the last launches (--launch-skip).
"""

import torch
from bench_attention import HQ, paged_pool

import miniinfer as mi

for B, ctx, D in ((16, 2048, 64), (1, 32768, 64)):
    k_cache, v_cache, tables = paged_pool([ctx] * B, D)
    q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
    for _ in range(3):
        mi.kernels.paged_attention(q, k_cache, v_cache, tables, lens, D ** -0.5, max_len=ctx)
k_cache, v_cache, tables = paged_pool([1024] * 4, 64)
q = torch.randn(4 * 1024, HQ, 64, device="cuda", dtype=torch.bfloat16)
qsl = torch.arange(0, 5 * 1024, 1024, device="cuda", dtype=torch.int32)
lens = torch.full((4,), 1024, device="cuda", dtype=torch.int32)
for _ in range(3):
    mi.kernels.prefill_attention(q, k_cache, v_cache, qsl, lens, tables, 0.125, 1024)
torch.cuda.synchronize()
