"""Triton kernels, one module per chapter. Hand-written module: it re-exports the kernels.

Importing it registers chapter 04's ops backend ("triton") and chapter 05's attention kernels.
"""

from miniinfer.kernels.attention import decode_config, paged_attention, prefill_attention, store_kv
from miniinfer.kernels.gemv import gemv
from miniinfer.kernels.norm_rope import apply_rope, fused_add_rms_norm, qk_norm_rope, rms_norm, silu_and_mul

__all__ = ["apply_rope", "decode_config", "fused_add_rms_norm", "gemv", "paged_attention", "prefill_attention",
           "qk_norm_rope", "rms_norm", "silu_and_mul", "store_kv"]
from miniinfer.kernels.quant import int_matmul  # noqa: E402,F401
