"""Schedules searched under a memory limit: zb-auto (one stage per rank) and the V family.

zb-auto: the best of the greedy variants (``greedy.py``), the hand-crafted ZB-H1/ZB-H2/1F1B that
fit the limit, then a local search from the best (``improve.py``). Default limit p x mem-f
(1F1B's peak, where it matches ZB-H1's bubble or beats it); with 2p it reaches zero bubble at
equal costs. An infeasible limit is an error stating the least memory that works.

V family (rank r holds stages r and 2p-1-r, so embedding and loss both live on rank 0):

* zb-v: greedy under 1F1B's peak (p x mem-f), zero bubble at equal costs when m >= 2p.
* v-half / v-min: the building blocks of "Pipeline Parallelism with Controllable Memory": one
  microbatch's F (chunk 0), f (chunk 1), B (chunk 1) and b (chunk 0) at fixed slot offsets
  per rank, repeated every 6 slots (the other two slots are for the W's, each placed in the first
  free slot after its B); the slot order is then squeezed with the real costs by the simulator.
  V-Half offsets (2i, 3p-i-2, 3p+d+2i-1, 6p+d-i-2), d = 3 for even p; V-Min offsets (i, 2p-i-1,
  2p+d+i, 4p+d-i-1), d = 2 when 3 | p. The greedy under the same peak memory is tried too, and
  the local search tightens warm-up and cool-down without raising the peak.
* v-auto: given a memory limit, the best of all of the above that fits.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, List, Optional

from ..ir import B, F, W, Action, Placement, Schedule, ScheduleError, Setting
from ..simulate import simulate
from .greedy import best_of
from .improve import improve, lower_bound


def _budget(setting: Setting) -> float:
    n = setting.stages * setting.microbatches * (setting.chunks or 1)
    return 1.0 if n <= 256 else (0.3 if n <= 2048 else 0.0)


def _finish(best: Schedule, setting: Setting, limit: Optional[float], name: str, claim) -> Schedule:
    if _budget(setting) > 0:
        best = improve(best, setting, limit, budget_s=_budget(setting))
    res = simulate(best, setting)
    lb = lower_bound(setting, best.placement, limit)
    meta = dict(best.meta, memory_limit=limit, memory_claim=claim, lower_bound=round(lb, 9),
                gap_to_lower_bound=round(res.makespan / lb - 1.0, 6) if lb > 0 else 0.0)
    return dataclasses.replace(best, name=name, meta=meta)


def _pick(cands: List[Schedule], setting: Setting, limit: Optional[float]) -> Optional[Schedule]:
    best, key = None, None
    for s in cands:
        res = simulate(s, setting)
        if limit is not None and max(res.peak_memory) > limit + 1e-9:
            continue
        k = (round(res.makespan, 9), round(max(res.peak_memory), 9))
        if key is None or k < key:
            best, key = s, k
    return best


def _search(name: str, st: Setting, pl: Placement, limit: float, cands: List[Schedule], lo: float,
            hi: float) -> Schedule:
    """The best of ``cands`` and the greedy variants under ``limit``; an infeasible limit is an
    error naming the least memory that works (searched between lo and hi)."""
    try:
        cands = cands + [best_of(st, pl, limit, name)]
    except ScheduleError:
        pass
    best = _pick(cands, st, limit)
    if best is None:
        need = _least_memory(lambda x: best_of(st, pl, x, name), lo, hi)
        raise ScheduleError(f"{name}: no schedule fits memory limit {limit:g}; the least that works is about "
                            f"{need:g} (units of mem-f)")
    return best


def _least_memory(fn: Callable[[float], Schedule], lo: float, hi: float) -> float:
    for x in [lo + (hi - lo) * i / 8 for i in range(1, 9)]:
        try:
            fn(x)
            return x
        except ScheduleError:
            pass
    return hi


def zb_auto(setting: Setting) -> Schedule:
    from .basic import one_f_one_b
    from .zb_handcrafted import zb_h1, zb_h2
    p, m = setting.stages, setting.microbatches
    limit = setting.memory_limit if setting.memory_limit is not None else p * max(setting.mem_f)
    pl = Placement.single(p)
    st = dataclasses.replace(setting, chunks=1)
    cands = [f(st) for f in (zb_h1, zb_h2, one_f_one_b)]
    best = _search("zb-auto", st, pl, limit, cands, max(setting.mem_f), 2 * p * max(setting.mem_f))
    return _finish(best, st, limit, "zb-auto", limit)


def _v_setting(setting: Setting) -> Setting:
    return dataclasses.replace(setting, chunks=2)


def zb_v(setting: Setting) -> Schedule:
    st = _v_setting(setting)
    p = st.stages
    limit = p * max(st.mem_f)
    best = best_of(st, Placement.vshape(p), limit, "zb-v")
    return _finish(best, st, limit, "zb-v", limit)


def block_schedule(p: int, m: int, offsets: Callable[[int], List[int]], name: str) -> Schedule:
    """Repeat one microbatch's building block every 6 slots; W's go to the first free slot."""
    orders = []
    for i in range(p):
        used, events = set(), []
        for k in range(m):
            for off, kind, stage in zip(offsets(i), (F, F, B, B), (i, 2 * p - 1 - i, 2 * p - 1 - i, i)):
                t = off + 6 * k
                if t in used:
                    raise ScheduleError(f"{name}: building block collides on rank {i} (slot {t})")
                used.add(t)
                events.append((t, kind, stage, k))
        for t, kind, stage, k in sorted(events):
            if kind == B:
                u = t + 1
                while u in used:
                    u += 1
                used.add(u)
                events.append((u, W, stage, k))
        orders.append([Action(kind, stage, k) for _, kind, stage, k in sorted(events)])
    return Schedule(name, Placement.vshape(p), m, orders)


def v_half_offsets(p: int):
    d = 3 if p % 2 == 0 else 0
    return lambda i: [2 * i, 3 * p - i - 2, 3 * p + d + 2 * i - 1, 6 * p + d - i - 2]


def v_min_offsets(p: int):
    d = 2 if p % 3 == 0 else 0
    return lambda i: [i, 2 * p - i - 1, 2 * p + d + i, 4 * p + d - i - 1]


def _v_block(setting: Setting, offsets, name: str) -> Schedule:
    st = _v_setting(setting)
    p, m = st.stages, st.microbatches
    block = block_schedule(p, m, offsets(p), name)
    limit = max(simulate(block, st).peak_memory)
    cands = [block]
    try:
        cands.append(best_of(st, Placement.vshape(p), limit, name))
    except ScheduleError:
        pass
    best = _pick(cands, st, limit)
    return _finish(best, st, limit, name, limit)


def v_half(setting: Setting) -> Schedule:
    return _v_block(setting, v_half_offsets, "v-half")


def v_min(setting: Setting) -> Schedule:
    return _v_block(setting, v_min_offsets, "v-min")


def v_auto(setting: Setting) -> Schedule:
    st = _v_setting(setting)
    p, m = st.stages, st.microbatches
    limit = setting.memory_limit if setting.memory_limit is not None else p * max(st.mem_f)
    pl = Placement.vshape(p)
    cands = [block_schedule(p, m, off(p), "v-auto") for off in (v_half_offsets, v_min_offsets)]
    best = _search("v-auto", st, pl, limit, cands, max(st.mem_f) / 2, p * max(st.mem_f))
    return _finish(best, st, limit, "v-auto", limit)
