"""Activation offload (PipeOffload) policy: which activations go to host memory and where the
OFFLOAD and RELOAD actions sit in each rank's list. Pure Python, no torch. It sits above the
generators (it simulates the schedule without offload to find what has time to travel) and below
``core.build``; what the options mean, the host link and the check are the model in
``core.sim.hostlink``.

Policy (selective offload, longest lifespan first): the lifespan of a part is the time from the
end of the pass that produced it to the start of the pass that needs it, in the schedule without
offload. Only parts whose lifespan leaves room for both copies and some time on the host are
candidates. Selection sweeps each rank's timeline and, wherever the activation is over a level,
offloads the part on the device whose next use is furthest away (Belady's rule, i.e. the longest
remaining lifespan first). ``memory_limit`` (ratio None): as few parts as keep each rank under
the limit. ``ratio`` R: at most R x (its F passes) activations and R x (its W passes) W parts per
rank, chosen to bring the level lowest; where the host link is the bottleneck (large K) the
queue delays copies and offloading everything can keep more memory than offloading less, so each
rank keeps the selection its simulation says is lowest (R is an upper bound). A RELOAD
goes at the latest point from which its copy still ends before the pass that needs it; where the
link's queue would make that pass wait anyway, the reload moves earlier (and a part that cannot be
back in time without waiting stays on the device). Deterministic: every rank computes the same
placement.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..ir import BW, OFFLOAD_KINDS, OVERLAP, Action, B, F, Schedule, Setting, W
from ..sim.hostlink import (EPS, PAIR_OF, PART_OF, HostLinks, OffloadOptions, amounts, durations, setting_for,
                            strip_offload, transfer_times)
from ..sim.simulate import simulate

__all__ = ["add_offload", "offload_simulated", "candidates", "Candidate", "timed_units", "timed_candidates"]


@dataclass(frozen=True)
class Candidate:
    rank: int
    part: str  # 'B': the activation, F -> B; 'W': what W needs, B -> W
    stage: int
    mb: int
    lifespan: float  # start of the pass that needs it - end of the pass that made it, without offload
    amount: float  # mem-f units

    @property
    def key(self) -> Tuple[str, int, int]:
        return (self.part, self.stage, self.mb)


@dataclass
class _Units:
    """One rank's order as units (a pass or an overlapped pair) with their simulated times; per
    part key (part, stage, mb): the unit that makes it and its end, the unit that needs it and
    its start."""
    items: List[Action]
    end: List[float]
    src: Dict[Tuple[str, int, int], Tuple[int, float]] = field(default_factory=dict)
    dst: Dict[Tuple[str, int, int], Tuple[int, float]] = field(default_factory=dict)
    forwards: int = 0
    weights: int = 0


def timed_units(schedule: Schedule, setting: Setting, res=None) -> List[_Units]:
    """Per rank, its order as units with their simulated times and where each part is made and
    needed (``_Units``). ``res``: the schedule's simulation with ``setting``, if at hand."""
    if res is None:
        res = simulate(schedule, setting)
    out = []
    for r, order in enumerate(schedule.orders):
        tl = res.timeline[r]
        items = [a for a in order if a.is_compute]
        u = _Units(items, [])
        j = 0
        for ui, a in enumerate(items):
            parts = a.parts if a.kind == OVERLAP else (a,)
            times = tl[j:j + len(parts)]
            j += len(parts)
            u.end.append(times[-1].end)
            for p, t in zip(parts, times):
                if p.kind == F:
                    u.src[("B", p.stage, p.mb)] = (ui, t.end)
                    u.forwards += 1
                elif p.kind in (B, BW):
                    u.dst[("B", p.stage, p.mb)] = (ui, t.start)
                    if p.kind == B:
                        u.src[("W", p.stage, p.mb)] = (ui, t.end)
                elif p.kind == W:  # (vocabulary passes keep what they hold: nothing of theirs travels)
                    u.dst[("W", p.stage, p.mb)] = (ui, t.start)
                    u.weights += 1
        out.append(u)
    return out


def _reload_gap(u: _Units, key, T: float, latest_issue: Optional[float] = None) -> Optional[int]:
    """The unit index the reload goes before: the latest one whose preceding unit ends early enough
    for the copy (``T``) to end before the pass that needs the part (and no later than
    ``latest_issue``), while the part still spends some time on the host. None if there is none."""
    su, s_end = u.src[key]
    du, d_start = u.dst[key]
    limit = d_start - T + EPS
    if latest_issue is not None:
        limit = min(limit, latest_issue + EPS)
    on_host = s_end + T  # D2H done (on a free link)
    g = du
    while g > su + 1:
        issue = u.end[g - 1]
        if issue <= limit:
            return g if issue > on_host + EPS else None
        g -= 1
    return None


def candidates(schedule: Schedule, setting: Setting, opts: OffloadOptions) -> List[List[Candidate]]:
    """Per rank, the parts that have time to travel, longest lifespan first (activations before
    W parts at equal lifespans)."""
    schedule = strip_offload(schedule)
    st = setting_for(schedule, setting)
    T = transfer_times(schedule, st, opts)
    return timed_candidates(schedule, st, opts, T, timed_units(schedule, st))


def timed_candidates(schedule, st, opts, T, units) -> List[List[Candidate]]:
    """``candidates`` from the schedule's ``timed_units`` and transfer times ``T`` at hand."""
    pl = schedule.placement
    out = []
    for r, u in enumerate(units):
        cands = []
        for key in u.src:
            part, s, mb = key
            amt = amounts(st, r, s)[part]
            if key not in u.dst or amt <= 0 or (part == "W" and not opts.w_parts):
                continue
            if opts.chunks is not None and pl.chunk_of(s) >= opts.chunks:
                continue
            if _reload_gap(u, key, durations(st, T, r, s)[part]) is None:
                continue
            cands.append(Candidate(r, part, s, mb, u.dst[key][1] - u.src[key][1], amt))
        cands.sort(key=lambda c: (-round(c.lifespan, 9), c.part, c.stage, c.mb))
        out.append(cands)
    return out


def _place(schedule: Schedule, units: List[_Units], chosen: List[Dict[tuple, int]], meta: dict) -> Schedule:
    """Insert each chosen part's offload after the unit that made it and its reload before unit
    ``chosen[r][key]``."""
    orders = []
    for r, u in enumerate(units):
        after: Dict[int, List[Action]] = {}
        before: Dict[int, List[Action]] = {}
        for key in sorted(chosen[r], key=lambda k: (u.src[k][0], k)):
            after.setdefault(u.src[key][0], []).append(Action(PAIR_OF[key[0]][0], key[1], key[2]))
        for key in sorted(chosen[r], key=lambda k: (u.dst[k][1], k)):
            before.setdefault(chosen[r][key], []).append(Action(PAIR_OF[key[0]][1], key[1], key[2]))
        out = []
        for i, a in enumerate(u.items):
            out += before.get(i, [])
            out.append(a)
            out += after.get(i, [])
        orders.append(out)
    return dataclasses.replace(schedule, orders=orders, meta=dict(schedule.meta, offload=meta))


def _settle(schedule: Schedule, st: Setting, units: List[_Units], chosen, T: List[float], meta: dict, base,
            max_rounds: int = 12):
    """Place the chosen parts; where a pass would wait for its reload, issue that reload earlier
    (by the wait), or keep the part on the device when no earlier point leaves it any time on the
    host. Returns (schedule, simulation result). ``base``: ``schedule``'s own simulation.

    A placement where no pass waits for a reload runs every pass at its time in ``base`` (copies
    only ever delay a pass), so the rounds check each rank's link against ``base``'s times
    (``_waits``: no simulation of the pipeline); one simulation of the settled schedule gives the
    result, and should a pass still wait there, the rounds go on with simulations."""
    chosen = [dict(c) for c in chosen]
    for check in (lambda sched: _waits(sched, st, base), lambda sched: _stalled(simulate(sched, st))):
        sched = _rounds(schedule, st, units, chosen, T, meta, max_rounds, check)
        res = simulate(sched, st)
        if not _stalled(res):
            return sched, res
    raise AssertionError("unreachable: the simulated rounds end with no pass waiting")


def _rounds(schedule: Schedule, st: Setting, units: List[_Units], chosen: List[Dict[tuple, int]], T, meta: dict,
            max_rounds: int, check) -> Schedule:
    """``_settle``'s rounds on ``chosen`` (in place), ``check(placed schedule)`` giving the parts
    passes wait for, {(part, stage, mb): wait}: the reloads that wait issued earlier by the wait,
    then what still waits after ``max_rounds`` kept on the device. Returns the placed schedule."""
    for _ in range(max_rounds):
        stalled = check(_place(schedule, units, chosen, meta))
        if not stalled:
            break
        for r, u in enumerate(units):
            for key in [k for k in chosen[r] if k in stalled]:
                g = chosen[r][key]
                g2 = _reload_gap(u, key, durations(st, T, r, key[1])[key[0]], latest_issue=u.end[g - 1] - stalled[key])
                if g2 is None or g2 >= g:
                    g2 = g - 1 if g - 1 > u.src[key][0] + 1 else None
                if g2 is None:
                    del chosen[r][key]
                else:
                    chosen[r][key] = g2
    while True:
        sched = _place(schedule, units, chosen, meta)
        stalled = check(sched)
        if not stalled:
            return sched
        for r in range(len(chosen)):
            for key in [k for k in chosen[r] if k in stalled]:
                del chosen[r][key]


def _stalled(res) -> Dict[tuple, float]:
    """The parts passes of a simulation waited for, {(part, stage, mb): wait}."""
    return res.offload.stalled if res.offload is not None else {}


def _waits(sched: Schedule, st: Setting, base) -> Dict[tuple, float]:
    """The parts a pass of ``sched`` would wait for, {(part, stage, mb): wait}, with every pass at
    its time in ``base`` (the simulation of ``sched`` without its copies): each rank's copies issued
    and gated as ``simulate`` does, on ``base``'s times."""
    flat = sched.flat()
    links = HostLinks(flat, st)
    for r, order in enumerate(flat.orders):
        tl, i, clock = base.timeline[r], 0, 0.0
        for a in order:
            if a.kind in OFFLOAD_KINDS:
                links.issue(r, a, clock)
            elif a.is_compute:
                t = tl[i]
                i += 1
                if a.kind in (B, BW, W):
                    links.gate(r, a, t.start)
                clock = t.end
    return links.stalled


def _base_events(st: Setting, r: int, units: _Units, timeline) -> List[tuple]:
    """(time, group, seq, delta) of one rank's passes, sorted as ``HostLinks.peak`` sorts them."""
    ev = [(t.start if t.action.kind == F else t.end, 1, i, st.pass_mem(t.action.kind, r, t.action.stage))
          for i, t in enumerate(timeline)]
    ev.sort(key=lambda e: e[:3])
    return ev


def _evict(events: List[tuple], cands: List[Candidate], window: Dict[tuple, Tuple[float, float]],
           limit: float) -> List[Candidate]:
    """Pick parts to offload so that one rank's activation stays under ``limit`` at every moment,
    in the nominal timing (no queueing on the link): sweep time; wherever the level is over the
    limit, offload the part on the device there whose next use is furthest away (Belady's rule:
    the longest remaining lifespan first), until the level fits or nothing more can go.

    The sweep's times never fall (a reload start comes after the moment it is chosen at), so the
    parts that may go are kept in a heap (furthest next use first) as their windows open, and
    what is offloaded at a moment is counted with two Fenwick trees (by window start, by end)."""
    import bisect
    import heapq
    times = [e[0] for e in events]
    prefix, cur = [], 0.0
    for e in events:
        cur += e[3]
        prefix.append(cur)
    chosen: List[Candidate] = []
    starts = sorted({window[c.key][0] for c in cands})
    ends = sorted({window[c.key][1] for c in cands})
    tree_s, tree_e = [0.0] * (len(starts) + 1), [0.0] * (len(ends) + 1)

    def add(tree, i, x):
        i += 1
        while i < len(tree):
            tree[i] += x
            i += i & -i

    def upto(tree, n):  # sum of the first n entries
        out = 0.0
        while n > 0:
            out += tree[n]
            n -= n & -n
        return out

    by_start = sorted(cands, key=lambda c: (window[c.key][0], -c.lifespan - window[c.key][1], c.part, c.stage, c.mb))
    nxt = 0
    ready: List[tuple] = []  # (-end, -lifespan, stage, mb, index in by_start)
    # check points: every allocation of the base, and the reload start of every chosen part
    heap = [(e[0], e[1], e[2], idx) for idx, e in enumerate(events) if e[3] > 0]
    heapq.heapify(heap)

    def level(t, group, idx):
        on = upto(tree_s, bisect.bisect_right(starts, t + EPS))
        if group == 1:
            base = prefix[idx]
            out = on - upto(tree_e, bisect.bisect_left(ends, t - EPS))
        else:  # a reload start at t: every base event up to t has happened
            k = bisect.bisect_right(times, t + EPS)
            base = prefix[k - 1] if k else 0.0
            out = on - upto(tree_e, bisect.bisect_right(ends, t + EPS))
        return base - out

    while heap:
        t, group, _, idx = heapq.heappop(heap)
        while nxt < len(by_start) and window[by_start[nxt].key][0] <= t + EPS:
            c = by_start[nxt]
            heapq.heappush(ready, (-window[c.key][1], -c.lifespan, c.stage, c.mb, nxt))
            nxt += 1
        held = []
        while level(t, group, idx) > limit + EPS:
            pick = None
            while ready:
                item = heapq.heappop(ready)
                end = -item[0]
                if end + EPS < t:
                    continue  # gone for good: later moments are later still
                if group == 2 and not t < end - EPS:
                    held.append(item)  # not at a reload start at t, maybe at a later pass at t
                    continue
                pick = by_start[item[4]]
                break
            if pick is None:
                break
            chosen.append(pick)
            w = window[pick.key]
            add(tree_s, bisect.bisect_left(starts, w[0]), pick.amount)
            add(tree_e, bisect.bisect_left(ends, w[1]), pick.amount)
            heapq.heappush(heap, (w[1], 2, len(chosen), -1))
        for item in held:
            heapq.heappush(ready, item)
    return chosen


def _queued(res) -> bool:
    """Whether any copy of a simulation waited for its queue (not just for its own D2H)."""
    if res.offload is None:
        return False
    for tl in res.offload.transfers:
        done = {}
        for t in tl:
            ready = max(t.issue, done.get((PART_OF[t.action.kind], t.action.stage, t.action.mb), t.issue))
            if t.start > ready + EPS:
                return True
            done[(PART_OF[t.action.kind], t.action.stage, t.action.mb)] = t.end
    return False


def add_offload(schedule: Schedule, setting: Setting, opts: OffloadOptions) -> Schedule:
    """``schedule`` with offload actions for the parts ``opts`` selects (see the module docstring).

    ``meta['offload']`` records the options (the simulator reads K and the link mode there). With
    ratio 0, or when nothing has time to travel, the schedule has no offload actions but keeps the
    meta (so a report can say so)."""
    return offload_simulated(schedule, setting, opts)[0]


def offload_simulated(schedule: Schedule, setting: Setting, opts: OffloadOptions, base_result=None):
    """``add_offload``, and the simulation of what it returns (with ``setting``): (schedule,
    result). ``base_result``: ``schedule``'s own simulation with ``setting``, if at hand (used only
    where ``schedule`` holds no offload, as it is then what the policy simulates)."""
    stripped = strip_offload(schedule)
    if stripped is not schedule:
        base_result = None
    schedule = stripped
    st = setting_for(schedule, setting)
    T = transfer_times(schedule, st, opts)
    base = base_result if base_result is not None else simulate(schedule, st)
    units = timed_units(schedule, st, base)
    cands = timed_candidates(schedule, st, opts, T, units)
    meta = opts.to_meta()
    pl = schedule.placement
    events = [_base_events(st, r, units[r], base.timeline[r]) for r in range(st.stages)]
    gaps, window = [], []
    for r, cs in enumerate(cands):
        dur = {c.key: durations(st, T, r, c.stage)[c.part] for c in cs}
        g = {c.key: _reload_gap(units[r], c.key, dur[c.key]) for c in cs}
        gaps.append(g)
        # nominal time on the host: from the end of the D2H to the issue of the reload
        window.append({c.key: (units[r].src[c.key][1] + dur[c.key], units[r].end[g[c.key] - 1]) for c in cs})

    def settle(picked: List[List[Candidate]]):
        return _settle(schedule, st, units, [{c.key: gaps[r][c.key] for c in cs} for r, cs in enumerate(picked)],
                       T, meta, base)

    def by_ratio(ratio: float):
        # per rank and part: R x n parts (and, as fallbacks, 3/4, 1/2 and 1/4 of that), chosen to
        # bring the nominal level lowest and topped up with the longest-lived; where the link is
        # the bottleneck the queue delays the copies and offloading everything may keep more
        # memory than offloading less: R is an upper bound and each rank keeps the option its
        # simulation says is lowest (ties: the one that offloads more)
        fractions = (1.0, 0.75, 0.5, 0.25)
        options = [[[] for _ in fractions] for _ in units]
        for r, u in enumerate(units):
            for part in ("B", "W"):
                n = sum(1 for k in u.src if k[0] == part and k in u.dst
                        and (opts.chunks is None or pl.chunk_of(k[1]) < opts.chunks))
                pool = [c for c in cands[r] if c.part == part]
                top = max(base.peak_memory[r], 0.0)
                for j, frac in enumerate(fractions):
                    want = int(math.floor(frac * ratio * n + 0.5))
                    if want >= len(pool):  # every candidate: no level to search
                        options[r][j] += pool
                        continue
                    lo, hi, got = 0.0, top, _evict(events[r], pool, window[r], top)
                    for _ in range(40):  # the lowest level reachable with `want` parts
                        mid = (lo + hi) / 2
                        sel = _evict(events[r], pool, window[r], mid)
                        if len(sel) <= want:
                            hi, got = mid, sel
                        else:
                            lo = mid
                        if hi - lo < 1e-3 * max(1.0, hi):
                            break
                    keys = {c.key for c in got}
                    options[r][j] += got + [c for c in pool if c.key not in keys][:max(0, want - len(got))]
        levels = len(fractions) - 1
        best, seen = None, set()
        for j in range(levels + 1):
            sig = tuple(frozenset(c.key for c in options[r][j]) for r in range(len(units)))
            if sig in seen:
                continue
            seen.add(sig)
            sched, res = settle([options[r][j] for r in range(len(units))])
            if j == 0 and not _queued(res):
                return sched, res  # no copy waited for the link: the nominal choice is the real one
            for r in range(len(units)):
                key = (round(res.peak_memory[r], 9), j)
                if best is None:
                    best = [None] * len(units)
                if best[r] is None or key < best[r][0]:
                    best[r] = (key, j)
        return settle([options[r][best[r][1]] for r in range(len(units))])

    if opts.ratio is not None:
        return by_ratio(opts.ratio)
    # as few parts as needed under the memory limit; where the real link timing (queueing, earlier
    # reloads) still leaves a rank over, aim lower on that rank and try again
    limit = opts.memory_limit
    target = [limit] * st.stages
    best = None
    for _ in range(4):
        picked = [_evict(events[r], cands[r], window[r], target[r]) for r in range(st.stages)]
        sched, res = settle(picked)
        over = [res.peak_memory[r] - limit for r in range(st.stages)]
        if best is None or max(over) < best[0] - EPS:
            best = (max(over), sched, res)
        elif all(x <= EPS for x in over) or max(over) >= best[0] - EPS:
            break  # no better by aiming lower: the link cannot carry more in time
        if all(x <= EPS for x in over):
            break
        for r in range(st.stages):
            if over[r] > EPS:
                target[r] = max(0.0, target[r] - over[r])
    sched, res = best[1], best[2]
    if best[0] > EPS:
        # the fewest parts did not come under the limit (the link could not carry them in time):
        # a rank still over takes the selection of ratio 1 (all its link carries; the lowest of
        # its options) where that is lower. Each settled rank runs its passes at their base times,
        # so the ranks' selections combine as they are
        whole, wres = by_ratio(1.0)
        take = [res.peak_memory[r] > limit + EPS and wres.peak_memory[r] < res.peak_memory[r] - EPS
                for r in range(st.stages)]
        if any(take):
            sched = dataclasses.replace(sched, orders=[w if t else o for w, o, t in
                                                       zip(whole.orders, sched.orders, take)])
            res = simulate(sched, st)
    return sched, res
