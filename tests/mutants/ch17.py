"""Wrong answers to problem set 17 that its checks must reject: each named (or documented) for its mistake."""

import triton
import triton.language as tl

from miniinfer.course import checks as testing
from miniinfer.kernels.persistent import (
    ATTN,
    COUNTERS,
    DOWN,
    GU,
    LM,
    QKV,
    O,
    ScheduleError,
    Task,
    schedule,
    waits_for,
)


def gate_up_one_short(op, layer, shape):
    """Gate/up starts when all but one of the O tasks are done: it may norm a half-written vector."""
    wait, count = waits_for(op, layer, shape)
    return (wait, count - 1) if op == GU else (wait, count)


def o_waits_for_qkv(op, layer, shape):
    """O waits for QKV, two ops back: attention's output may not be there yet."""
    return (layer * COUNTERS + QKV, shape.tasks(QKV)) if op == O else waits_for(op, layer, shape)


def layers_overlap(op, layer, shape):
    """A layer's QKV waits for nothing: it reads a stream the layer before is still writing."""
    return (-1, 0) if op == QKV else waits_for(op, layer, shape)


def lm_head_after_the_first_layer(op, layer, shape):
    """The LM head waits for layer 0's down projection, not the last layer's."""
    return (DOWN, shape.tasks(DOWN)) if op == LM else waits_for(op, layer, shape)


def tasks_with_gate_up_before_o(shape, rule):
    """Each layer's gate/up listed before its O: a program stops at gate/up before its own O tasks run."""
    order = {QKV: 0, ATTN: 1, GU: 2, O: 3, DOWN: 4, LM: 5}
    return sorted(schedule(shape, rule), key=lambda t: (t.layer, order[t.op]))


def tasks_counted_one_op_early(shape, rule):
    """Counts in the counter of the op before (layer x 5 + op - 1): every count is off by one op."""
    return [Task(t.op, t.layer, t.index, t.wait, t.count, t.signal - 1 if t.signal > 0 else t.signal)
            for t in schedule(shape, rule)]


def lm_head_counted(shape, rule):
    """The LM head's tasks count in counter layers x 5, the one the kernel's programs count their ends in."""
    return [Task(t.op, t.layer, t.index, t.wait, t.count, t.layer * COUNTERS + t.op if t.op == LM else t.signal)
            for t in schedule(shape, rule)]


def programs_one_after_another(programs):
    """Runs each program's whole list in turn, waits unheeded: program 0 may read what program 1 has not written."""
    return [(p, t) for p, prog in enumerate(programs) for t in prog]


def one_sweep(programs):
    """Sweeps the programs once: a program waiting on one further down the sweep is called stuck."""
    counted, order = {}, []
    for p, prog in enumerate(programs):
        for t in prog:
            if t.wait >= 0 and counted.get(t.wait, 0) < t.count:
                raise ScheduleError(f"program {p} waits forever")
            counted[t.signal] = counted.get(t.signal, 0) + 1
            order.append((p, t))
    return order


def any_ready_task(programs):
    """Runs any task of a program whose wait is met, not only its next: a program's order is not kept."""
    counted, left, order = {}, [list(prog) for prog in programs], []
    moved = True
    while moved:
        moved = False
        for p, prog in enumerate(left):
            for t in [t for t in prog if t.wait < 0 or counted.get(t.wait, 0) >= t.count]:
                prog.remove(t)
                counted[t.signal] = counted.get(t.signal, 0) + 1
                order.append((p, t))
                moved = True
    if any(left):
        raise ScheduleError("programs wait forever")
    return order


def stuck_programs_dropped(programs):
    """Returns what ran and says nothing of the programs left waiting."""
    counted, at, order = {}, [0] * len(programs), []
    moved = True
    while moved:
        moved = False
        for p, prog in enumerate(programs):
            while at[p] < len(prog) and (prog[at[p]].wait < 0 or counted.get(prog[at[p]].wait, 0) >= prog[at[p]].count):
                counted[prog[at[p]].signal] = counted.get(prog[at[p]].signal, 0) + 1
                order.append((p, prog[at[p]]))
                at[p] += 1
                moved = True
    return order


@triton.jit
def silu_of_up(t, layer, mid, mnorm, wgu, act, eps, D: tl.constexpr, F: tl.constexpr, R: tl.constexpr):
    """SiLU on up and not on gate."""
    c = tl.arange(0, triton.next_power_of_2(D))
    x = tl.load(mid + c, mask=c < D, other=0.0)
    x = x / tl.sqrt(tl.sum(x * x, 0) / D + eps) * tl.load(mnorm + layer * D + c, mask=c < D, other=0.0).to(tl.float32)
    r = t * R + tl.arange(0, R)
    mask = (r[:, None] < F) & (c[None, :] < D)
    rows = wgu + layer * 2 * F * D + r[:, None] * D + c[None, :]
    g = tl.sum(tl.load(rows, mask=mask, other=0.0).to(tl.float32) * x[None, :], 1)
    u = tl.sum(tl.load(rows + F * D, mask=mask, other=0.0).to(tl.float32) * x[None, :], 1)
    tl.store(act + r, u / (1.0 + tl.exp(-u)) * g, mask=r < F)


@triton.jit
def norm_over_the_padded_block(t, layer, mid, mnorm, wgu, act, eps, D: tl.constexpr, F: tl.constexpr,
                               R: tl.constexpr):
    """The mean of squares over the padded block (next_power_of_2(D) entries), not over D."""
    DP: tl.constexpr = triton.next_power_of_2(D)
    c = tl.arange(0, DP)
    x = tl.load(mid + c, mask=c < D, other=0.0)
    x = x / tl.sqrt(tl.sum(x * x, 0) / DP + eps) * tl.load(mnorm + layer * D + c, mask=c < D, other=0.0).to(tl.float32)
    r = t * R + tl.arange(0, R)
    mask = (r[:, None] < F) & (c[None, :] < D)
    rows = wgu + layer * 2 * F * D + r[:, None] * D + c[None, :]
    g = tl.sum(tl.load(rows, mask=mask, other=0.0).to(tl.float32) * x[None, :], 1)
    u = tl.sum(tl.load(rows + F * D, mask=mask, other=0.0).to(tl.float32) * x[None, :], 1)
    tl.store(act + r, g / (1.0 + tl.exp(-g)) * u, mask=r < F)


@triton.jit
def layer_zero_weights(t, layer, mid, mnorm, wgu, act, eps, D: tl.constexpr, F: tl.constexpr, R: tl.constexpr):
    """Every layer's task reads layer 0's norm and weights."""
    c = tl.arange(0, triton.next_power_of_2(D))
    x = tl.load(mid + c, mask=c < D, other=0.0)
    x = x / tl.sqrt(tl.sum(x * x, 0) / D + eps) * tl.load(mnorm + c, mask=c < D, other=0.0).to(tl.float32)
    r = t * R + tl.arange(0, R)
    mask = (r[:, None] < F) & (c[None, :] < D)
    rows = wgu + r[:, None] * D + c[None, :]
    g = tl.sum(tl.load(rows, mask=mask, other=0.0).to(tl.float32) * x[None, :], 1)
    u = tl.sum(tl.load(rows + F * D, mask=mask, other=0.0).to(tl.float32) * x[None, :], 1)
    tl.store(act + r, g / (1.0 + tl.exp(-g)) * u, mask=r < F)


MUTANTS = [
    (testing.check_waits_for, gate_up_one_short),
    (testing.check_waits_for, o_waits_for_qkv),
    (testing.check_waits_for, layers_overlap),
    (testing.check_waits_for, lm_head_after_the_first_layer),
    (testing.check_schedule_list, tasks_with_gate_up_before_o),
    (testing.check_schedule_list, tasks_counted_one_op_early),
    (testing.check_schedule_list, lm_head_counted),
    (testing.check_run_programs, programs_one_after_another),
    (testing.check_run_programs, one_sweep),
    (testing.check_run_programs, any_ready_task),
    (testing.check_run_programs, stuck_programs_dropped),
    (testing.check_gate_up, silu_of_up),
    (testing.check_gate_up, norm_over_the_padded_block),
    (testing.check_gate_up, layer_zero_weights),
]
