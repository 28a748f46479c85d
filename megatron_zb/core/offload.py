"""Activation offload (PipeOffload) in the schedule core: which activations go to host memory,
where the OFFLOAD and RELOAD actions sit in each rank's list, and the host link the simulator
times them on. Pure Python, no torch.

The model (docs/offload.md has it with the figures):

* **What moves.** Two parts per (stage, mb), each as a whole or not at all:
  the **activation** one F pass keeps for its backward (``mem-f`` / chunks of the rank), from
  after its F to before its B (OFFLOAD ... RELOAD); and, with a split backward, the part **W**
  still needs after B (``mem-w`` / chunks: the inputs and output gradients of the deferred
  weight-gradient GEMMs in the W queue), from after its B to before its W (OFFLOAD_W ...
  RELOAD_W). A fused BW has no second part.
* **Transfer time.** One way, one microbatch's stage activation takes ``T = K x (F + B)`` of
  that stage (K is ``--offload-time``, the ZB authors' meaning; with V chunks per rank F and B are
  the chunk's pass costs); the W part takes T x mem-w / mem-f (time in proportion to bytes).
* **When.** An OFFLOAD sits right after its pass (F, or B for the W part): the device-to-host
  copy (D2H) starts when that pass has ended and the rank's host link is free. A RELOAD sits
  before a later compute pass and is issued when the pass before it ends; the host-to-device copy
  (H2D) starts when the link is free and the D2H of the same part is done. The B (for a W part:
  the W) waits for the end of its reload: a late reload stalls the pass.
* **Host link.** One per rank, its own resource: transfers overlap compute and do not slow it
  (copies and compute are assumed not to compete for memory bandwidth). By default it is full
  duplex, as PCIe is: D2H and H2D have one first-in first-out queue each (two copy streams; the
  fork's ``--offload-overlap-sr``). With ``overlap=False`` (half duplex, one copy stream, the
  fork's default) both directions share one queue in issue order.
* **Memory.** An offloaded part leaves the rank's count when its D2H ends and comes back when its
  H2D starts; B and W free what they free without offload (B: mem-f - mem-w, W: mem-w).

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
from typing import Dict, List, Optional, Sequence, Tuple, Union

from .ir import (B, BW, F, OFFLOAD, OFFLOAD_KINDS, OFFLOAD_W, OVERLAP, RELOAD, RELOAD_W, W, Action, Schedule,
                 ScheduleError, Setting)

__all__ = ["OffloadOptions", "add_offload", "strip_offload", "has_offload", "offloaded_keys", "check_offload",
           "transfer_times", "candidates", "generate_with_offload", "HostLinks", "Transfer", "OffloadResult",
           "Candidate", "SEARCHED_SCHEDULES", "PART_OF"]

EPS = 1e-9
#: schedules searched under a memory limit: with offload they may also take a schedule that needs
#: more memory than the limit and offload it back under
SEARCHED_SCHEDULES = ("zb-auto", "v-auto")
#: the part an offload action moves: 'B' = the activation for the backward, 'W' = what W needs
PART_OF = {OFFLOAD: "B", RELOAD: "B", OFFLOAD_W: "W", RELOAD_W: "W"}
_KINDS = {"B": (OFFLOAD, RELOAD), "W": (OFFLOAD_W, RELOAD_W)}


@dataclass(frozen=True)
class OffloadOptions:
    """``ratio`` (0..1) or, with ``ratio=None``, ``memory_limit``: as little as needed under it."""

    ratio: Optional[float] = None
    time: Union[float, Sequence[float]] = 1.0  # K; one value or one per rank
    overlap: bool = True  # D2H and H2D on separate queues (full duplex); False: one shared queue
    memory_limit: Optional[float] = None  # per rank, units of mem-f
    chunks: Optional[int] = None  # only the first N chunks of each rank (the fork's --offload-chunk-num)
    w_parts: bool = True  # also offload what W needs between B and W (split backward)

    def __post_init__(self):
        if self.ratio is not None and not (_number(self.ratio) and 0.0 <= self.ratio <= 1.0):
            raise ScheduleError(f"offload ratio must be a number in 0..1, got {self.ratio!r}")
        times = list(self.time) if isinstance(self.time, (list, tuple)) else [self.time]
        if not times or any(not (_number(k) and k >= 0) for k in times):
            raise ScheduleError(f"offload time must be non-negative numbers, got {self.time!r}")
        if self.ratio is None and self.memory_limit is None:
            raise ScheduleError("offload needs a ratio (0..1) or a memory limit to offload under")
        if self.memory_limit is not None and not (_number(self.memory_limit) and self.memory_limit >= 0):
            raise ScheduleError(f"memory limit must be a non-negative number, got {self.memory_limit!r}")
        if self.chunks is not None and (not isinstance(self.chunks, int) or isinstance(self.chunks, bool)
                                        or self.chunks < 1):
            raise ScheduleError(f"offload chunk count must be an integer >= 1, got {self.chunks!r}")

    def time_of(self, rank: int, ranks: int) -> float:
        if isinstance(self.time, (list, tuple)):
            if len(self.time) == 1:
                return float(self.time[0])
            if len(self.time) != ranks:
                raise ScheduleError(f"offload time has {len(self.time)} values; give one or one per stage ({ranks})")
            return float(self.time[rank])
        return float(self.time)

    def to_meta(self) -> dict:
        return {"ratio": self.ratio, "time": list(self.time) if isinstance(self.time, (list, tuple)) else self.time,
                "overlap": self.overlap, "memory_limit": self.memory_limit, "chunks": self.chunks,
                "w_parts": self.w_parts}


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and x != float("inf")


# ---------------------------------------------------------------------------------------------
# helpers over schedules


def has_offload(schedule: Schedule) -> bool:
    return any(a.kind in OFFLOAD_KINDS for o in schedule.orders for a in o)


def strip_offload(schedule: Schedule) -> Schedule:
    """The schedule without its offload actions (and without its offload meta)."""
    if not has_offload(schedule) and "offload" not in schedule.meta:
        return schedule
    meta = {k: v for k, v in schedule.meta.items() if k != "offload"}
    return dataclasses.replace(schedule, orders=[[a for a in o if a.kind not in OFFLOAD_KINDS]
                                                 for o in schedule.orders], meta=meta)


def offloaded_keys(actions: Sequence[Action], kind: str = OFFLOAD) -> set:
    """(stage, mb) of every action of ``kind`` (OFFLOAD or OFFLOAD_W) in one rank's list."""
    return {(a.stage, a.mb) for a in actions if a.kind == kind}


def _setting_for(schedule: Schedule, setting: Setting) -> Setting:
    if setting.chunks != schedule.placement.chunks:
        setting = dataclasses.replace(setting, chunks=schedule.placement.chunks)
    return setting


def transfer_times(schedule: Schedule, setting: Setting, time) -> List[float]:
    """One-way time of one (stage, mb) activation on each rank: K x (F + B) of a chunk."""
    st = _setting_for(schedule, setting)
    p = st.stages
    opts = time if isinstance(time, OffloadOptions) else OffloadOptions(ratio=0.0, time=time)
    return [opts.time_of(r, p) * (st.pass_cost(F, r) + st.pass_cost(B, r)) for r in range(p)]


def _amounts(st: Setting, r: int) -> Dict[str, float]:
    return {"B": st.pass_mem(F, r), "W": -st.pass_mem(W, r)}


def check_offload(schedule: Schedule) -> None:
    """Each OFFLOAD follows its F (OFFLOAD_W its B) on the rank holding the stage; each offloaded
    part has one RELOAD (RELOAD_W) after its offload and before the pass that needs it. Raises
    ScheduleError naming the rank and position."""
    pl = schedule.placement
    for r, order in enumerate(schedule.flat().orders):
        done = set()
        off: Dict[Tuple[str, int, int], int] = {}
        back: Dict[Tuple[str, int, int], int] = {}
        for i, a in enumerate(order):
            if a.is_compute:
                need = {B: "B", BW: "B", W: "W"}.get(a.kind)
                k = (need, a.stage, a.mb)
                if need and k in off and k not in back:
                    what = "activation" if need == "B" else "weight-gradient input"
                    raise ScheduleError(f"rank {r} position {i}: {a} runs while its {what} is offloaded (no "
                                        f"{_KINDS[need][1]}{a.stage}.{a.mb} before it)")
                done.add((a.kind, a.stage, a.mb))
                continue
            if a.kind not in OFFLOAD_KINDS:
                continue
            part = PART_OF[a.kind]
            k = (part, a.stage, a.mb)
            if not (0 <= a.stage < pl.num_stages) or pl.rank_of(a.stage) != r:
                raise ScheduleError(f"rank {r} position {i}: {a} names stage {a.stage}, which rank {r} does not hold")
            src, dst = ((F,), (B, BW)) if part == "B" else ((B,), (W,))
            if a.kind in (OFFLOAD, OFFLOAD_W):
                if not any((x, a.stage, a.mb) in done for x in src):
                    raise ScheduleError(f"rank {r} position {i}: {a} comes before {src[0]}{a.stage}.{a.mb}")
                if any((x, a.stage, a.mb) in done for x in dst):
                    raise ScheduleError(f"rank {r} position {i}: {a} comes after {dst[0]}{a.stage}.{a.mb}")
                if k in off:
                    raise ScheduleError(f"rank {r} position {i}: {a} appears twice")
                off[k] = i
            else:
                if k not in off:
                    raise ScheduleError(f"rank {r} position {i}: {a} has no {_KINDS[part][0]}{a.stage}.{a.mb} "
                                        "before it")
                if k in back:
                    raise ScheduleError(f"rank {r} position {i}: {a} appears twice")
                back[k] = i
        missing = sorted(set(off) - set(back))
        if missing:
            part, s, mb = missing[0]
            raise ScheduleError(f"rank {r}: {_KINDS[part][0]}{s}.{mb} is never brought back (no "
                                f"{_KINDS[part][1]}{s}.{mb})")


# ---------------------------------------------------------------------------------------------
# the host link (used by core.simulate)


@dataclass
class Transfer:
    action: Action  # OFFLOAD/OFFLOAD_W (D2H) or RELOAD/RELOAD_W (H2D)
    rank: int
    issue: float  # when the rank reached the action
    start: float
    end: float
    amount: float  # activation moved (mem-f units)


@dataclass
class OffloadResult:
    """What the simulator adds for a schedule with offload actions."""

    options: dict
    transfers: List[List[Transfer]]
    stalls: List[float]  # per rank: total time passes waited for a reload
    peak_without_offload: List[float]
    offloaded: List[int]  # activations (F parts) offloaded per rank
    offloaded_w: List[int]  # W parts offloaded per rank
    forwards: List[int]  # F passes per rank
    transfer_time: List[float]  # one-way time of one activation per rank
    stalled: Dict[Tuple[str, int, int], float] = field(default_factory=dict)  # (part, stage, mb) -> wait

    def to_dict(self) -> dict:
        return {**self.options,
                "transfer_time": [_r(x) for x in self.transfer_time],
                "offloaded": list(self.offloaded),
                "offloaded_w": list(self.offloaded_w),
                "offloaded_share": [_r(o / f) if f else 0.0 for o, f in zip(self.offloaded, self.forwards)],
                "stall": [_r(x) for x in self.stalls],
                "link_busy": [_r(sum(t.end - t.start for t in tl)) for tl in self.transfers],
                "link_busy_d2h": [_r(sum(t.end - t.start for t in tl if t.action.kind in (OFFLOAD, OFFLOAD_W)))
                                  for tl in self.transfers],
                "link_busy_h2d": [_r(sum(t.end - t.start for t in tl if t.action.kind in (RELOAD, RELOAD_W)))
                                  for tl in self.transfers],
                "peak_memory_without_offload": [_r(x) for x in self.peak_without_offload]}


def _r(x: float) -> float:
    return round(float(x), 10)


class HostLinks:
    """Per-rank host links for one simulation: transfers queue in issue order."""

    def __init__(self, schedule: Schedule, setting: Setting):
        meta = schedule.meta.get("offload") or {}
        self.setting = _setting_for(schedule, setting)
        self.overlap = bool(meta.get("overlap", True))
        time = meta.get("time", 1.0)
        self.options = {k: meta.get(k) for k in ("ratio", "time", "overlap", "memory_limit", "chunks")}
        self.options["time"] = time
        p = self.setting.stages
        self.T = transfer_times(schedule, self.setting, time)
        self.amount = [_amounts(self.setting, r) for r in range(p)]
        self.free = [[0.0, 0.0] for _ in range(p)]  # [D2H queue, H2D queue] (one queue unless overlap)
        self.off_end: Dict[Tuple[str, int, int], float] = {}
        self.back_end: Dict[Tuple[str, int, int], float] = {}
        self.transfers: List[List[Transfer]] = [[] for _ in range(p)]
        self.stalls = [0.0] * p
        self.stalled: Dict[Tuple[str, int, int], float] = {}

    def duration(self, r: int, part: str) -> float:
        full = self.amount[r]["B"]
        return self.T[r] * (self.amount[r][part] / full if full > 0 else 0.0)

    def issue(self, r: int, a: Action, t: float) -> None:
        part = PART_OF[a.kind]
        key = (part, a.stage, a.mb)
        back = a.kind in (RELOAD, RELOAD_W)
        lane = 1 if (back and self.overlap) else 0
        start = max(t, self.free[r][lane])
        if back:
            if key not in self.off_end:
                raise ScheduleError(f"rank {r}: {a} before {_KINDS[part][0]}{a.stage}.{a.mb}")
            start = max(start, self.off_end[key])
        end = start + self.duration(r, part)
        self.free[r][lane] = end
        (self.back_end if back else self.off_end)[key] = end
        self.transfers[r].append(Transfer(a, r, t, start, end, self.amount[r][part]))

    def gate(self, r: int, a: Action, ready: float) -> float:
        """When compute pass ``a`` may start, given it could start at ``ready`` otherwise."""
        part = {B: "B", BW: "B", W: "W"}.get(a.kind)
        if part is None:
            return ready
        key = (part, a.stage, a.mb)
        end = self.back_end.get(key)
        if end is None:
            if key in self.off_end:
                raise ScheduleError(f"rank {r}: {a} runs while what it needs is offloaded (no "
                                    f"{_KINDS[part][1]}{a.stage}.{a.mb})")
            return ready
        if end > ready + EPS:
            self.stalls[r] += end - ready
            self.stalled[key] = end - ready
            return end
        return ready

    def peak(self, r: int, timeline) -> float:
        """Peak activation of rank r: compute passes as in the order-based count, offloaded parts
        out from the end of their D2H to the start of their H2D."""
        st = self.setting
        ev = []  # (time, group, seq, delta): at equal times offload ends, then passes in order, then reloads
        for i, t in enumerate(timeline):
            k = t.action.kind
            ev.append((t.start if k == F else t.end, 1, i, st.pass_mem(k, r)))
        for tr in self.transfers[r]:
            if tr.action.kind in (OFFLOAD, OFFLOAD_W):
                ev.append((tr.end, 0, 0, -tr.amount))
            else:
                ev.append((tr.start, 2, 0, tr.amount))
        ev.sort(key=lambda e: e[:3])
        cur, peak = 0.0, 0.0
        for _, _, _, d in ev:
            cur += d
            peak = max(peak, cur)
        return peak

    def result(self, peak_without: List[float], forwards: List[int]) -> OffloadResult:
        off = [sum(1 for t in tl if t.action.kind == OFFLOAD) for tl in self.transfers]
        off_w = [sum(1 for t in tl if t.action.kind == OFFLOAD_W) for tl in self.transfers]
        return OffloadResult(self.options, self.transfers, self.stalls, peak_without, off, off_w, forwards, self.T,
                             dict(self.stalled))


# ---------------------------------------------------------------------------------------------
# policy and placement


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


def _units(schedule: Schedule, setting: Setting) -> List[_Units]:
    from .simulate import simulate
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
                else:
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


def _durations(st: Setting, T: List[float], r: int) -> Dict[str, float]:
    a = _amounts(st, r)
    return {p: (T[r] * a[p] / a["B"] if a["B"] > 0 else 0.0) for p in a}


def candidates(schedule: Schedule, setting: Setting, opts: OffloadOptions) -> List[List[Candidate]]:
    """Per rank, the parts that have time to travel, longest lifespan first (activations before
    W parts at equal lifespans)."""
    schedule = strip_offload(schedule)
    st = _setting_for(schedule, setting)
    T = transfer_times(schedule, st, opts)
    return _candidates(schedule, st, opts, T, _units(schedule, st))


def _candidates(schedule, st, opts, T, units) -> List[List[Candidate]]:
    pl = schedule.placement
    out = []
    for r, u in enumerate(units):
        dur = _durations(st, T, r)
        amt = _amounts(st, r)
        cands = []
        for key in u.src:
            part, s, mb = key
            if key not in u.dst or amt[part] <= 0 or (part == "W" and not opts.w_parts):
                continue
            if opts.chunks is not None and pl.chunk_of(s) >= opts.chunks:
                continue
            if _reload_gap(u, key, dur[part]) is None:
                continue
            cands.append(Candidate(r, part, s, mb, u.dst[key][1] - u.src[key][1], amt[part]))
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
            after.setdefault(u.src[key][0], []).append(Action(_KINDS[key[0]][0], key[1], key[2]))
        for key in sorted(chosen[r], key=lambda k: (u.dst[k][1], k)):
            before.setdefault(chosen[r][key], []).append(Action(_KINDS[key[0]][1], key[1], key[2]))
        out = []
        for i, a in enumerate(u.items):
            out += before.get(i, [])
            out.append(a)
            out += after.get(i, [])
        orders.append(out)
    return dataclasses.replace(schedule, orders=orders, meta=dict(schedule.meta, offload=meta))


def _settle(schedule: Schedule, st: Setting, units: List[_Units], chosen, T: List[float], meta: dict,
            max_rounds: int = 12):
    """Place the chosen parts; where a pass would wait for its reload, issue that reload earlier
    (by the wait), or keep the part on the device when no earlier point leaves it any time on the
    host. Returns (schedule, simulation result)."""
    from .simulate import simulate
    chosen = [dict(c) for c in chosen]
    for _ in range(max_rounds):
        sched = _place(schedule, units, chosen, meta)
        res = simulate(sched, st)
        stalled = res.offload.stalled if res.offload is not None else {}
        if not stalled:
            return sched, res
        for r, u in enumerate(units):
            dur = _durations(st, T, r)
            for key in [k for k in chosen[r] if k in stalled]:
                g = chosen[r][key]
                g2 = _reload_gap(u, key, dur[key[0]], latest_issue=u.end[g - 1] - stalled[key])
                if g2 is None or g2 >= g:
                    g2 = g - 1 if g - 1 > u.src[key][0] + 1 else None
                if g2 is None:
                    del chosen[r][key]
                else:
                    chosen[r][key] = g2
    # what still stalls after that many rounds stays on the device
    while True:
        sched = _place(schedule, units, chosen, meta)
        res = simulate(sched, st)
        stalled = res.offload.stalled if res.offload is not None else {}
        if not stalled:
            return sched, res
        for r in range(len(chosen)):
            for key in [k for k in chosen[r] if k in stalled]:
                del chosen[r][key]


def _base_events(st: Setting, r: int, units: _Units, timeline) -> List[tuple]:
    """(time, group, seq, delta) of one rank's passes, sorted as ``HostLinks.peak`` sorts them."""
    ev = [(t.start if t.action.kind == F else t.end, 1, i, st.pass_mem(t.action.kind, r))
          for i, t in enumerate(timeline)]
    ev.sort(key=lambda e: e[:3])
    return ev


def _evict(events: List[tuple], cands: List[Candidate], window: Dict[tuple, Tuple[float, float]],
           limit: float) -> List[Candidate]:
    """Pick parts to offload so that one rank's activation stays under ``limit`` at every moment,
    in the nominal timing (no queueing on the link): sweep time; wherever the level is over the
    limit, offload the part on the device there whose next use is furthest away (Belady's rule:
    the longest remaining lifespan first), until the level fits or nothing more can go."""
    import bisect
    import heapq
    times = [e[0] for e in events]
    prefix, cur = [], 0.0
    for e in events:
        cur += e[3]
        prefix.append(cur)
    chosen: List[Candidate] = []
    free = sorted(cands, key=lambda c: (-c.lifespan - window[c.key][1], c.part, c.stage, c.mb))
    # check points: every allocation of the base, and the reload start of every chosen part
    heap = [(e[0], e[1], e[2], idx) for idx, e in enumerate(events) if e[3] > 0]
    heapq.heapify(heap)

    def level(t, group, idx):
        if group == 1:
            base = prefix[idx]
            out = sum(c.amount for c in chosen if window[c.key][0] <= t + EPS and t <= window[c.key][1] + EPS)
        else:  # a reload start at t: every base event up to t has happened
            k = bisect.bisect_right(times, t + EPS)
            base = prefix[k - 1] if k else 0.0
            out = sum(c.amount for c in chosen if window[c.key][0] <= t + EPS and t < window[c.key][1] - EPS)
        return base - out

    while heap:
        t, group, _, idx = heapq.heappop(heap)
        while level(t, group, idx) > limit + EPS:
            fits = [c for c in free if window[c.key][0] <= t + EPS and
                    (t <= window[c.key][1] + EPS if group == 1 else t < window[c.key][1] - EPS)]
            if not fits:
                break
            c = max(fits, key=lambda c: (window[c.key][1], c.lifespan, -c.stage, -c.mb))
            free.remove(c)
            chosen.append(c)
            heapq.heappush(heap, (window[c.key][1], 2, len(chosen), -1))
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
    from .simulate import simulate
    schedule = strip_offload(schedule)
    st = _setting_for(schedule, setting)
    T = transfer_times(schedule, st, opts)
    units = _units(schedule, st)
    cands = _candidates(schedule, st, opts, T, units)
    meta = opts.to_meta()
    pl = schedule.placement
    base = simulate(schedule, st)
    events = [_base_events(st, r, units[r], base.timeline[r]) for r in range(st.stages)]
    gaps, window = [], []
    for r, cs in enumerate(cands):
        dur = _durations(st, T, r)
        g = {c.key: _reload_gap(units[r], c.key, dur[c.part]) for c in cs}
        gaps.append(g)
        # nominal time on the host: from the end of the D2H to the issue of the reload
        window.append({c.key: (units[r].src[c.key][1] + dur[c.part], units[r].end[g[c.key] - 1]) for c in cs})

    def settle(picked: List[List[Candidate]]):
        return _settle(schedule, st, units, [{c.key: gaps[r][c.key] for c in cs} for r, cs in enumerate(picked)],
                       T, meta)

    if opts.ratio is not None:
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
                    want = int(math.floor(frac * opts.ratio * n + 0.5))
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
                return sched  # no copy waited for the link: the nominal choice is the real one
            for r in range(len(units)):
                key = (round(res.peak_memory[r], 9), j)
                if best is None:
                    best = [None] * len(units)
                if best[r] is None or key < best[r][0]:
                    best[r] = (key, j)
        sched, _ = settle([options[r][best[r][1]] for r in range(len(units))])
        return sched
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
            best = (max(over), sched)
        elif all(x <= EPS for x in over) or max(over) >= best[0] - EPS:
            break  # no better by aiming lower: the link cannot carry more in time
        if all(x <= EPS for x in over):
            break
        for r in range(st.stages):
            if over[r] > EPS:
                target[r] = max(0.0, target[r] - over[r])
    return best[1]


def generate_with_offload(name: str, setting: Setting, opts: OffloadOptions) -> Schedule:
    """Generate schedule ``name`` and offload by ``opts``.

    With ``opts.ratio`` None (as little as needed under ``opts.memory_limit``), ``zb-auto`` and
    ``v-auto`` also take the schedules they build under larger limits, offloaded back under the
    limit, and keep the fastest that fits (ties: the one that offloads less)."""
    from . import schedules
    from .simulate import simulate
    if opts.ratio is not None or name not in SEARCHED_SCHEDULES:
        sched = schedules.generate(name, setting)
        return add_offload(sched, setting, opts)
    limit = opts.memory_limit
    p = setting.stages
    top = 2 * p * max(setting.mem_f)
    limits = [limit] + [x for x in (2 * limit, top) if limit + EPS < x <= top + EPS]
    best, key = None, None
    for lim in sorted(set(round(x, 9) for x in limits)):
        try:
            base = schedules.generate(name, dataclasses.replace(setting, memory_limit=lim))
        except ScheduleError:
            continue  # nothing under this limit: a larger one may still offload under the real one
        st = _setting_for(base, setting)
        if max(simulate(base, st).peak_memory) <= limit + EPS:
            cand = dataclasses.replace(base, meta=dict(base.meta, offload=opts.to_meta()))
        else:
            cand = add_offload(base, st, opts)
        res = simulate(cand, st)
        if max(res.peak_memory) > limit + EPS:
            continue
        n = sum(res.offload.offloaded) + sum(res.offload.offloaded_w) if res.offload is not None else 0
        k = (round(res.makespan, 9), n)
        if key is None or k < key:
            best, key = cand, k
    if best is None:
        raise ScheduleError(f"{name}: no schedule fits memory limit {limit:g}, even with activation offload "
                            f"(offload time {opts.time})")
    return best
