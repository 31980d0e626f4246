"""Measure the device copy bandwidth (`y.copy_(x)`, bytes read + written), the ceiling every
memory-bound benchmark of the course is compared against. Hand-written tool.

    python tools/copy_bandwidth.py run [OUT.json]
"""
import json
from pathlib import Path

import torch
from benchlib import commands, gpu_ms, header


def copy_bandwidth(gib: float = 4.0) -> float:
    """GB/s of a device-to-device copy of `gib` GiB, counting read and write."""
    n = int(gib * 2**30) // 2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = gpu_ms(lambda: y.copy_(x), warmup=100, rep=500)
    return 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9


def report(out: str | None = None) -> None:
    res = header(copy_GBps=copy_bandwidth())
    print(json.dumps(res))
    if out:
        Path(out).write_text(json.dumps(res))


if __name__ == "__main__":
    commands(run=report)
