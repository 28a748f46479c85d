"""ZeroPP (Tang et al., "ZeroPP: Unleashing Exceptional Parallelism Efficiency through
Tensor-Parallelism-Free Methodology" / "Adaptive Blockwise Task-interleaved Pipeline
Parallelism", 2024): interleaved pipeline parallelism in *scheduling units*, with the backward
split into B (input gradient) and W (weight gradient), paired with sharded data parallelism.

Placement: Megatron's looped one, v chunks per rank (``--chunks``, default 2), stage s on rank
s % p. A scheduling unit is a block of U consecutive microbatches; inside a unit every chunk runs
the whole block before the next chunk (forwards in chunk order, backwards in reverse chunk order),
units follow each other (the last one may be shorter). Blockwise, a chunk's weights are touched
once per unit, which is what lets the paper gather sharded (FSDP) weights once per unit.

The F, B and W tasks are staggered by the list scheduler (``listsched``) with the real costs: B as
soon as its gradient arrives, F while the rank's activations fit under the memory limit, W where
the rank would otherwise wait (or when memory blocks a forward). The unit size is adaptive: every
U in {p, 2p, 3p, ...} (U = m when m <= p) whose first unit fits the limit is tried, and the
shortest schedule wins (then the smaller peak). Default limit: 1F1B's peak (p x mem-f), where U = p
and the schedule behaves like an interleaved ZB-H1; a larger limit buys larger units (fewer weight
gathers in the paper's FSDP setting) and a fuller warm-up.

With Megatron the sharded-data-parallel side is Megatron's distributed optimizer (ZeRO-1: optimizer
states sharded, gradients reduce-scattered, parameters all-gathered after the step); ZeroPP's
per-unit gathering of FSDP-sharded weights (ZeRO-3) is not reproduced (docs/schedules.md).
"""
from __future__ import annotations

from typing import List, Optional

from ..ir import Placement, Schedule, ScheduleError, Setting
from ..simulate import simulate
from . import listsched


def unit_table(m: int, v: int, unit: int):
    """(mb, chunk) in forward order: unit after unit, chunk after chunk, microbatch after microbatch."""
    table = []
    for first in range(0, m, unit):
        last = min(m, first + unit)
        table += [(mb, c) for c in range(v) for mb in range(first, last)]
    return table


def zeropp_with_unit(setting: Setting, unit: int, limit: float) -> Schedule:
    p, m, v = setting.stages, setting.microbatches, setting.chunks
    pl = Placement.looped(p, v)
    table = unit_table(m, v, unit)
    f_seq = [[(c * p + r, mb) for mb, c in table] for r in range(p)]
    b_seq = [[((v - 1 - c) * p + r, mb) for mb, c in table] for r in range(p)]
    plan = listsched.Plan(f_seq, b_seq, [limit] * p, split=True, fill="fit")
    return listsched.run("zeropp", setting, pl, plan, m, {"unit": unit, "memory_claim": limit})


def zeropp(setting: Setting) -> Schedule:
    p, m, v = setting.stages, setting.microbatches, setting.chunks
    if v is None or v < 2:
        raise ScheduleError("zeropp needs --chunks >= 2 (model chunks per rank); with one chunk use zb-h1 or zb-auto")
    limit = float(p) if setting.memory_limit is None else float(setting.memory_limit)
    fmax = max(setting.mem_f) / v
    units: List[int] = [m] if m <= p else list(range(p, m + 1, p))
    best: Optional[Schedule] = None
    key = None
    least = None
    for unit in units:
        need = ((v - 1) * min(unit, m) + 1) * fmax  # the first backward needs the unit's deepest forward
        least = need if least is None else min(least, need)
        if need > limit + 1e-9:
            continue
        try:
            s = zeropp_with_unit(setting, unit, limit)
        except ScheduleError:
            continue
        res = simulate(s, setting)
        k = (round(res.makespan, 9), round(max(res.peak_memory), 9), unit)
        if key is None or k < key:
            best, key = s, k
    if best is None:
        raise ScheduleError(f"zeropp: memory limit {limit:g} is below what the smallest scheduling unit needs "
                            f"({least:g} x mem-f: the deepest chunk's forward of the first unit must fit before "
                            "the first backward)")
    return best
