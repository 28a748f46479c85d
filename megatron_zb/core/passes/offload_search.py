"""Searched schedules with activation offload under a memory limit: which schedule to offload.

``generate_with_offload`` with a ratio (or a schedule that is not searched) generates the schedule
and offloads it (``offload.add_offload``). With ``ratio=None`` (as little as fits
``opts.memory_limit``), zb-auto and v-auto try as the schedule to offload:

1. **Their own search under larger limits** (``bases``): 2 p x mem-f (twice 1F1B's peak, where
   they reach zero bubble), then 1.75, 1.5, 1.25 and 1 times 1F1B's peak, twice the limit and the
   limit itself, from the largest down. A schedule under a larger limit is faster but has more to
   offload, and whether the host link carries it in time depends on details: so the limits are
   tried in turn, not just the extremes.
2. **What a neighbouring setting found** (``retarget``): the same schedules built for 3p, 4p and 5p
   microbatches, cut or stretched to this one's count. Their steady state is periodic, so the
   middle microbatches are dropped (or the middle one repeated, one period apart) and the
   warm-up and cool-down kept: the schedule (and its offload) that worked at M = 32 is among the
   candidates at M = 24 and M = 64. So the search is monotone in what it tries: a neighbouring
   microbatch count's block is always a candidate.

Each candidate is offloaded back under the limit (aiming 2.5% and 6.25% lower where the link's
real timing leaves a rank a little over); the fastest that fits wins (ties: the one that
offloads less). The search stops early once a candidate that fits is within ``TIE`` (0.1%) of the
fastest schedule without a limit (the one at 2 p x mem-f): nothing after it could be faster.
Deterministic (no clocks): every rank computes the same schedule.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from .. import schedules
from ..ir import Action, Placement, Schedule, ScheduleError, Setting
from ..schedules.search.auto import TIE, zb_auto
from ..schedules.search.vsearch import v_auto
from ..sim.hostlink import EPS, OffloadOptions, has_offload, setting_for
from ..sim.simulate import SimResult, simulate
from .offload import add_offload, offload_simulated
from .offload_floor import offload_floor

__all__ = ["generate_with_offload", "retarget"]

#: base limits, in units of 1F1B's peak (p x mem-f), from the largest down
LADDER = (2.0, 1.75, 1.5, 1.25, 1.0)
#: neighbouring microbatch counts whose schedules are candidates, in units of p
NEIGHBOURS = (4, 3, 5)
#: where offloading under the limit leaves a rank a little over (the link's queueing), offload
#: again under these shares of it
AIMS = (1.0, 0.975, 0.9375)


def _search(name: str, setting: Setting, limit: float) -> Tuple[Schedule, Optional[SimResult]]:
    """The fastest searched schedule ``name`` under ``limit`` (memory not a tie-break: no smaller
    limits, no slower schedule for a lower peak; memory is what offload is for), and its
    simulation where the search made one."""
    st = dataclasses.replace(setting, memory_limit=limit)
    sim: List[SimResult] = []
    if name == "zb-auto":
        return zb_auto(st, memory=False, sim=sim), (sim[0] if sim else None)
    if name == "v-auto":
        return v_auto(st, memory=False, sim=sim), (sim[0] if sim else None)
    return schedules.generate(name, st), None


def retarget(schedule: Schedule, setting: Setting, m: int, result: Optional[SimResult] = None) -> Schedule:
    """``schedule`` (for ``schedule.num_microbatches`` microbatches, timed with ``setting``'s
    costs) for ``m`` microbatches: the first microbatches keep their times, the last ones keep
    theirs shifted by (m - its count) periods, and (when m is larger) the middle one is repeated
    one period apart; each rank runs its passes in that time order. The period is the mean gap
    between the first stage's forwards over the middle half. Offload actions are dropped.
    ``result``: ``schedule``'s simulation with ``setting``'s costs, if at hand (used where it holds
    no offload)."""
    src = schedule.compute_only().flat()
    ms = src.num_microbatches
    st = dataclasses.replace(setting_for(src, setting), microbatches=ms)
    offloaded = has_offload(schedule) or schedule.meta.get("offload") is not None
    res = result if result is not None and not offloaded else simulate(src, st)
    start: Dict[Tuple[str, int, int], float] = {}
    pos: Dict[Tuple[str, int, int], int] = {}
    for tl in res.timeline:
        for i, t in enumerate(tl):
            k = (t.action.kind, t.action.stage, t.action.mb)
            start[k], pos[k] = t.start, i
    first = sorted(v for (kind, s, _), v in start.items() if s == 0 and kind == "F")
    lo, hi = ms // 4, max(ms // 4 + 1, 3 * ms // 4)
    period = (first[hi] - first[lo]) / (hi - lo) if hi < len(first) else 0.0
    head = min(ms // 2, m // 2)
    tail = min(ms - head, m - head)

    def source(y: int) -> Tuple[int, float]:
        if y < head:
            return y, 0.0
        if y >= m - tail:
            return y - (m - ms), (m - ms) * period
        return head - 1, (y - head + 1) * period

    orders = []
    for r, o in enumerate(src.orders):
        keyed = []
        for y in range(m):
            sy, shift = source(y)
            for a in o:
                if a.is_compute and a.mb == sy:
                    k = (a.kind, a.stage, sy)
                    keyed.append((round(start[k] + shift, 9), y, pos[k], Action(a.kind, a.stage, y)))
        keyed.sort(key=lambda x: x[:3])
        orders.append([x[3] for x in keyed])
    meta = {k: v for k, v in schedule.meta.items() if k != "offload"}
    return Schedule(schedule.name, schedule.placement, m, orders, dict(meta, retargeted_from=ms))


def _offloaded(base: Schedule, setting: Setting, opts: OffloadOptions,
               base_result=None) -> Optional[Tuple[tuple, Schedule]]:
    """``base`` offloaded under ``opts.memory_limit``, with its (makespan, parts offloaded); None
    where it does not fit (or does not run). ``base_result``: ``base``'s simulation, if at hand."""
    limit = opts.memory_limit
    try:
        st = setting_for(base, setting)
        if base_result is None:
            base_result = simulate(base, st)
        if max(base_result.peak_memory) <= limit + EPS:
            cand = dataclasses.replace(base, meta=dict(base.meta, offload=opts.to_meta()))
            res = simulate(cand, st)
        elif max(offload_floor(base, st, opts, base_result) or [0.0]) > limit + EPS + 1e-9 * max(1.0, limit):
            return None  # no selection of its parts brings it under the limit (``offload_floor``)
        else:
            # the link's real timing may leave a rank a little over: aim a little lower
            for aim in AIMS:
                # its simulation is the offloaded schedule's (the limit aimed at in its meta
                # changes no timing; the meta then records the real one)
                cand, res = offload_simulated(base, st, dataclasses.replace(opts, memory_limit=aim * limit),
                                              base_result)
                cand = dataclasses.replace(cand, meta=dict(cand.meta, offload=opts.to_meta()))
                if max(res.peak_memory) <= limit + EPS or max(res.peak_memory) > 1.1 * limit:
                    break
    except ScheduleError:
        return None
    if max(res.peak_memory) > limit + EPS:
        return None
    n = sum(res.offload.offloaded) + sum(res.offload.offloaded_w) if res.offload is not None else 0
    return (round(res.makespan, 9), n), cand


def generate_with_offload(name: str, setting: Setting, opts: OffloadOptions) -> Schedule:
    """Generate schedule ``name`` and offload by ``opts`` (see the module docstring)."""
    if opts.ratio is not None or not schedules.get(name).searched:
        return add_offload(schedules.generate(name, setting), setting, opts)
    limit = opts.memory_limit
    p, m = setting.stages, setting.microbatches
    spec = schedules.get(name)
    st = dataclasses.replace(setting, chunks=spec.resolve_chunks(setting.chunks))
    one = p * st.stage_peak_unit(Placement.vshape(p) if spec.placement == "v" else Placement.single(p))
    top = 2 * one
    lims = sorted({round(x, 9) for x in [f * one for f in LADDER] + [2 * limit, limit]
                   if limit - EPS <= x <= top + EPS}, reverse=True)
    best: Optional[Tuple[tuple, Schedule]] = None
    fastest: List[float] = []  # makespan of the schedule under the largest limit, without offload

    def consider(base: Schedule, base_result=None) -> bool:
        """Offload ``base``; True once the best is within TIE of ``fastest`` (stop)."""
        nonlocal best
        got = _offloaded(base, setting, opts, base_result)
        if got is not None and (best is None or got[0] < best[0]):
            best = got
        return best is not None and bool(fastest) and best[0][0] <= fastest[0] * (1 + TIE) + EPS

    for lim in lims:
        try:
            base, res = _search(name, setting, lim)
        except ScheduleError:
            continue  # nothing under this limit: a larger one may still offload under the real one
        if res is None:
            res = simulate(base, setting_for(base, setting))
        if not fastest:
            fastest.append(res.makespan)
        if consider(base, res):
            return best[1]
    for k in NEIGHBOURS:
        ms = k * p
        if ms == m:
            continue
        for f in LADDER[:3]:
            try:
                src, res = _search(name, dataclasses.replace(setting, microbatches=ms), f * one)
                base = retarget(src, setting, m, res)
            except ScheduleError:
                continue
            if consider(base):
                return best[1]
    if best is None:
        raise ScheduleError(f"{name}: no schedule fits memory limit {limit:g}, even with activation offload "
                            f"(offload time {opts.time})")
    return best[1]
