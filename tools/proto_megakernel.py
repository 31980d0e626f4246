"""Prototype: a Llama decode step (batch 1) as one persistent Triton kernel. Not part of the package yet.

    python tools/proto_megakernel.py check         (tiny shape, one program running every task in order; CPU ok)
    python tools/proto_megakernel.py bench OUT.json (GPU: the Llama-3.2-1B shape, one program per SM)

The O and down projections may be split by columns as well as rows (`split`): each part adds its sum into the
output (zeroed before the step), so those two stages have tasks for every SM.
"""

import math
import time

import torch
import triton
import triton.language as tl
from benchlib import Results, commands

QKV, ATTN, O, GU, DOWN, LM = range(6)


@triton.jit
def _wait(ptr, target):
    seen = tl.atomic_add(ptr, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(ptr, 0, sem="acquire")


@triton.jit
def _done(ptr):
    tl.debug_barrier()  # every thread's stores issued before the count says so
    tl.atomic_add(ptr, 1, sem="release")


@triton.jit
def _inv_rms(x_ptr, D: tl.constexpr, eps):
    x = tl.load(x_ptr + tl.arange(0, D), cache_modifier=".cg")
    return 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)


@triton.jit
def _gemv(w_ptr, ldw, rows, x_ptr, nw_ptr, inv, K: tl.constexpr, R: tl.constexpr, BK: tl.constexpr,
          NORM: tl.constexpr):
    acc = tl.zeros([R], tl.float32)
    for k0 in tl.range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + cols, cache_modifier=".cg")
        if NORM:
            x = x * inv * tl.load(nw_ptr + cols).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * ldw + cols[None, :], eviction_policy="evict_first").to(tl.float32)
        acc += tl.sum(w * x[None, :], 1)
    return acc


@triton.jit
def _step_kernel(tasks, counts, MAXT, counters, step,
                 hs, mids, qb, ob, act, kc, vc, logits, cos, sin, pos,
                 wqkv, anorm, wo, mnorm, wgu, wd, fnorm, lm, eps, qscale,
                 L: tl.constexpr, D: tl.constexpr, H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr,
                 F: tl.constexpr, V: tl.constexpr, MAXPOS: tl.constexpr,
                 R: tl.constexpr, RL: tl.constexpr, BK: tl.constexpr, BP: tl.constexpr,
                 SPLIT: tl.constexpr):
    pid = tl.program_id(0)
    n = tl.load(counts + pid)
    NQKV: tl.constexpr = (H + 2 * KVH) * HD // R
    NO: tl.constexpr = D // R * SPLIT  # the O and the down projections: row tiles x column splits
    NGU: tl.constexpr = F // R
    for i in range(n):
        base = tasks + (pid * MAXT + i) * 3
        op = tl.load(base)
        layer = tl.load(base + 1)
        t = tl.load(base + 2)
        if op == 0:  # QKV: norm, 16 rows of the fused projection, RoPE, q to its buffer, k and v to the cache
            if layer > 0:
                _wait(counters + (layer - 1) * 5 + 4, NO * step)
            x_ptr = hs + layer * D
            inv = _inv_rms(x_ptr, D, eps)
            rows = t * R + tl.arange(0, R)
            acc = _gemv(wqkv + layer * (H + 2 * KVH) * HD * D, D, rows, x_ptr, anorm + layer * D, inv, D, R, BK, True)
            head = (t * R) // HD
            first = (t * R) % HD
            if head < H + KVH:  # rows come in pairs (i, i + HD/2), permuted so on load: rotate each pair
                a, b = tl.split(tl.reshape(acc, [R // 2, 2]))
                j = first // 2 + tl.arange(0, R // 2)
                c = tl.load(cos + j)
                s = tl.load(sin + j)
                ra = a * c - b * s
                rb = b * c + a * s
                if head < H:
                    tl.store(qb + layer * H * HD + head * HD + j, ra)
                    tl.store(qb + layer * H * HD + head * HD + j + HD // 2, rb)
                else:
                    kv = kc + ((layer * KVH + head - H) * MAXPOS + pos) * HD
                    tl.store(kv + j, ra.to(kc.dtype.element_ty))
                    tl.store(kv + j + HD // 2, rb.to(kc.dtype.element_ty))
            else:
                kv = vc + ((layer * KVH + head - H - KVH) * MAXPOS + pos) * HD
                tl.store(kv + first + tl.arange(0, R), acc.to(vc.dtype.element_ty))
            _done(counters + layer * 5 + 0)
        elif op == 1:  # attention of one query head over the whole context
            _wait(counters + layer * 5 + 0, NQKV * step)
            kvh = t // (H // KVH)
            d = tl.arange(0, HD)
            q = tl.load(qb + layer * H * HD + t * HD + d, cache_modifier=".cg") * qscale
            mx = tl.full([1], -float("inf"), tl.float32)
            den = tl.zeros([1], tl.float32)
            oacc = tl.zeros([HD], tl.float32)
            kbase = kc + (layer * KVH + kvh) * MAXPOS * HD
            vbase = vc + (layer * KVH + kvh) * MAXPOS * HD
            for p0 in range(0, pos + 1, BP):
                p = p0 + tl.arange(0, BP)
                ok = p <= pos
                k = tl.load(kbase + p[:, None] * HD + d[None, :], mask=ok[:, None], other=0.0, cache_modifier=".cg")
                sc = tl.where(ok, tl.sum(k.to(tl.float32) * q[None, :], 1), -float("inf"))
                m_new = tl.maximum(mx, tl.max(sc, 0))
                alpha = tl.exp(mx - m_new)
                e = tl.exp(sc - m_new)
                v = tl.load(vbase + p[:, None] * HD + d[None, :], mask=ok[:, None], other=0.0, cache_modifier=".cg")
                oacc = oacc * alpha + tl.sum(e[:, None] * v.to(tl.float32), 0)
                den = den * alpha + tl.sum(e, 0)
                mx = m_new
            tl.store(ob + layer * H * HD + t * HD + d, oacc / den)
            _done(counters + layer * 5 + 1)
        elif op == 2:  # O projection of 16 rows, plus the residual
            _wait(counters + layer * 5 + 1, H * step)
            rows = (t // SPLIT) * R + tl.arange(0, R)
            col0 = (t % SPLIT) * (H * HD // SPLIT)
            acc = _gemv(wo + layer * D * H * HD + col0, H * HD, rows, ob + layer * H * HD + col0, anorm, 1.0,
                        H * HD // SPLIT, R, BK, False)
            h = tl.load(hs + layer * D + rows, cache_modifier=".cg")
            tl.atomic_add(mids + layer * D + rows, acc + tl.where(col0 == 0, h, 0.0), sem="relaxed")
            _done(counters + layer * 5 + 2)
        elif op == 3:  # norm, gate and up of 16 rows each, SiLU(gate) x up
            _wait(counters + layer * 5 + 2, NO * step)
            x_ptr = mids + layer * D
            inv = _inv_rms(x_ptr, D, eps)
            rows = t * R + tl.arange(0, R)
            w = wgu + layer * 2 * F * D
            g = _gemv(w, D, rows, x_ptr, mnorm + layer * D, inv, D, R, BK, True)
            u = _gemv(w + F * D, D, rows, x_ptr, mnorm + layer * D, inv, D, R, BK, True)
            tl.store(act + layer * F + rows, g / (1.0 + tl.exp(-g)) * u)
            _done(counters + layer * 5 + 3)
        elif op == 4:  # down projection of 16 rows, plus the residual
            _wait(counters + layer * 5 + 3, NGU * step)
            rows = (t // SPLIT) * R + tl.arange(0, R)
            col0 = (t % SPLIT) * (F // SPLIT)
            acc = _gemv(wd + layer * D * F + col0, F, rows, act + layer * F + col0, anorm, 1.0, F // SPLIT, R, BK,
                        False)
            h = tl.load(mids + layer * D + rows, cache_modifier=".cg")
            tl.atomic_add(hs + (layer + 1) * D + rows, acc + tl.where(col0 == 0, h, 0.0), sem="relaxed")
            _done(counters + layer * 5 + 4)
        else:  # the LM head: final norm, RL rows of logits
            _wait(counters + (L - 1) * 5 + 4, NO * step)
            x_ptr = hs + L * D
            inv = _inv_rms(x_ptr, D, eps)
            lrows = t * RL + tl.arange(0, RL)
            tl.store(logits + lrows, _gemv(lm, D, lrows, x_ptr, fnorm, inv, D, RL, BK, True))


def task_list(L, H, KVH, HD, D, F, V, R, RL, split):
    """Every task in an order where each waits only on earlier ones."""
    out = []
    for layer in range(L):
        out += [(QKV, layer, t) for t in range((H + 2 * KVH) * HD // R)]
        out += [(ATTN, layer, t) for t in range(H)]
        out += [(O, layer, t) for t in range(D // R * split)]
        out += [(GU, layer, t) for t in range(F // R)]
        out += [(DOWN, layer, t) for t in range(D // R * split)]
    out += [(LM, 0, t) for t in range(V // RL)]
    return out


def deal(tasks, programs):
    """Round robin: task i to program i mod P, each program's in the global order."""
    per = [tasks[p::programs] for p in range(programs)]
    maxt = max(len(q) for q in per)
    table = torch.zeros(programs, maxt, 3, dtype=torch.int32)
    for p, q in enumerate(per):
        if q:
            table[p, :len(q)] = torch.tensor(q, dtype=torch.int32)
    return table, torch.tensor([len(q) for q in per], dtype=torch.int32), maxt


def pair_rows(w, H, KVH, HD):
    """q and k rows of each head reordered (0, HD/2, 1, HD/2 + 1, ...): a rotated pair in adjacent rows."""
    order = torch.arange(HD).view(2, HD // 2).t().reshape(-1)
    idx = torch.cat([h * HD + order for h in range(H + KVH)] + [torch.arange((H + KVH) * HD, (H + 2 * KVH) * HD)])
    return w[:, idx]


class Model:
    def __init__(self, L, D, H, KVH, HD, F, V, maxpos, device, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)

        def rnd(*shape, scale):
            return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)
        self.shape = dict(L=L, D=D, H=H, KVH=KVH, HD=HD, F=F, V=V, MAXPOS=maxpos)
        self.wqkv = rnd(L, (H + 2 * KVH) * HD, D, scale=D ** -0.5)
        self.anorm = 1 + rnd(L, D, scale=0.1)
        self.wo = rnd(L, D, H * HD, scale=(H * HD) ** -0.5)
        self.mnorm = 1 + rnd(L, D, scale=0.1)
        self.wgu = rnd(L, 2, F, D, scale=D ** -0.5)
        self.wd = rnd(L, D, F, scale=F ** -0.5)
        self.fnorm = 1 + rnd(D, scale=0.1)
        self.lm = rnd(V, D, scale=D ** -0.5)
        self.wqkv_paired = pair_rows(self.wqkv, H, KVH, HD).contiguous()
        self.kc = torch.zeros(L, KVH, maxpos, HD, device=device, dtype=dtype)
        self.vc = torch.zeros_like(self.kc)
        self.theta = 500000.0


def rope_at(pos, HD, theta, device):
    inv = 1.0 / theta ** (torch.arange(0, HD, 2, device=device, dtype=torch.float32) / HD)
    ang = pos * inv
    return ang.cos(), ang.sin()


def reference_step(m: Model, x, pos, kc, vc, eps=1e-5):
    """The same step in float32 torch ops, on copies of the cache."""
    s = m.shape
    L, H, KVH, HD = s["L"], s["H"], s["KVH"], s["HD"]
    cos, sin = rope_at(pos, HD, m.theta, x.device)

    def norm(v, w):
        return v * torch.rsqrt(v.pow(2).mean() + eps) * w.float()

    def rope(v):  # [n, HD]
        a, b = v[:, :HD // 2], v[:, HD // 2:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    h = x.float()
    for layer in range(L):
        qkv = m.wqkv[layer].float() @ norm(h, m.anorm[layer])
        q = rope(qkv[:H * HD].view(H, HD))
        k = rope(qkv[H * HD:(H + KVH) * HD].view(KVH, HD))
        v = qkv[(H + KVH) * HD:].view(KVH, HD)
        kc[layer, :, pos] = k.to(kc.dtype)
        vc[layer, :, pos] = v.to(vc.dtype)
        keys, vals = kc[layer, :, :pos + 1].float(), vc[layer, :, :pos + 1].float()  # [KVH, P, HD]
        rep = H // KVH
        sc = torch.einsum("hd,hpd->hp", q, keys.repeat_interleave(rep, 0)) / math.sqrt(HD)
        o = torch.einsum("hp,hpd->hd", sc.softmax(-1), vals.repeat_interleave(rep, 0)).reshape(-1)
        h = h + m.wo[layer].float() @ o
        xn = norm(h, m.mnorm[layer])
        gate, up = m.wgu[layer, 0].float() @ xn, m.wgu[layer, 1].float() @ xn
        h = h + m.wd[layer].float() @ (torch.nn.functional.silu(gate) * up)
    return m.lm.float() @ norm(h, m.fnorm)


class Persistent:
    def __init__(self, m: Model, programs: int, R=16, RL=64, BK=256, BP=32, num_warps=4, split=1):
        s = m.shape
        self.m, self.s, self.programs = m, s, programs
        self.R, self.RL, self.BK, self.BP, self.num_warps, self.split = R, RL, BK, BP, num_warps, split
        dev = m.wqkv.device
        tasks = task_list(s["L"], s["H"], s["KVH"], s["HD"], s["D"], s["F"], s["V"], R, RL, split)
        table, counts, self.maxt = deal(tasks, programs)
        self.tasks, self.counts = table.to(dev), counts.to(dev)
        self.n_tasks = len(tasks)
        L, D, H, HD, F = s["L"], s["D"], s["H"], s["HD"], s["F"]
        f32 = dict(device=dev, dtype=torch.float32)
        self.hs, self.mids = torch.zeros(L + 1, D, **f32), torch.zeros(L, D, **f32)
        self.qb, self.ob = torch.zeros(L, H * HD, **f32), torch.zeros(L, H * HD, **f32)
        self.act, self.logits = torch.zeros(L, F, **f32), torch.zeros(s["V"], **f32)
        self.counters = torch.zeros(L * 5, device=dev, dtype=torch.int32)
        self.steps = 0

    def __call__(self, x, pos):
        m, s = self.m, self.s
        self.steps += 1
        self.hs[0].copy_(x)
        self.hs[1:].zero_()  # the O and down projections add their column splits' sums into these
        self.mids.zero_()
        cos, sin = rope_at(pos, s["HD"], m.theta, x.device)
        _step_kernel[(self.programs,)](
            self.tasks, self.counts, self.maxt, self.counters, self.steps,
            self.hs, self.mids, self.qb, self.ob, self.act, m.kc, m.vc, self.logits, cos, sin, pos,
            m.wqkv_paired, m.anorm, m.wo, m.mnorm, m.wgu, m.wd, m.fnorm, m.lm, 1e-5, s["HD"] ** -0.5,
            R=self.R, RL=self.RL, BK=self.BK, BP=self.BP, SPLIT=self.split, num_warps=self.num_warps, **s)
        return self.logits


def check():
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m = Model(L=2, D=64, H=4, KVH=2, HD=32, F=128, V=256, maxpos=16, device=dev, dtype=torch.float32)
    run = Persistent(m, programs=1 if dev == "cpu" else 8, R=16, RL=64, BK=16, BP=8, split=2)
    kc, vc = m.kc.clone(), m.vc.clone()
    for pos in range(5):
        x = torch.randn(64, device=dev)
        want = reference_step(m, x, pos, kc, vc)
        got = run(x, pos)
        err = (got - want).abs().max().item()
        print(f"pos {pos}: max |logit error| {err:.2e}, argmax same: {got.argmax().item() == want.argmax().item()}")
        assert err < 1e-3, err


def bench(out):
    dev = "cuda"
    props = torch.cuda.get_device_properties(0)
    shape = dict(L=16, D=2048, H=32, KVH=8, HD=64, F=8192, V=128256)
    m = Model(**shape, maxpos=1024, device=dev, dtype=torch.bfloat16)
    weight_bytes = sum(t.numel() * t.element_size() for t in (m.wqkv, m.wo, m.wgu, m.wd, m.lm))
    buf = torch.empty(weight_bytes // 2, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(buf)
    for _ in range(3):
        dst.copy_(buf)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(buf)
    torch.cuda.synchronize()
    copy_GBps = 2 * weight_bytes * 10 / (time.perf_counter() - t0) / 1e9
    del buf, dst
    floor_us = weight_bytes / (copy_GBps * 1e9) * 1e6  # the weights read once at the copy's rate (bytes in + out)
    results = Results(out, sms=props.multi_processor_count, weight_bytes=weight_bytes, copy_GBps=copy_GBps,
                      floor_us=floor_us)
    runs = []
    print(f"{props.name}: floor {floor_us:.0f} us (copy {copy_GBps:.0f} GB/s)", flush=True)
    x = torch.randn(2048, device=dev)
    kc, vc = m.kc.clone(), m.vc.clone()
    want = reference_step(m, x, 0, kc, vc)
    configs = [(32, 128, 256, 8, 1), (32, 128, 256, 8, 2), (32, 128, 256, 8, 4), (16, 128, 256, 4, 2),
               (32, 128, 128, 4, 2)]
    for R, RL, BK, warps, split in configs:
        run = Persistent(m, props.multi_processor_count, R=R, RL=RL, BK=BK, BP=32, num_warps=warps, split=split)
        got = run(x, 0)
        torch.cuda.synchronize()
        err = (got - want).abs().max().item()
        same = got.argmax().item() == want.argmax().item()
        for pos in range(1, 20):
            run(x, pos)
        torch.cuda.synchronize()
        n, pos0 = 50, 500
        t0 = time.perf_counter()
        for i in range(n):
            run(x, pos0 + i)
        torch.cuda.synchronize()
        us = (time.perf_counter() - t0) / n * 1e6
        r = {"R": R, "RL": RL, "BK": BK, "warps": warps, "split": split, "tasks": run.n_tasks, "step_us": us,
             "of_floor": floor_us / us, "max_logit_error_pos0": err, "argmax_same": same}
        runs.append(r)
        print(r, flush=True)
        results.save("runs", runs)


if __name__ == "__main__":
    commands(check=check, bench=bench)
