"""The batch-1 decode step as one persistent kernel (chapter 17)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, cast

import torch
import triton
import triton.language as tl
from torch import nn

from miniinfer.model.transformer import Transformer

QKV, ATTN, O, GU, DOWN, LM = range(6)
OPS = ("qkv", "attention", "o", "gate_up", "down", "lm_head")
COUNTERS = 5  # per layer, one per op that another waits for (nobody waits for the LM head)


@dataclass(frozen=True)
class Task:
    """One instruction of the step: rows `index` of op `op` in `layer`, started once counter `wait`
    reached `count` (wait -1: at once), and counted in counter `signal` when done (-1: nowhere)."""
    op: int
    layer: int
    index: int
    wait: int
    count: int
    signal: int


@dataclass(frozen=True)
class Shape:
    """The model's sizes and the rows each op's task computes: about `tile` weights a task."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tile: int = 32768

    def rows(self, op: int) -> int:
        """Rows of its weight matrix a task of op computes: tile weights over the columns it reads
        (attention's: the query heads that share a KV head)."""
        if op == ATTN:
            return self.heads // self.kv_heads
        K = {QKV: self.hidden, O: self.heads * self.head_dim, GU: 2 * self.hidden, DOWN: self.ffn,
             LM: self.hidden}[op]
        return max(1, self.tile // triton.next_power_of_2(K))

    def tasks(self, op: int) -> int:
        """Tasks of op in one layer: row tiles of its output, or the KV heads attention works by."""
        if op == ATTN:
            return self.kv_heads
        N = {QKV: (self.heads + 2 * self.kv_heads) * self.head_dim, O: self.hidden, GU: self.ffn,
             DOWN: self.hidden, LM: self.vocab}[op]
        return -(-N // self.rows(op))


def waits_for(op: int, layer: int, shape: Shape) -> tuple[int, int]:
    """The dependency rule: the counter a task of (op, layer) waits on and the count it waits for.
    Each op reads what the op before it wrote, all of it (a norm needs the whole vector, attention
    every head's q, k and v): so it waits for every task of that op; layer 0's QKV for nothing."""
    if op == QKV:
        return (-1, 0) if layer == 0 else ((layer - 1) * COUNTERS + DOWN, shape.tasks(DOWN))
    if op == LM:
        return (shape.layers - 1) * COUNTERS + DOWN, shape.tasks(DOWN)
    return layer * COUNTERS + op - 1, shape.tasks(op - 1)


def schedule(shape: Shape, rule=waits_for) -> list[Task]:
    """Every task of the step in one order in which each waits only for tasks before it."""
    out = []
    for layer in range(shape.layers):
        for op in (QKV, ATTN, O, GU, DOWN):
            wait, count = rule(op, layer, shape)
            out += [Task(op, layer, i, wait, count, layer * COUNTERS + op) for i in range(shape.tasks(op))]
    wait, count = rule(LM, shape.layers - 1, shape)
    return out + [Task(LM, shape.layers - 1, i, wait, count, -1) for i in range(shape.tasks(LM))]


def deal(tasks: list[Task], programs: int) -> list[list[Task]]:
    """Round robin: task i to program i mod programs, each program's in the global order."""
    return [tasks[p::programs] for p in range(programs)]


def buffers(task: Task, layers: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """What a task reads and what it writes, as (buffer, version). The buffers are one of each for
    the whole step, each layer's op writing its next version: layer 0's stream is the embedding."""
    n = task.layer
    return {QKV: ([("stream", n)], [("qkv", n)]),
            ATTN: ([("qkv", n)], [("attention", n)]),
            O: ([("attention", n), ("stream", n)], [("mid", n)]),
            GU: ([("mid", n)], [("act", n)]),
            DOWN: ([("act", n), ("mid", n)], [("stream", n + 1)]),
            LM: ([("stream", layers)], [])}[task.op]


class ScheduleError(RuntimeError):
    """Programs that wait for each other forever, or a task that may run before one it must follow."""


def check_schedule(programs: list[list[Task]], layers: int) -> int:
    """Run the programs' lists as the GPU may and prove two things, or raise ScheduleError: they all
    finish (no program waits for a count that never comes), and every task follows, by a chain of
    waits and program order, each write of what it reads and each read and write of the version
    before the one it writes. Returns the number of tasks run."""
    tasks = [t for prog in programs for t in prog]
    ids, first = [], 0
    for prog in programs:
        ids.append(list(range(first, first + len(prog))))
        first += len(prog)
    signalers: dict[int, list[int]] = {}
    touches: dict[tuple[str, int], int] = {}  # (buffer, version) -> its writers, as a bit mask
    reads: dict[tuple[str, int], int] = {}
    for i, t in enumerate(tasks):
        signalers.setdefault(t.signal, []).append(i)
        r, w = buffers(t, layers)
        for b in r:
            reads[b] = reads.get(b, 0) | 1 << i
        for b in w:
            touches[b] = touches.get(b, 0) | 1 << i
    known = [0] * len(tasks)  # the tasks each one is sure to follow, as a bit mask
    counted = {c: 0 for c in signalers}
    after: dict[int, int] = {}  # a counter's full count -> what it proves finished: its tasks and all they follow
    at = [0] * len(programs)
    moved = True
    while moved:
        moved = False
        for p, prog in enumerate(programs):
            while at[p] < len(prog):
                t, i = prog[at[p]], ids[p][at[p]]
                if t.wait >= 0 and counted.get(t.wait, 0) < t.count:
                    break
                before = known[i - 1] | 1 << (i - 1) if at[p] else 0
                if t.wait >= 0 and t.count == len(signalers.get(t.wait, ())):
                    before |= after[t.wait]
                known[i] = before
                r, w = buffers(t, layers)
                for b in r:
                    if touches.get(b, 0) & ~before:
                        raise ScheduleError(f"{OPS[t.op]} {t.index} of layer {t.layer} may read {b[0]} before "
                                            "every task writing it is done")
                for name, version in w:
                    prev = (name, version - 1)
                    if (touches.get(prev, 0) | reads.get(prev, 0)) & ~before:
                        raise ScheduleError(f"{OPS[t.op]} {t.index} of layer {t.layer} may overwrite {name} while "
                                            "a task of the layer before still reads or writes it")
                if t.signal >= 0:
                    counted[t.signal] += 1
                    if counted[t.signal] == len(signalers[t.signal]):
                        mask = 0
                        for s in signalers[t.signal]:
                            mask |= known[s] | 1 << s
                        after[t.signal] = mask
                at[p] += 1
                moved = True
    stuck = [(p, prog[at[p]]) for p, prog in enumerate(programs) if at[p] < len(prog)]
    if stuck:
        p, t = stuck[0]
        raise ScheduleError(f"{len(stuck)} programs wait forever: program {p} at {OPS[t.op]} {t.index} of layer "
                            f"{t.layer} waits for count {t.count} of counter {t.wait}, which reaches "
                            f"{counted.get(t.wait, 0)}")
    return len(tasks)


@triton.jit
def _wait(counter, count):
    """Spin until another program's tasks brought counter to count. Plain (volatile) loads while
    spinning: an atomic from every waiting program would queue behind each other at the counter's
    L2 slice; then one acquire, which orders this program's reads after the writers' release."""
    seen = tl.load(counter, volatile=True)
    while seen < count:
        seen = tl.load(counter, volatile=True)
    tl.atomic_add(counter, 0, sem="acquire")


@triton.jit
def _signal(counter):
    tl.debug_barrier()  # every thread's writes issued before the count says they are there
    tl.atomic_add(counter, 1, sem="release")


@triton.jit
def _prefetch(ptr, nbytes, LINES: tl.constexpr):
    """Ask L2 for nbytes from ptr, a 128-byte line a thread: the loads that follow will find them there."""
    line = tl.minimum(tl.arange(0, LINES).to(tl.int64) * 128, nbytes - 1)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                              [ptr.to(tl.pointer_type(tl.int8)) + line], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _rows(w_ptr, row0, N, x, K: tl.constexpr, R: tl.constexpr, KP: tl.constexpr):
    """Rows row0 .. row0 + R - 1 of w [N, K] times x [KP] (float32, zeros past K) -> [R] float32, the
    whole tile in one load: its rows are contiguous and already on their way (prefetched)."""
    r = row0 + tl.arange(0, R)
    c = tl.arange(0, KP)
    w = tl.load(w_ptr + r[:, None].to(tl.int64) * K + c[None, :], mask=(r[:, None] < N) & (c[None, :] < K),
                other=0.0)
    return tl.sum(w.to(tl.float32) * x[None, :], 1)


@triton.jit
def _stream(stream, embed, token, layer, c, D: tl.constexpr):
    """The residual stream entering layer (entries c): the token's embedding for layer 0."""
    if layer == 0:
        x = tl.load(embed + token * D + c, mask=c < D, other=0.0).to(tl.float32)
    else:
        x = tl.load(stream + c, mask=c < D, other=0.0, cache_modifier=".cg")
    return x


@triton.jit
def _normed(x, w_ptr, c, eps, D: tl.constexpr):
    """RMSNorm of x [KP] (zeros past D) with weights w."""
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    return x * inv * tl.load(w_ptr + c, mask=c < D, other=0.0).to(tl.float32)


@triton.jit
def _attention(qkv, ob, kpool, vpool, table, slot, seq_len, pos, g, inv_freq, qnorm, knorm, eps, scale, rope_factor,
               block_size, H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, G: tl.constexpr, BP: tl.constexpr,
               QK_NORM: tl.constexpr):
    """KV head g's task: its new key (normed, rotated) and value into the pool, then its G query heads
    (normed, rotated) over the whole context. Each vector is taken as two halves: RoPE turns pairs
    (i, i + HD/2). Sizes that are not powers of two are padded, the padding masked."""
    HALF: tl.constexpr = HD // 2
    half = tl.arange(0, triton.next_power_of_2(HALF))
    d = tl.arange(0, triton.next_power_of_2(HD))
    j = tl.arange(0, triton.next_power_of_2(G))
    hm, dm, gm = half < HALF, d < HD, j < G
    qm = gm[:, None] & hm[None, :]
    q = qkv + (g * G + j)[:, None] * HD + half[None, :]
    q1 = tl.load(q, mask=qm, other=0.0, cache_modifier=".cg")
    q2 = tl.load(q + HALF, mask=qm, other=0.0, cache_modifier=".cg")
    k1 = tl.load(qkv + (H + g) * HD + half, mask=hm, other=0.0, cache_modifier=".cg")
    k2 = tl.load(qkv + (H + g) * HD + HALF + half, mask=hm, other=0.0, cache_modifier=".cg")
    v = tl.load(qkv + (H + KVH + g) * HD + d, mask=dm, other=0.0, cache_modifier=".cg")
    if QK_NORM:  # Qwen3: each head normed on its own
        qi = 1.0 / tl.sqrt((tl.sum(q1 * q1, 1) + tl.sum(q2 * q2, 1)) / HD + eps)
        q1 = q1 * qi[:, None] * tl.load(qnorm + half, mask=hm, other=0.0)[None, :].to(tl.float32)
        q2 = q2 * qi[:, None] * tl.load(qnorm + HALF + half, mask=hm, other=0.0)[None, :].to(tl.float32)
        ki = 1.0 / tl.sqrt((tl.sum(k1 * k1, 0) + tl.sum(k2 * k2, 0)) / HD + eps)
        k1 = k1 * ki * tl.load(knorm + half, mask=hm, other=0.0).to(tl.float32)
        k2 = k2 * ki * tl.load(knorm + HALF + half, mask=hm, other=0.0).to(tl.float32)
    ty = kpool.dtype.element_ty
    angle = pos.to(tl.float32) * tl.load(inv_freq + half, mask=hm, other=0.0)
    cos = (tl.cos(angle) * rope_factor).to(ty).to(tl.float32)  # rounded as the model's own cos and sin
    sin = (tl.sin(angle) * rope_factor).to(ty).to(tl.float32)
    row = slot * KVH + g
    if slot >= 0:  # -1: a padding step (the graph's warm-up) writes nowhere
        tl.store(kpool + row * HD + half, (k1 * cos - k2 * sin).to(ty), mask=hm)
        tl.store(kpool + row * HD + HALF + half, (k2 * cos + k1 * sin).to(ty), mask=hm)
        tl.store(vpool + row * HD + d, v.to(ty), mask=dm)
    tl.debug_barrier()  # the loop below reads the new key and value back with the others
    s1 = (q1 * cos[None, :] - q2 * sin[None, :]).to(ty).to(tl.float32) * (scale * 1.4426950408889634)
    s2 = (q2 * cos[None, :] + q1 * sin[None, :]).to(ty).to(tl.float32) * (scale * 1.4426950408889634)
    m = tl.full([triton.next_power_of_2(G)], -float("inf"), tl.float32)
    total = tl.zeros_like(m)
    acc = tl.zeros([triton.next_power_of_2(G), triton.next_power_of_2(HD)], tl.float32)
    for p0 in range(0, seq_len, BP):
        p = p0 + tl.arange(0, BP)
        ok = p < seq_len
        blk = tl.load(table + p // block_size, mask=ok, other=0).to(tl.int64)
        r = (blk * block_size + p % block_size) * KVH + g
        km = ok[:, None] & hm[None, :]
        ka = tl.load(kpool + r[:, None] * HD + half[None, :], mask=km, other=0.0, cache_modifier=".cg")
        kb = tl.load(kpool + r[:, None] * HD + HALF + half[None, :], mask=km, other=0.0, cache_modifier=".cg")
        sc = tl.sum(s1[:, None, :] * ka.to(tl.float32)[None, :, :], 2) + \
            tl.sum(s2[:, None, :] * kb.to(tl.float32)[None, :, :], 2)
        sc = tl.where(ok[None, :], sc, -float("inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(sc - m_new[:, None])
        total = total * alpha + tl.sum(w, 1)
        vt = tl.load(vpool + r[:, None] * HD + d[None, :], mask=ok[:, None] & dm[None, :], other=0.0,
                     cache_modifier=".cg")
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * vt.to(tl.float32)[None, :, :], 1)
        m = m_new
    tl.store(ob + (g * G + j)[:, None] * HD + d[None, :], acc / total[:, None], mask=gm[:, None] & dm[None, :])


@triton.jit
def _prefetch_task(e, wqkv, wo, wgu, wd, lm, D: tl.constexpr, HO: tl.constexpr, F: tl.constexpr, NQ: tl.constexpr,
                   V: tl.constexpr, RA: tl.constexpr, RO: tl.constexpr, RG: tl.constexpr, RD: tl.constexpr,
                   RL: tl.constexpr, LINES: tl.constexpr):
    """Start the weights of the task at e (its table entry) on their way into L2."""
    op = tl.load(e)
    layer = tl.load(e + 1).to(tl.int64)
    t = tl.load(e + 2).to(tl.int64)
    B: tl.constexpr = wqkv.dtype.element_ty.primitive_bitwidth // 8
    if op == 0:
        _prefetch(wqkv + (layer * NQ + t * RA) * D, tl.minimum(RA, NQ - t * RA) * D * B, LINES)
    elif op == 2:
        _prefetch(wo + (layer * D + t * RO) * HO, tl.minimum(RO, D - t * RO) * HO * B, LINES)
    elif op == 3:
        gate = wgu + (layer * 2 * F + t * RG) * D
        _prefetch(gate, tl.minimum(RG, F - t * RG) * D * B, LINES)
        _prefetch(gate + F * D, tl.minimum(RG, F - t * RG) * D * B, LINES)
    elif op == 4:
        _prefetch(wd + (layer * D + t * RD) * F, tl.minimum(RD, D - t * RD) * F * B, LINES)
    elif op == 5:
        _prefetch(lm + t * RL * D, tl.minimum(RL, V - t * RL) * D * B, LINES)


@triton.jit
def _qkv(t, layer, stream, embed, token, anorm, wqkv, bqkv, qkv, eps, D: tl.constexpr, NQ: tl.constexpr,
         R: tl.constexpr, BIAS: tl.constexpr):
    """Norm of the stream, then rows t*R .. of q, k and v (plus their bias: Qwen2's) into qkv."""
    c = tl.arange(0, triton.next_power_of_2(D))
    x = _normed(_stream(stream, embed, token, layer, c, D), anorm + layer * D, c, eps, D)
    r = t * R + tl.arange(0, R)
    acc = _rows(wqkv + layer * NQ * D, t * R, NQ, x, D, R, triton.next_power_of_2(D))
    if BIAS:
        acc += tl.load(bqkv + layer * NQ + r, mask=r < NQ, other=0.0).to(tl.float32)
    tl.store(qkv + r, acc, mask=r < NQ)


@triton.jit
def _o(t, layer, ob, wo, bo, stream, embed, token, mid, D: tl.constexpr, HO: tl.constexpr, R: tl.constexpr,
       BIAS: tl.constexpr):
    """Rows t*R .. of the output projection of attention's output ob, plus the stream, into mid."""
    c = tl.arange(0, triton.next_power_of_2(HO))
    x = tl.load(ob + c, mask=c < HO, other=0.0, cache_modifier=".cg")
    r = t * R + tl.arange(0, R)
    acc = _rows(wo + layer * D * HO, t * R, D, x, HO, R, triton.next_power_of_2(HO))
    if BIAS:
        acc += tl.load(bo + layer * D + r, mask=r < D, other=0.0).to(tl.float32)
    tl.store(mid + r, _stream(stream, embed, token, layer, r, D) + acc, mask=r < D)


@triton.jit
def _gate_up(t, layer, mid, mnorm, wgu, act, eps, D: tl.constexpr, F: tl.constexpr, R: tl.constexpr):
    """Norm of mid [D] (the stream after attention), then rows t*R .. of gate and of up (wgu [L, 2F, D]:
    gate's F rows, then up's), SiLU(gate) x up into act [F]."""
    c = tl.arange(0, triton.next_power_of_2(D))
    x = _normed(tl.load(mid + c, mask=c < D, other=0.0, cache_modifier=".cg"), mnorm + layer * D, c, eps, D)
    w = wgu + layer * 2 * F * D
    gate = _rows(w, t * R, F, x, D, R, triton.next_power_of_2(D))
    up = _rows(w + F * D, t * R, F, x, D, R, triton.next_power_of_2(D))
    r = t * R + tl.arange(0, R)
    tl.store(act + r, gate / (1.0 + tl.exp(-gate)) * up, mask=r < F)


@triton.jit
def _down(t, layer, act, wd, mid, stream, D: tl.constexpr, F: tl.constexpr, R: tl.constexpr):
    """Rows t*R .. of the down projection of act, plus mid: the next layer's stream."""
    c = tl.arange(0, triton.next_power_of_2(F))
    x = tl.load(act + c, mask=c < F, other=0.0, cache_modifier=".cg")
    r = t * R + tl.arange(0, R)
    acc = _rows(wd + layer * D * F, t * R, D, x, F, R, triton.next_power_of_2(F))
    tl.store(stream + r, tl.load(mid + r, mask=r < D, other=0.0, cache_modifier=".cg") + acc, mask=r < D)


@triton.jit
def _lm_head(t, stream, fnorm, lm, logits, eps, D: tl.constexpr, V: tl.constexpr, R: tl.constexpr):
    """The final norm, then rows t*R .. of the logits."""
    c = tl.arange(0, triton.next_power_of_2(D))
    x = _normed(tl.load(stream + c, mask=c < D, other=0.0, cache_modifier=".cg"), fnorm, c, eps, D)
    r = t * R + tl.arange(0, R)
    tl.store(logits + r, _rows(lm, t * R, V, x, D, R, triton.next_power_of_2(D)).to(logits.dtype.element_ty),
             mask=r < V)


@triton.jit
def _decode_kernel(tasks, counts, MAXT, counters, trace, ids, positions, slots, seq_lens, table,
                   stream, mid, qkv, ob, act, logits, kpool, vpool, pool_stride, block_size,
                   embed, anorm, wqkv, bqkv, qnorm, knorm, wo, bo, mnorm, wgu, wd, fnorm, lm, inv_freq,
                   eps, scale, rope_factor,
                   L: tl.constexpr, D: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr,
                   F: tl.constexpr, V: tl.constexpr, RA: tl.constexpr, RO: tl.constexpr, RG: tl.constexpr,
                   RD: tl.constexpr, RL: tl.constexpr, BP: tl.constexpr, LINES: tl.constexpr,
                   QKV_BIAS: tl.constexpr, O_BIAS: tl.constexpr, QK_NORM: tl.constexpr, PREFETCH: tl.constexpr,
                   TRACE: tl.constexpr, GATE_UP: tl.constexpr):
    """One program per SM runs its list of tasks (op, layer, index, wait, count, signal) in order
    (TRACE: each task's start, end of its wait and end, in ns, into trace [programs, MAXT, 3])."""
    NQ: tl.constexpr = (H + 2 * KVH) * HD
    HO: tl.constexpr = H * HD
    pid = tl.program_id(0)
    n = tl.load(counts + pid)
    mine = tasks + pid * MAXT * 6
    token = tl.load(ids).to(tl.int64)
    pos = tl.load(positions)
    slot = tl.load(slots).to(tl.int64)
    seq_len = tl.load(seq_lens)
    if PREFETCH:
        _prefetch_task(mine, wqkv, wo, wgu, wd, lm, D, HO, F, NQ, V, RA, RO, RG, RD, RL, LINES)
    waited = -1
    for i in range(n):
        e = mine + i * 6
        op = tl.load(e)
        layer = tl.load(e + 1).to(tl.int64)
        t = tl.load(e + 2)
        wait = tl.load(e + 3)
        if TRACE:
            tl.store(trace + (pid * MAXT + i) * 3, _now())
        if PREFETCH and i + 1 < n:  # the next task's weights stream in while this one waits and runs
            _prefetch_task(e + 6, wqkv, wo, wgu, wd, lm, D, HO, F, NQ, V, RA, RO, RG, RD, RL, LINES)
        if wait != waited:  # the tasks of one op wait for the same count: the first of them waits for all
            if wait >= 0:
                _wait(counters + wait, tl.load(e + 4))
            waited = wait
        if TRACE:
            tl.store(trace + (pid * MAXT + i) * 3 + 1, _now())
        if op == 0:
            _qkv(t, layer, stream, embed, token, anorm, wqkv, bqkv, qkv, eps, D, NQ, RA, QKV_BIAS)
        elif op == 1:
            _attention(qkv, ob, kpool + layer * pool_stride, vpool + layer * pool_stride, table, slot, seq_len, pos,
                       t, inv_freq, qnorm + layer * HD, knorm + layer * HD, eps, scale, rope_factor, block_size,
                       H, KVH, HD, H // KVH, BP, QK_NORM)
        elif op == 2:
            _o(t, layer, ob, wo, bo, stream, embed, token, mid, D, HO, RO, O_BIAS)
        elif op == 3:
            GATE_UP(t, layer, mid, mnorm, wgu, act, eps, D, F, RG)
        elif op == 4:
            _down(t, layer, act, wd, mid, stream, D, F, RD)
        else:
            _lm_head(t, stream, fnorm, lm, logits, eps, D, V, RL)
        signal = tl.load(e + 5)
        if signal >= 0:
            _signal(counters + signal)
        if TRACE:
            tl.store(trace + (pid * MAXT + i) * 3 + 2, _now())
    # The last program to finish sets the counters back to zero: the next step counts from there.
    if tl.atomic_add(counters + L * 5, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        z = tl.arange(0, triton.next_power_of_2(L * 5 + 1))
        tl.store(counters + z, 0, mask=z < L * 5 + 1)


def unsupported(model: Transformer, kv_dtype: torch.dtype) -> str | None:
    """Why the persistent step cannot run this model, or None: it knows the dense Llama family (Llama,
    Qwen2, Qwen3) in float weights, the whole model in one process, a pool of the model's dtype."""
    cfg, layer = model.cfg, cast(Any, model.model.layers[0])
    if cfg.experts is not None or cfg.attention is not None:
        return "experts and latent attention have steps of their own (chapters 13, 14)"
    if getattr(model, "stage", None) is not None:
        return "a pipeline stage holds some of the layers"
    if type(layer.self_attn.qkv_proj).__name__ != "Linear" or type(layer.mlp.down_proj).__name__ != "Linear":
        return "quantized weights"
    if layer.self_attn.qkv_proj.weight.shape[0] != (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim:
        return "the heads are split over ranks"
    if cfg.mlp_bias or cfg.rotary_dim not in (0, cfg.head_dim):
        return "biased MLP or partial RoPE"
    if cfg.head_dim % 2:
        return "RoPE turns pairs: an odd head size"
    if kv_dtype != model.dtype:
        return "a KV pool of another dtype than the model's"
    return None


def stacked(layers: nn.ModuleList, name: str) -> torch.Tensor:
    """Every layer's parameter `name` as one [L, ...] tensor, each layer's parameter made a view of it:
    the kernel finds layer l's at a stride, and the model keeps one copy of its weights."""
    params = [layer.get_parameter(name) for layer in layers]
    first, n = params[0], params[0].numel()
    if all(p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
           and p.storage_offset() == first.storage_offset() + i * n for i, p in enumerate(params)):
        return first.data.as_strided((len(params), *first.shape), (n, *first.stride()),
                                     first.storage_offset())  # stacked already
    whole = torch.stack([p.data for p in params])
    for p, part in zip(params, whole):
        p.data = part
    return whole


class PersistentDecode:
    """The batch-1 decode step as one launch: one program per SM, each running its list of tasks,
    waiting on counters in global memory where a kernel boundary used to be. Reads the engine's
    weights and paged KV pool in place; `step(...)` returns the logits [1, vocab]."""
    gate_up = _gate_up  # an instruction, as the kernel calls it: problem set 17 puts in its own

    def __init__(self, model: Transformer, k_pool: torch.Tensor, v_pool: torch.Tensor, block_size: int,
                 programs: int | None = None, tile: int = 32768, num_warps: int = 8):
        if (reason := unsupported(model, k_pool.dtype)) is not None:
            raise ValueError(f"the persistent decode step cannot run this model: {reason}")
        cfg, layers = model.cfg, model.model.layers
        dev = k_pool.device
        self.shape = Shape(cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           cfg.intermediate_size, cfg.vocab_size, tile)
        if programs is None:
            programs = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
        lists = deal(schedule(self.shape), programs)
        width = max(len(p) for p in lists)
        table = torch.full((programs, width, 6), -1, dtype=torch.int32)
        for p, tasks in enumerate(lists):
            if tasks:
                table[p, :len(tasks)] = torch.tensor([[t.op, t.layer, t.index, t.wait, t.count, t.signal]
                                                      for t in tasks], dtype=torch.int32)
        self.tasks, self.width = table.to(dev), width
        self.counts = torch.tensor([len(p) for p in lists], dtype=torch.int32, device=dev)
        self.counters = torch.zeros(cfg.num_layers * COUNTERS + 1, dtype=torch.int32, device=dev)
        self.k_pool, self.v_pool, self.block_size, self.programs, self.num_warps = \
            k_pool, v_pool, block_size, programs, num_warps
        names = ["input_layernorm.weight", "self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                 "post_attention_layernorm.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight"]
        w = {name: stacked(layers, name) for name in names}
        norm = w["input_layernorm.weight"]  # stands in for the weights a model has not (never read)
        opt = {name: stacked(layers, name) if flag else norm for name, flag in (
            ("self_attn.qkv_proj.bias", cfg.qkv_bias), ("self_attn.o_proj.bias", cfg.o_bias),
            ("self_attn.q_norm.weight", cfg.qk_norm), ("self_attn.k_norm.weight", cfg.qk_norm))}
        self.weights = (model.model.embed_tokens.weight, norm, w["self_attn.qkv_proj.weight"],
                        opt["self_attn.qkv_proj.bias"], opt["self_attn.q_norm.weight"],
                        opt["self_attn.k_norm.weight"], w["self_attn.o_proj.weight"], opt["self_attn.o_proj.bias"],
                        w["post_attention_layernorm.weight"], w["mlp.gate_up_proj.weight"],
                        w["mlp.down_proj.weight"], model.model.norm.weight, model.lm_head.weight,
                        model.inv_freq.to(dev, torch.float32))
        s = self.shape
        # The step's vectors: the stream, the stream after attention, q k v, attention's output, SiLU's.
        self.buffers = tuple(torch.zeros(n, device=dev, dtype=torch.float32) for n in (
            s.hidden, s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim, s.heads * s.head_dim, s.ffn))
        self.logits = torch.zeros(1, s.vocab, device=dev, dtype=model.dtype)
        self.constants = dict(eps=cfg.rms_norm_eps, scale=cfg.head_dim ** -0.5, rope_factor=model.rope_factor)
        B = model.dtype.itemsize
        self.config = dict(L=s.layers, D=s.hidden, H=s.heads, KVH=s.kv_heads, HD=s.head_dim, F=s.ffn, V=s.vocab,
                           RA=s.rows(QKV), RO=s.rows(O), RG=s.rows(GU), RD=s.rows(DOWN), RL=s.rows(LM),
                           BP=32, LINES=triton.next_power_of_2(max(1, tile * B // 128)),
                           QKV_BIAS=cfg.qkv_bias, O_BIAS=cfg.o_bias, QK_NORM=cfg.qk_norm,
                           PREFETCH=dev.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1")
        self.launch = dict(num_warps=num_warps, launch_cooperative_grid=True) if dev.type == "cuda" \
            else dict(num_warps=num_warps)

    def step(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
             tables: torch.Tensor, trace: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [1, vocab] of one sequence's next token: ids, positions, slots its token's (first
        entry), seq_lens its length with the token, tables its block table (first row). On a GPU,
        `trace` (int64 [programs, width, 3]) gets each task's start, end of wait and end, in ns."""
        c = self.constants
        _decode_kernel[(self.programs,)](
            self.tasks, self.counts, self.width, self.counters, self.counters if trace is None else trace,
            ids, positions, slots, seq_lens, tables, *self.buffers, self.logits, self.k_pool, self.v_pool,
            self.k_pool[0].numel(), self.block_size, *self.weights, c["eps"], c["scale"], c["rope_factor"],
            **self.config, **self.launch, TRACE=trace is not None, GATE_UP=self.gate_up)
        return self.logits


def where_supported(model: Transformer, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    block_size: int) -> PersistentDecode | None:
    """The persistent step where the model allows it, else None (the model's own kernels)."""
    return None if unsupported(model, k_pool.dtype) else PersistentDecode(model, k_pool, v_pool, block_size)
