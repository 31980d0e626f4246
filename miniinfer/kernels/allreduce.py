from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

BLOCK = 2048  # elements a program sums at a time: 4 KB of bf16, so a decode message (8-64 KB) is 2-16 programs
PROGRAMS = 128  # at most, all resident at once on any GPU this runs on: each spins until its peer's arrives


@triton.jit
def _one_shot_kernel(x_ptr, mine_ptr, peer_ptr, flags_ptr, peer_flags_ptr, counts_ptr, n, half,
                     BLOCK: tl.constexpr, PROGRAMS: tl.constexpr):
    pid = tl.program_id(0)
    # Block b of the message is program b % PROGRAMS's, whatever the message's size: a program's flag
    # and call count cover the same part of the buffer in every call.
    # This program's call count (its own slot, read and written by it alone) names the call: the flag
    # the peer waits for, and which half of the buffer holds it. Two halves, so that a rank may write
    # the next call's part while its peer still reads this one's.
    epoch = tl.load(counts_ptr + pid) + 1
    tl.store(counts_ptr + pid, epoch)
    base = (epoch % 2) * half
    for start in range(pid * BLOCK, n, PROGRAMS * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(mine_ptr + base + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)
    tl.debug_barrier()  # every thread's part written before the flag says so
    tl.atomic_xchg(peer_flags_ptr + pid, epoch, sem="release", scope="sys")
    # At least, not equal: a fast peer may already have flagged its next call.
    while tl.atomic_add(flags_ptr + pid, 0, sem="acquire", scope="sys") < epoch:
        pass
    for start in range(pid * BLOCK, n, PROGRAMS * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < n
        x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
        other = tl.load(peer_ptr + base + offsets, mask=mask).to(tl.float32)
        # x + y == y + x: both ranks get the same bits. (In float32, as NCCL adds bf16: and the CPU
        # interpreter cannot add bf16.)
        tl.store(x_ptr + offsets, (x + other).to(x_ptr.dtype.element_ty), mask=mask)


class OneShotAllReduce:
    """The sum of a small tensor over two GPUs in one kernel: each rank copies its part into a buffer
    the other can read (symmetric memory: the same buffer mapped into both processes over NVLink),
    raises a flag in the peer's buffer, waits for the peer's flag and adds the peer's part to its own.
    One launch, one read over the link, nothing for the host to do: a CUDA graph captures it."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, max_bytes: int = 512 << 10):
        """max_bytes: the largest message it serves (NCCL is faster above: `tools/bench_allreduce.py`)."""
        import torch.distributed._symmetric_memory as symm_mem
        self.rank, self.max_bytes = dist.get_rank(group), max_bytes
        flag_bytes = 4 * PROGRAMS
        self.buffer = symm_mem.empty(2 * max_bytes + flag_bytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(self.buffer, group.group_name)
        peer = handle.get_buffer(1 - self.rank, (2 * max_bytes + flag_bytes,), torch.uint8)
        self.mine, self.peer = self.buffer[:2 * max_bytes], peer[:2 * max_bytes]
        self.flags = self.buffer[2 * max_bytes:].view(torch.int32)  # the peer raises these
        self.peer_flags = peer[2 * max_bytes:].view(torch.int32)
        self.flags.zero_()
        self.counts = torch.zeros(PROGRAMS, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group)  # both ranks' flags are zero before either raises one

    def serves(self, x: torch.Tensor) -> bool:
        return x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over both ranks, in place."""
        one_shot(x, self.mine.view(x.dtype), self.peer.view(x.dtype), self.flags, self.peer_flags, self.counts)
        return x


def one_shot(x: torch.Tensor, mine: torch.Tensor, peer: torch.Tensor, flags: torch.Tensor,
             peer_flags: torch.Tensor, counts: torch.Tensor) -> None:
    """The kernel's launch: x += the peer's x, through this rank's buffer `mine` (two halves) and the
    peer's `peer`; the flags each rank waits on and its own call counts, one per program."""
    n = x.numel()
    grid = (min(PROGRAMS, triton.cdiv(n, BLOCK)),)
    _one_shot_kernel[grid](x, mine, peer, flags, peer_flags, counts, n, mine.numel() // 2, BLOCK=BLOCK,
                           PROGRAMS=PROGRAMS)
