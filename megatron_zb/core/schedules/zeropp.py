"""ZeroPP (Tang et al., "ZeroPP: Unleashing Exceptional Parallelism Efficiency through
Tensor-Parallelism-Free Methodology" / "Adaptive Blockwise Task-interleaved Pipeline
Parallelism", 2024): interleaved pipeline parallelism in *scheduling units*, with the backward
split into B (input gradient) and W (weight gradient), paired with sharded data parallelism.

Placement: Megatron's looped one, v chunks per rank (``--chunks``, default 2), stage s on rank
s % p. A scheduling unit is a block of U consecutive microbatches; inside a unit every chunk runs
the whole block before the next chunk (forwards in chunk order, backwards in reverse chunk order),
units follow each other (the last one may be shorter). Blockwise, a chunk's weights are touched
once per unit, which is what lets the paper gather sharded (FSDP) weights once per unit.

Within that order every rank runs a warm-up of (v-1)·U + p-1-r (+ e) forwards, then one F, one B
(input gradient) and, once it holds more than r un-run W's, the W of its oldest B, and finally the
remaining B's and W's: the F, B and W tasks of consecutive units interleave, rank r keeping r W's
in reserve to fill the cool-down (ZB-H1's stagger). The scheduling unit is adaptive: every U in
{p, 2p, 4p, ...} (U = m when m <= p) and every extra warm-up e in {0, 1, 2, p/2, p-1} whose schedule fits the
memory limit is simulated with the real costs, and the shortest wins (then the smaller peak, the
smaller unit). Default limit: 1F1B's peak (p x mem-f), where U = p and e = 0 give the order of
``interleaved-zb`` (torch's ZB1P) when p divides m; a larger limit buys larger units (fewer weight
gathers in the paper's FSDP setting) and fuller warm-ups, which absorb communication and unequal
costs. A unit order whose strict alternation would deadlock is skipped.

With Megatron the sharded-data-parallel side is Megatron's distributed optimizer (ZeRO-1: optimizer
states sharded, gradients reduce-scattered, parameters all-gathered after the step); ZeroPP's
per-unit gathering of FSDP-sharded weights (ZeRO-3) is not reproduced (docs/schedules.md).
"""
from __future__ import annotations

import dataclasses
from collections import deque
from typing import List, Optional

from ..ir import Action, B, F, Placement, Schedule, ScheduleError, Setting, W
from ..sim.simulate import makespan_and_peak


def unit_table(m: int, v: int, unit: int):
    """(mb, chunk) in forward order: unit after unit, chunk after chunk, microbatch after microbatch."""
    table = []
    for first in range(0, m, unit):
        last = min(m, first + unit)
        table += [(mb, c) for c in range(v) for mb in range(first, last)]
    return table


def zeropp_with_unit(setting: Setting, unit: int, extra: int = 0) -> Schedule:
    """The ZeroPP order for one scheduling unit size and extra warm-up (no memory check)."""
    p, m, v = setting.stages, setting.microbatches, setting.chunks
    table = unit_table(m, v, unit)
    total = len(table)
    orders = []
    for r in range(p):
        warm = min((v - 1) * min(unit, m) + (p - 1 - r) + extra, total)
        order, pending = [], deque()
        for k in range(total + warm):
            if k < total:
                mb, c = table[k]
                order.append(Action(F, c * p + r, mb))
            if k >= warm:
                mb, c = table[k - warm]
                s = (v - 1 - c) * p + r
                order.append(Action(B, s, mb))
                pending.append((s, mb))
                if len(pending) > r:
                    order.append(Action(W, *pending.popleft()))
        order += [Action(W, s, mb) for s, mb in pending]
        orders.append(order)
    return Schedule("zeropp", Placement.looped(p, v), m, orders, {"unit": unit, "extra_warmup": extra})


def zeropp(setting: Setting) -> Schedule:
    p, m, v = setting.stages, setting.microbatches, setting.chunks
    if v is None or v < 2:
        raise ScheduleError("zeropp needs --chunks >= 2 (model chunks per rank); with one chunk use zb-h1 or zb-auto")
    # default: 1F1B's peak, P whole-stage activations of the fullest rank
    limit = (p * setting.stage_peak_unit(Placement.looped(p, v)) if setting.memory_limit is None
             else float(setting.memory_limit))
    st = dataclasses.replace(setting, memory_limit=None)
    units: List[int] = [m] if m <= p else [p << i for i in range(m.bit_length()) if p << i <= m]
    best: Optional[Schedule] = None
    key = None
    least = None
    for unit in units:
        for extra in sorted({0, 1, 2, p // 2, p - 1} & set(range(p))):
            s = zeropp_with_unit(st, unit, extra)
            try:
                makespan, peak = makespan_and_peak(s, st)  # simulate's, without its timeline
            except ScheduleError:  # this unit's strict alternation deadlocks
                continue
            least = peak if least is None else min(least, peak)
            if peak > limit + 1e-9:
                continue
            k = (round(makespan, 9), round(peak, 9), unit, extra)
            if key is None or k < key:
                best, key = s, k
    if best is None:
        raise ScheduleError(f"zeropp: memory limit {limit:g} is below what its smallest scheduling unit needs "
                            f"({least:g} x mem-f)" if least is not None else
                            f"zeropp: no scheduling unit runs {m} microbatches on {p} ranks without deadlock")
    best.meta["memory_claim"] = limit
    return best
