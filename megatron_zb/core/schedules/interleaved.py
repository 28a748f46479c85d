"""Megatron's interleaved 1F1B: v model chunks per rank, looped placement (stage s on rank s % p).

Megatron walks "virtual microbatches" k = 0 .. m*v-1. Microbatches are taken in groups of
``group`` (Megatron's microbatch_group_size_per_vp_stage, default p); inside a group every chunk
runs the whole group before the next chunk. Forward k runs (mb, chunk) of that table; backward k
runs the same microbatch on chunk v-1-chunk. Rank r does (p-r-1)*2 + (v-1)*group warm-up
forwards (all of them if that exceeds m*v), then one F / one BW alternately, then the cool-down.

Microbatch counts: any multiple of the group size works, and so does m < group (everything is
warm-up; Megatron refuses that, we run it). Megatron also refuses a last group of 1..p-1
microbatches after full groups (m > group, 0 < m % group < p); there its order sometimes
deadlocks (e.g. p=5, m=7, v=2) and sometimes only has extra bubbles (p=2, m=5): this generator
runs the latter and refuses the former with the counts that work.

``combined_1f1b``: the same order as Megatron runs it with ``--overlap-moe-expert-parallel-comm``
(its "combined 1F1B", MoE expert-parallel all-to-all overlap): one more warm-up forward on every
rank, so that the forward and the backward of every steady-state step are independent, and each
such step one overlapped F&B pair (``OVERLAP_F_B``). Not a registered schedule: the anchor that
``benchmarks/bench_moe_overlap.py`` compares with.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

from ..ir import BW, Action, F, Placement, Schedule, ScheduleError, Setting
from ..sim.simulate import Deadlock, simulate


def schedule_table(m: int, v: int, group: int) -> List[Tuple[int, int]]:
    table = []
    for first in range(0, m, group):
        last = m if first + group >= m else first + group
        table += [(mb, c) for c in range(v) for mb in range(first, last)]
    return table


def combined_1f1b(setting: Setting, group: Optional[int] = None) -> Schedule:
    """Megatron's interleaved 1F1B with its combined-1F1B EP overlap (see the module doc)."""
    return interleaved_1f1b(setting, group, combined=True)


def interleaved_1f1b(setting: Setting, group: Optional[int] = None, combined: bool = False) -> Schedule:
    p, m, v = setting.stages, setting.microbatches, setting.chunks
    if v < 2:
        raise ScheduleError("interleaved-1f1b needs --chunks >= 2 (model chunks per rank); "
                            "with one chunk use 1f1b")
    group = p if group is None else group
    if group < 1:
        raise ScheduleError(f"microbatch group size must be >= 1, got {group}")
    table = schedule_table(m, v, group)
    total = m * v
    orders = []
    for r in range(p):
        def fwd(k):
            mb, c = table[k]
            return Action(F, c * p + r, mb)

        def bwd(k):
            mb, c = table[k]
            return Action(BW, (v - 1 - c) * p + r, mb)
        warm = min((p - r - 1) * 2 + (v - 1) * group + int(combined), total)
        order = [fwd(k) for k in range(warm)]
        for k in range(total - warm):
            f, b = fwd(warm + k), bwd(k)
            order += [Action.overlap(f, b)] if combined and f.mb != b.mb else [f, b]
        order += [bwd(k) for k in range(total - warm, total)]
        orders.append(order)
    sched = Schedule("interleaved-1f1b", Placement.looped(p, v), m, orders,
                     {"group": group, **({"combined_1f1b": True} if combined else {})})
    rest = m % group
    if m > group and 0 < rest < p:
        try:
            simulate(sched, Setting(p, m, chunks=v))
        except Deadlock:
            ok = sorted({(m // group) * group, (m // group) * group + p})
            raise ScheduleError(
                f"interleaved-1f1b: {m} microbatches leave a last group of {rest} (< pipeline size {p}) after "
                f"groups of {group}, and Megatron's interleaved order then deadlocks (Megatron refuses such "
                f"counts); use a multiple of {group} or at least {p} in the last group, e.g. "
                f"{' or '.join(map(str, ok))} microbatches") from None
    return sched
