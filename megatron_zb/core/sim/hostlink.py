"""The activation-offload model (PipeOffload) below the simulator: what offload options mean, the
host link each rank moves activations on (``HostLinks``, which ``core.sim.simulate`` times transfers
on), what a simulation with offload reports, and the check that a schedule's OFFLOAD/RELOAD
actions are well placed (``core.sim.validate``). Pure Python, no torch. The policy that chooses what to
offload and places the actions sits above the generators, in ``core.passes.offload``.

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
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..ir import (BW, OFFLOAD, OFFLOAD_KINDS, OFFLOAD_W, RELOAD, RELOAD_W, Action, B, F, Schedule, ScheduleError,
                  Setting, W)

__all__ = ["OffloadOptions", "strip_offload", "has_offload", "offloaded_keys", "check_offload", "transfer_times", "durations",
           "setting_for", "amounts", "HostLinks", "Transfer", "OffloadResult", "PART_OF", "PAIR_OF", "EPS"]

EPS = 1e-9
#: the part an offload action moves: 'B' = the activation for the backward, 'W' = what W needs
PART_OF = {OFFLOAD: "B", RELOAD: "B", OFFLOAD_W: "W", RELOAD_W: "W"}
#: the (offload, reload) action kinds of each part
PAIR_OF = {"B": (OFFLOAD, RELOAD), "W": (OFFLOAD_W, RELOAD_W)}


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


def setting_for(schedule: Schedule, setting: Setting) -> Setting:
    if setting.chunks != schedule.placement.chunks:
        setting = dataclasses.replace(setting, chunks=schedule.placement.chunks)
    return setting


def transfer_times(schedule: Schedule, setting: Setting, time) -> List[Dict[int, float]]:
    """Per rank, {stage: one-way time of one (stage, mb) activation}: K x (F + B) of that chunk."""
    st = setting_for(schedule, setting)
    p = st.stages
    pl = schedule.placement
    opts = time if isinstance(time, OffloadOptions) else OffloadOptions(ratio=0.0, time=time)
    return [{s: opts.time_of(r, p) * (st.pass_cost(F, r, s) + st.pass_cost(B, r, s)) for s in pl.stages_of(r)}
            for r in range(p)]


def amounts(st: Setting, r: int, stage: Optional[int] = None) -> Dict[str, float]:
    """What an offload of stage ``stage`` on rank ``r`` moves: the activation F keeps ('B') and the
    part W still needs after B ('W'), in mem-f units."""
    return {"B": st.pass_mem(F, r, stage), "W": -st.pass_mem(W, r, stage)}


def durations(st: Setting, T: List[Dict[int, float]], r: int, stage: int) -> Dict[str, float]:
    """One-way time of each part ('B', 'W') of stage ``stage`` on rank ``r``."""
    a = amounts(st, r, stage)
    return {part: (T[r][stage] * a[part] / a["B"] if a["B"] > 0 else 0.0) for part in a}


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
                                        f"{PAIR_OF[need][1]}{a.stage}.{a.mb} before it)")
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
                    raise ScheduleError(f"rank {r} position {i}: {a} has no {PAIR_OF[part][0]}{a.stage}.{a.mb} "
                                        "before it")
                if k in back:
                    raise ScheduleError(f"rank {r} position {i}: {a} appears twice")
                back[k] = i
        missing = sorted(set(off) - set(back))
        if missing:
            part, s, mb = missing[0]
            raise ScheduleError(f"rank {r}: {PAIR_OF[part][0]}{s}.{mb} is never brought back (no "
                                f"{PAIR_OF[part][1]}{s}.{mb})")


# ---------------------------------------------------------------------------------------------
# the host link (used by core.sim.simulate)


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
    transfer_time: List[float]  # one-way time of one activation per rank (its largest chunk's)
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
        self.setting = setting_for(schedule, setting)
        self.overlap = bool(meta.get("overlap", True))
        time = meta.get("time", 1.0)
        self.options = {k: meta.get(k) for k in ("ratio", "time", "overlap", "memory_limit", "chunks")}
        self.options["time"] = time
        p = self.setting.stages
        self.T = transfer_times(schedule, self.setting, time)
        self.free = [[0.0, 0.0] for _ in range(p)]  # [D2H queue, H2D queue] (one queue unless overlap)
        self.off_end: Dict[Tuple[str, int, int], float] = {}
        self.back_end: Dict[Tuple[str, int, int], float] = {}
        self.transfers: List[List[Transfer]] = [[] for _ in range(p)]
        self.stalls = [0.0] * p
        self.stalled: Dict[Tuple[str, int, int], float] = {}

    def duration(self, r: int, stage: int, part: str) -> float:
        return durations(self.setting, self.T, r, stage)[part]

    def issue(self, r: int, a: Action, t: float) -> None:
        part = PART_OF[a.kind]
        key = (part, a.stage, a.mb)
        back = a.kind in (RELOAD, RELOAD_W)
        lane = 1 if (back and self.overlap) else 0
        start = max(t, self.free[r][lane])
        if back:
            if key not in self.off_end:
                raise ScheduleError(f"rank {r}: {a} before {PAIR_OF[part][0]}{a.stage}.{a.mb}")
            start = max(start, self.off_end[key])
        end = start + self.duration(r, a.stage, part)
        self.free[r][lane] = end
        (self.back_end if back else self.off_end)[key] = end
        self.transfers[r].append(Transfer(a, r, t, start, end, amounts(self.setting, r, a.stage)[part]))

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
                                    f"{PAIR_OF[part][1]}{a.stage}.{a.mb})")
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
            ev.append((t.start if k == F else t.end, 1, i, st.pass_mem(k, r, t.action.stage)))
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
        return OffloadResult(self.options, self.transfers, self.stalls, peak_without, off, off_w, forwards,
                             [max(T.values(), default=0.0) for T in self.T],
                             dict(self.stalled))
