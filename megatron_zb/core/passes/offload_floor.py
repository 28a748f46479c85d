"""A bound under activation offload (``core.passes.offload``'s policy): per rank, the least peak
activation any offload of a schedule could reach, from what its parts' lifespans and the host link
allow. Plan leaves out a lever's variant this bound says cannot fit (``core.plan.row``); the
offload search stops looking where it cannot beat what it has (``core.passes.offload_search``).
Pure Python, no torch."""
from __future__ import annotations

from typing import List, Optional

from ..ir import F, Schedule, Setting
from ..sim.hostlink import OffloadOptions, durations, setting_for, strip_offload, transfer_times
from ..sim.simulate import simulate
from .offload import timed_candidates, timed_units

__all__ = ["offload_floor"]


def offload_floor(schedule: Schedule, setting: Setting, opts: OffloadOptions, base_result=None) \
        -> Optional[List[float]]:
    """Per rank, a peak activation no offload of ``schedule`` by ``opts`` goes below (None where it
    is not bounded here: overlapped pairs, a part that travels in no time). The policy's schedules
    keep the passes' times (``_settle`` keeps no part a pass would wait for), and a part is off the
    device from the end of its D2H to the start of its reload: at a pass's own memory event (an F's
    start, another pass's end, at time t) only candidates made by an earlier pass of the rank and
    needed by a later one can be away, and the link bounds how much of them: their D2H copies run
    one after another between their makers' ends and t, their reloads one after another between t
    and their passes' starts (per direction, whatever the duplex). ``base_result``: ``schedule``'s
    simulation, if at hand."""
    stripped = strip_offload(schedule)
    if stripped is not schedule:
        base_result = None
    schedule = stripped
    if schedule.flat() is not schedule:
        return None
    st = setting_for(schedule, setting)
    T = transfer_times(schedule, st, opts)
    base = base_result if base_result is not None else simulate(schedule, st)
    units = timed_units(schedule, st, base)
    out = []
    for r, cs in enumerate(timed_candidates(schedule, st, opts, T, units)):
        tl, u = base.timeline[r], units[r]
        if len(u.items) != len(tl):
            return None
        parts = []  # (first pass it may be away at, last, ready, due, duration, amount)
        for c in cs:
            d = durations(st, T, r, c.stage)[c.part]
            if d <= 0:
                return None
            parts.append((u.src[c.key][0] + 1, u.dst[c.key][0] - 1, u.src[c.key][1], u.dst[c.key][1], d, c.amount))
        level, floor = 0.0, 0.0
        for i, t in enumerate(tl):
            delta = st.pass_mem(t.action.kind, r, t.action.stage)
            level += delta
            if delta <= 0:
                continue
            now = t.start if t.action.kind == F else t.end
            here = [x for x in parts if x[0] <= i <= x[1]]
            away = sum(x[5] for x in here)
            if here:
                rate = max(x[5] / x[4] for x in here) * (1 + 1e-9)
                slack = 1e-6 * max(1.0, abs(now))
                before = 0.0  # D2H: those made from ``ready`` on are copied out in [ready, now]
                for x in sorted(here, key=lambda x: x[2]):
                    away = min(away, before + rate * max(0.0, now - x[2] + slack))
                    before += x[5]
                after = 0.0  # reloads: those due by ``due`` come back in [now, due]
                for x in sorted(here, key=lambda x: -x[3]):
                    away = min(away, after + rate * max(0.0, x[3] - now + slack))
                    after += x[5]
            floor = max(floor, level - away)
        out.append(floor)
    return out
