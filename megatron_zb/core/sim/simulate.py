"""Event simulator: when each pass of a schedule runs, the makespan, bubble and memory.

Contract (product brief): every rank runs its compute passes in list order, each at the earliest
time its dependencies and the rank's previous pass allow. A dependency on a pass of another rank
is charged ``cost_comm``; one on the same rank (e.g. the V turn-around) is not. Communication
actions of a lowered schedule take no time here.

Replicated stages (``Placement.paths``): the replicas of a logical stage all-reduce their weight
gradients once every replica has run its last backward pass (B, BW or W). The all-reduce takes
``cost_sync / chunks`` and runs beside the compute (it only occupies the link between the
replicas' ranks, one all-reduce at a time per rank); a rank is done when its last pass and its
last all-reduce are. So an early sync is hidden behind the remaining passes and only the tail
shows, which is what eager gradient synchronisation buys.

OFFLOAD/RELOAD actions (placed by ``core.passes.offload``) run on the rank's host link (``core.sim.hostlink``):
a B waits for its reload, and the offloaded activation leaves ``peak_memory`` between the end of
its offload and the start of its reload.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ..ir import (BW, OFFLOAD, OFFLOAD_KINDS, OFFLOAD_W, RELOAD, RELOAD_W, Action, B, F, Schedule, ScheduleError,
                  Setting, W, deps)
from ..ir.vocab import Barriers, key_rank, vocab_deps
from .hostlink import HostLinks
from .plain import Plain, Timed


@dataclass
class SimResult:
    schedule: str
    stages: int
    microbatches: int
    chunks: int
    makespan: float
    bubble_rate: float
    peak_memory: List[float]
    spans: List[float]
    busy: List[float]
    timeline: List[List[Timed]] = field(repr=False)
    # replicated stages only: (logical stage, ranks, start, end) of each gradient all-reduce, and
    # the model weights each rank holds in 1F1B stages (2 where it holds two replicas' worth)
    syncs: List[Tuple[int, Tuple[int, ...], float, float]] = field(default_factory=list, repr=False)
    weight_copies: Optional[List[float]] = None
    offload: Optional[object] = field(default=None, repr=False)  # core.sim.hostlink.OffloadResult

    def to_dict(self) -> dict:
        ideal = max(self.busy) if self.busy else 0.0
        d = {
            "schedule": self.schedule,
            "stages": self.stages,
            "microbatches": self.microbatches,
            "chunks": self.chunks,
            "makespan": _r(self.makespan),
            "bubble_rate": _r(self.bubble_rate),
            "bubble_over_ideal": _r((self.makespan - ideal) / ideal) if ideal else 0.0,
            "peak_memory": [_r(x) for x in self.peak_memory],
            "spans": [_r(x) for x in self.spans],
            "busy": [_r(x) for x in self.busy],
            **({"weight_copies": [_r(x) for x in self.weight_copies],
                "gradient_syncs": [{"logical_stage": l, "ranks": list(rk), "start": _r(a), "end": _r(b)}
                                   for l, rk, a, b in self.syncs]}
               if self.weight_copies is not None else {}),
        }
        if self.offload is not None:
            d["offload"] = self.offload.to_dict()
        return d


def _r(x: float) -> float:
    return round(float(x), 10)


class Deadlock(ScheduleError):
    """No rank can run its next pass. The message (built only when asked for: search loops catch
    many of these) names the pass that comes too late and the cycle of ranks waiting on it, then
    every stuck rank; positions count every action of the (flattened) rank list."""

    def __init__(self, schedule: Schedule, orders: List[List[Action]], pos: List[int],
                 done: Dict[Tuple[str, int, int], float], dep_of=None):
        super().__init__("schedule deadlocks")
        self._args = (schedule, orders, pos, done, dep_of)
        self._msg: Optional[str] = None

    def __str__(self) -> str:
        if self._msg is None:
            self._msg = _deadlock_message(*self._args)
        return self._msg

    def stuck(self) -> List[Tuple[int, int]]:
        """(rank, index among the rank's compute passes) of the pass each stuck rank waits in."""
        _, orders, pos, _, _ = self._args
        return [(r, sum(1 for a in o[:pos[r]] if a.is_compute)) for r, o in enumerate(orders) if pos[r] < len(o)]

    def __reduce__(self):  # pickles as the plain error it describes
        return ScheduleError, (str(self),)


def _deadlock_message(schedule: Schedule, orders, pos, done, dep_of=None) -> str:
    pl = schedule.placement
    nst = pl.num_stages
    index = [[i for i, a in enumerate(o) if a.is_compute] for o in schedule.orders]  # compute -> list position
    where = {}  # (kind, stage, mb) -> (rank, compute index); B and BW also as 'B*'
    for r, order in enumerate(orders):
        for j, a in enumerate(order):
            where.setdefault((a.kind, a.stage, a.mb), (r, j))
            if a.kind in (B, BW):
                where.setdefault(("B*", a.stage, a.mb), (r, j))
    stuck = [r for r in range(len(orders)) if pos[r] < len(orders[r])]
    waits = {}  # rank -> (its pass, the missing dependency, (rank, compute index) of it or None)
    for r in stuck:
        a = orders[r][pos[r]]
        dep = next(d for d in (dep_of(a) if dep_of is not None else deps(a, nst, pl)) if d not in done)
        waits[r] = (a, dep, where.get(dep))

    def name(dep):
        k, st, mb = dep
        return f"{'B' if k == 'B*' else k}{st}.{mb}"

    def at(r, j):
        return f"rank {r} position {index[r][j]}"

    lead = ""
    missing = [r for r in stuck if waits[r][2] is None]
    if missing:
        r = missing[0]
        a, dep, _ = waits[r]
        lead = f"{at(r, pos[r])} ({a}) waits for {name(dep)}, which no rank runs; "
    else:  # follow the waits from a stuck rank to a cycle; blame the wait whose pass lies furthest ahead
        r, seen = stuck[0], []
        while r not in seen:
            seen.append(r)
            r = waits[r][2][0]
        cycle = seen[seen.index(r):]
        late = max(cycle, key=lambda q: waits[q][2][1] - pos[waits[q][2][0]])
        a, dep, (q, j) = waits[late]
        others = [f"{at(c, pos[c])} ({waits[c][0]}) waits for {name(waits[c][1])} from rank {waits[c][2][0]}"
                  for c in cycle if c != late]
        lead = (f"{name(dep)} at {at(q, j)} comes too late: {at(late, pos[late])} ({a}) waits for it"
                + (f", while {', '.join(others)}" if others else "") + "; ")
    return ("schedule deadlocks: " + lead + "stuck: "
            + "; ".join(f"rank {r} at position {index[r][pos[r]]} waits in {orders[r][pos[r]]}" for r in stuck))


def simulate(schedule: Schedule, setting: Setting,
             release: Optional[Dict[Tuple[int, int], float]] = None,
             unpaired: Optional[set] = None) -> SimResult:
    """Time every compute pass. Raises Deadlock naming each stuck rank's waiting pass.

    ``release`` (optional): {(rank, i): t} -- the i-th compute pass of that rank starts no earlier
    than t (``core.sim.iteration`` uses it for iterations back to back).

    ``unpaired`` (optional, a set; ``core.passes.pairing`` uses it): where the schedule would deadlock
    because overlapped pairs wait for their backward's inputs, the pairs the stuck ranks wait in
    run as two plain passes instead, and their (rank, index of the F among the rank's compute
    passes) are added to the set."""
    schedule = schedule.flat()
    pl = schedule.placement
    nst = pl.num_stages
    if pl.num_ranks != setting.stages:
        raise ScheduleError(f"schedule has {pl.num_ranks} ranks but the setting has {setting.stages} stages")
    if setting.chunks != pl.chunks:  # each chunk's pass costs the rank's value / chunks
        setting = dataclasses.replace(setting, chunks=pl.chunks)
    links = None
    if schedule.meta.get("offload") is not None or any(a.kind in OFFLOAD_KINDS for o in schedule.orders for a in o):
        links = HostLinks(schedule, setting)
    barriers = None  # vocabulary parallelism: its collectives' completions
    if any(a.is_vocab for o in schedule.orders for a in o):
        if setting.vocab is None:
            raise ScheduleError(f"schedule {schedule.name} has vocabulary passes: its setting needs their costs "
                                "(vocabulary parallelism)")
    orders = [[a for a in o if a.is_compute or (links is not None and a.kind in OFFLOAD_KINDS)]
              for o in schedule.orders]
    done: Dict[Tuple[str, int, int], float] = {}  # (kind, stage, mb) -> end time; BW also as 'B*'
    if any(a.is_vocab for o in orders for a in o):
        barriers = Barriers(pl.num_ranks, setting.vocab.check(pl.num_ranks), done)
        dep_of = lambda a: vocab_deps(a, pl, setting.vocab.barriers, setting.vocab.embedding)  # noqa: E731
    else:
        dep_of = lambda a: deps(a, nst, pl)  # noqa: E731
    pos = [0] * len(orders)
    clock = [0.0] * len(orders)
    timeline: List[List[Timed]] = [[] for _ in orders]
    comm = setting.cost_comm
    remaining = sum(len(o) for o in orders)
    # overlapped F&B pairs (rank, index of the F among the rank's compute passes), run as one pass
    # (the runtime's pair call, Megatron's combined 1F1B): the pair starts when both passes have
    # their inputs, each pass's all-to-all hides behind the other's compute (``Setting.a2a_overlap``)
    # and both results leave at the pair's end. The timeline shows the F, then the B
    pairs = set(map(tuple, schedule.meta.get("overlap_pairs", ()))) if setting.a2a_overlap and \
        any(setting.cost_a2a) else set()
    if links is None and not pairs:
        fast = Plain.of(orders, pl, setting)
        fast = fast.timeline(release) if fast.ok else None
        if fast is not None:
            timeline, remaining = fast, 0
    while remaining:
        progressed = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                a = order[pos[r]]
                if a.kind in OFFLOAD_KINDS:  # issued now; runs on the host link
                    links.issue(r, a, clock[r])
                    pos[r] += 1
                    remaining -= 1
                    progressed = True
                    continue
                ready = clock[r]
                if release:
                    ready = max(ready, release.get((r, len(timeline[r])), ready))  # i-th compute pass
                i = len(timeline[r])
                # the F of an overlapped pair starts once the inputs of both its passes are in
                ready = _inputs_ready(a, r, ready, done, dep_of, pl, comm)
                if ready is not None and (r, i) in pairs:
                    ready = _inputs_ready(order[pos[r] + 1], r, ready, done, dep_of, pl, comm)
                if ready is None:
                    break
                if links is not None and a.kind in (B, BW, W):
                    ready = links.gate(r, a, ready)
                if (r, i) in pairs:  # the F of a pair; its B comes next
                    dur = paired_cost(setting, r, a, order[pos[r] + 1])
                elif (r, i - 1) in pairs:  # the B of a pair
                    dur = paired_cost(setting, r, a, timeline[r][-1].action)
                else:
                    dur = setting.pass_cost(a.kind, r, a.stage, a.mb)
                end = ready + dur
                timeline[r].append(Timed(a, r, ready, end))
                clock[r] = end
                if (r, i) not in pairs:  # a pair's F hands its output on with the pair's end (its B's)
                    done[(a.kind, a.stage, a.mb)] = end
                    if (r, i - 1) in pairs:
                        f = timeline[r][-2].action
                        done[(f.kind, f.stage, f.mb)] = end
                if a.kind in (B, BW):
                    done[("B*", a.stage, a.mb)] = end
                if barriers is not None:
                    barriers.passed(a, end)
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            deadlock = Deadlock(schedule, orders, pos, done, dep_of)
            stuck = set(deadlock.stuck()) & pairs
            if unpaired is None or not stuck:
                raise deadlock
            unpaired |= stuck  # these pairs wait for each other: run them as plain passes
            pairs -= stuck

    syncs = _replica_syncs(timeline, pl, setting) if pl.replicated else []
    finish = [tl[-1].end if tl else 0.0 for tl in timeline]
    for _, ranks, _, end in syncs:
        for r in ranks:
            finish[r] = max(finish[r], end)
    spans, busy, peaks = [], [], []
    for r, tl in enumerate(timeline):
        if tl:
            spans.append(finish[r] - tl[0].start)
            busy.append(sum(t.end - t.start for t in tl))
        else:
            spans.append(0.0)
            busy.append(0.0)
        peaks.append(peak_memory(orders[r], r, setting))
    offload = None
    if links is not None:
        offload = links.result(peaks, [sum(1 for t in tl if t.action.kind == F) for tl in timeline])
        peaks = [links.peak(r, tl) for r, tl in enumerate(timeline)]
    makespan = max(spans) if spans else 0.0
    p = len(orders)
    bubble = max(0.0, 1.0 - sum(busy) / (p * makespan)) if makespan > 0 else 0.0  # no float-noise negatives
    copies = [pl.weight_copies(r) for r in range(p)] if pl.replicated else None
    return SimResult(schedule.name, setting.stages, schedule.num_microbatches, pl.chunks,
                     makespan, bubble, peaks, spans, busy, timeline, syncs, copies, offload)


def makespan_and_peak(schedule: Schedule, setting: Setting) -> Tuple[float, float]:
    """``simulate``'s makespan and highest peak memory, without building its timeline where
    ``Plain`` times the schedule (simulate's own fast path: the same passes timed the same way,
    each rank's span from its first start to its last end); else from ``simulate`` itself."""
    flat = schedule.flat()
    pl = flat.placement
    if pl.num_ranks == setting.stages and not pl.replicated and Plain.plain(flat, setting):
        st = setting if setting.chunks == pl.chunks else dataclasses.replace(setting, chunks=pl.chunks)
        orders = [[a for a in o if a.is_compute] for o in flat.orders]
        if st.vocab is None or not any(a.is_vocab for o in orders for a in o) or st.vocab.check(pl.num_ranks):
            fast = Plain.of(orders, pl, st)
            t = fast.times() if fast.ok else None
            if t is not None:
                start, end = t
                spans = [end[c[-1]] - start[c[0]] if c else 0.0 for c in fast.codes]
                return (max(spans) if spans else 0.0,
                        max(peak_memory(o, r, st) for r, o in enumerate(orders)) if orders else 0.0)
    res = simulate(schedule, setting)
    return res.makespan, max(res.peak_memory)


def _inputs_ready(a: Action, r: int, ready: float, done, dep_of, pl, comm: float) -> Optional[float]:
    """When pass ``a`` on rank ``r`` has its inputs (no earlier than ``ready``); None if a
    dependency has not run yet."""
    for key in dep_of(a):
        t = done.get(key)
        if t is None:
            return None
        if key_rank(key, pl) not in (None, r):
            t += comm
        if t > ready:
            ready = t
    return ready


def paired_cost(setting: Setting, r: int, a: Action, partner: Action) -> float:
    """A pass of an overlapped pair on rank ``r``: its compute, plus the part of its all-to-all
    that the partner's compute does not cover (``setting.chunks`` must be the schedule's). The
    pair takes ``paired_cost(f, b) + paired_cost(b, f)``: the two computes and what is left of the
    all-to-alls, max(0, a2a_f - compute_b) + max(0, a2a_b - compute_f)."""
    own = setting.pass_a2a(a.kind, r, a.stage, a.mb)
    cover = (setting.pass_cost(partner.kind, r, partner.stage, partner.mb)
             - setting.pass_a2a(partner.kind, r, partner.stage, partner.mb))
    return setting.pass_cost(a.kind, r, a.stage, a.mb) - own + max(0.0, own - cover)


def _replica_syncs(timeline: List[List[Timed]], pl, setting: Setting):
    """When each logical stage's replica all-reduce runs (see the module docstring)."""
    last_end: Dict[int, float] = {}  # physical stage -> end of its last backward pass
    for tl in timeline:
        for t in tl:
            if t.action.kind in (B, BW, W):
                last_end[t.action.stage] = max(last_end.get(t.action.stage, 0.0), t.end)
    jobs = []
    for l in range(pl.num_logical_stages):
        reps = [p[l] for p in pl.paths]
        ran = [s for s in reps if s in last_end]
        if len(ran) < 2:  # a replica no microbatch went through: nothing to sum
            continue
        ranks = tuple(sorted({pl.rank_of(s) for s in ran}))
        jobs.append((max(last_end[s] for s in ran), l, ranks))
    link_free = [0.0] * pl.num_ranks
    dur = setting.cost_sync / pl.chunks
    out = []
    for ready, l, ranks in sorted(jobs):
        if len(ranks) < 2:  # both replicas on one rank: a local sum, no link
            out.append((l, ranks, ready, ready))
            continue
        start = max([ready] + [link_free[r] for r in ranks])
        end = start + dur
        for r in ranks:
            link_free[r] = end
        out.append((l, ranks, start, end))
    return out


_UNSEEN = object()


def memory_trace(order: List[Action], rank: int, setting: Setting) -> List[float]:
    """Running activation memory of one rank after each of its compute passes."""
    cur, out = 0.0, []
    if setting.microbatch_costs is None:  # every microbatch's pass changes memory alike: each looked up once
        change: Dict[Tuple[str, Optional[int]], Optional[float]] = {}
        for a in order:
            key = (a.kind, a.stage)
            d = change.get(key, _UNSEEN)
            if d is _UNSEEN:
                d = change[key] = setting.pass_mem(a.kind, rank, a.stage, a.mb) if a.is_compute else None
            if d is not None:
                cur += d
                out.append(cur)
        return out
    for a in order:
        if a.is_compute:
            cur += setting.pass_mem(a.kind, rank, a.stage, a.mb)
            out.append(cur)
    return out


def stage_memory_trace(order: List[Action], stage_mem: Dict[int, Tuple[float, float]]) -> List[float]:
    """``memory_trace`` with each stage's own (mem_f, mem_w) per pass of one chunk, e.g. the bytes
    a run measured: an F adds mem_f, a B releases mem_f - mem_w, a W mem_w, a BW mem_f; in order
    (copies taken as done where they stand, as the CPU test mode runs them), an OFFLOAD releases a
    microbatch's activation until its RELOAD, an OFFLOAD_W what W holds until its RELOAD_W. One
    value after each compute pass."""
    cur, out = 0.0, []
    for a in order:
        f, w = stage_mem.get(a.stage, (0.0, 0.0))
        cur += {F: f, B: -(f - w), W: -w, BW: -f, OFFLOAD: -f, RELOAD: f, OFFLOAD_W: -w, RELOAD_W: w}.get(a.kind, 0.0)
        if a.is_compute:
            out.append(cur)
    return out


def peak_memory(order: List[Action], rank: int, setting: Setting) -> float:
    """Per-rank maximum of the running sum (setting.chunks must match the schedule's)."""
    trace = memory_trace(order, rank, setting)
    return max([0.0] + trace)
