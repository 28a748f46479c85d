"""Emulated compute: schedules run by the runtime on real processes with real point-to-point
messages, the compute of each pass replaced by a wait of given F/B/W times.

    from megatron_zb.core.ir import Setting
    from megatron_zb.verify.timing.emulate import Entry, Timing, emulate
    rows = emulate([Entry("1f1b"), Entry("zb-h1"), Entry("zb-v")],
                   Setting(4, 8, cost_f=87.6, cost_b=118.4, cost_w=64.1),   # ms per whole stage
                   Timing(unit_s=1e-3, iterations=3))

One launch of ``stages`` gloo processes (``megatron_zb.verify.processes.launch``; no megatron import) runs
every entry in turn: the core generates and lowers the schedule, the runtime's executor walks each
rank's list with ``runtime.emulate.sleep_passes`` (a pass waits its cost, then hands a small real tensor
to the runtime's p2p), so what is measured is the executor's order, the ranks waiting on each
other's messages and the runtime's own overhead; what is not measured is compute (none runs) or
the time of moving a real activation (the messages are small).

Per entry, ``Timing.warmup`` (>= 1) iterations, then ``Timing.iterations`` timed ones. By default every rank leaves a
barrier together before each iteration, as after Megatron's synchronous optimizer step; an
iteration's time is from leaving the barrier to the end of the last rank's last pass (its sends
completed). ``Entry(..., post_validation=True)`` runs the iterations back to back instead (each
rank starts its next iteration as soon as its own last one ends, as optimizer post-validation
allows) and measures the steady-state period. The prediction is the simulator's for the same
costs, with ``cost_comm`` the one-way time of a small message between neighbouring ranks measured
first (ping-pong; ``hop`` in the rows; the schedules are generated with it too): the end of the last pass with every rank starting at 0
(synchronous), or the simulator's ``iteration_time_post_validated`` (post-validation).

Each row: ``label``, ``schedule``, ``measured`` (median, in the costs' unit), ``per_iteration``,
``predicted``, ``error_pct``, ``speedup_measured`` / ``speedup_predicted`` over the first entry,
and ``timeline``: a ``SimResult`` of what ran in the last timed iteration (measured pass starts
and ends, in the costs' unit, from the start of that iteration), which ``megatron_zb.plot`` draws.
Each rank's passes are listed in the order the rank entered them (recorded as they began, an
overlapped pair's F before its B), never sorted by measured start times: on a busy host two
passes' clock readings can come out in either order, the sequence cannot.
"""
from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ...core.build import ScheduleRequest, build
from ...core.ir import Action, Schedule, Setting
from ...core.schedules.interleaved import combined_1f1b
from ...core.sim.iteration import iteration_times
from ...core.sim.simulate import SimResult, Timed
from ...runtime.hooks import Hook

__all__ = ["Entry", "Timing", "COMBINED_1F1B", "emulate", "emulate_schedules", "host_costs", "ping_pong",
           "predicted_iteration", "schedule_for"]

#: Entry.schedule of Megatron's interleaved 1F1B (2 chunks per rank) with its combined-1F1B
#: expert-parallel overlap (``core.schedules.interleaved.combined_1f1b``; not a registered schedule)
COMBINED_1F1B = "combined-1f1b"


@dataclass(frozen=True)
class Entry:
    """One schedule to run; ``label`` defaults to the schedule's name (plus the mode).
    ``memory_limit``: per rank, in mem-f units (the searched schedules search under it; the
    overlapped pairs an all-to-all cost asks for stay within it). ``a2a_overlap``: this entry's
    own (None: ``emulate``'s)."""
    schedule: str
    post_validation: bool = False
    label: Optional[str] = None
    memory_limit: Optional[float] = None
    a2a_overlap: Optional[bool] = None

    @property
    def name(self) -> str:
        return self.label or (self.schedule + (" + post-validation" if self.post_validation else ""))


@dataclass(frozen=True)
class Timing:
    """How ``emulate`` runs: the costs' unit in seconds (default: milliseconds), the untimed
    iterations (>= 1) before the ``iterations`` timed ones, the launch's hang guard in seconds."""
    unit_s: float = 1e-3
    iterations: int = 3
    warmup: int = 1
    timeout: float = 600.0


def schedule_for(entry: Entry, setting: Setting) -> Tuple[Schedule, Setting]:
    """The schedule ``entry`` runs, as ``core.build`` makes it (with the overlapped pairs an
    all-to-all cost asks for), and the setting it was built with."""
    if entry.a2a_overlap is not None:
        setting = dataclasses.replace(setting, a2a_overlap=entry.a2a_overlap)
    if entry.schedule == COMBINED_1F1B:
        st = dataclasses.replace(setting, chunks=2, memory_limit=entry.memory_limit)
        return combined_1f1b(st), st
    req = ScheduleRequest(entry.schedule, cost_f=setting.cost_f, cost_b=setting.cost_b, cost_w=setting.cost_w,
                          cost_comm=setting.cost_comm, cost_a2a=setting.cost_a2a, a2a_overlap=setting.a2a_overlap,
                          memory_limit=entry.memory_limit)
    built = build(req, setting.stages, setting.microbatches, enforce_limit=False)
    return built.schedule, built.setting


def predicted_iteration(entry: Entry, setting: Setting) -> Optional[float]:
    """The simulator's iteration time for ``entry`` (None where it has no prediction)."""
    sched, st = schedule_for(entry, setting)
    it = iteration_times(sched, st)
    return it.iteration_time_post_validated if entry.post_validation else it.iteration_time


class _Ran(Hook):
    """A runtime hook (``runtime.hooks``: the ``compute`` context) that records what ran, in the
    order it ran: [kind, stage, mb, start, end] per compute pass, appended when the pass begins
    (an overlapped pair: its F, then its B, as the executor enters them)."""

    def __init__(self):
        self.passes: List[list] = []

    @contextlib.contextmanager
    def compute(self, action, inputs):
        row = [action.kind, action.stage, action.mb, time.perf_counter(), None]
        self.passes.append(row)
        yield
        row[4] = time.perf_counter()


def _rank_main(job: dict) -> dict:
    """Runs on every rank (launched by ``verify.processes.launch``): each entry's timed iterations."""
    import torch.distributed as dist

    from ...core.sim.lower import lower
    from ...runtime.emulate.sleep_passes import sleep_passes
    from ...runtime.executor import execute, rank_pairs
    from ...runtime.p2p import P2P, PairGroups

    rank, world = dist.get_rank(), dist.get_world_size()
    groups = PairGroups(list(range(world)), {(a, b) for a in range(world) for b in range(a + 1, world)})
    p2p = P2P(groups, rank, timeout_s=job["timeout"])
    unit = job["unit_s"]
    out = []
    try:
        hops = [None] * world
        dist.all_gather_object(hops, ping_pong(groups, rank, world))
        hop = statistics.median([x for xs in hops for x in xs]) if world > 1 else 0.0
        out.append(hop)  # the same value on every rank: every rank generates the same schedules
        for e in job["entries"]:
            entry = Entry(**e)
            st = Setting(job["stages"], job["microbatches"], cost_f=job["cost_f"], cost_b=job["cost_b"],
                         cost_w=job["cost_w"], cost_comm=hop / unit, cost_a2a=job["cost_a2a"],
                         a2a_overlap=job["a2a_overlap"])
            sched, st = schedule_for(entry, st)
            low = lower(sched, st)
            # the simulator runs the pairs as one pass where they hide an all-to-all, else as two
            pairs = rank_pairs(low, rank) if st.a2a_overlap and any(st.cost_a2a) else {}
            passes = sleep_passes(st, rank, low.placement, unit=unit, pairs_as_one=True)
            timing = _Ran()
            n = job["warmup"] + job["iterations"]
            starts, ends = [], []
            dist.barrier()
            for i in range(n):
                if not entry.post_validation:
                    dist.barrier()
                if i == n - 1:
                    timing.passes.clear()
                starts.append(time.perf_counter())
                execute(low.orders[rank], rank, low.placement, passes, p2p, overlap_pairs=pairs, hooks=[timing])
                ends.append(time.perf_counter())
            dist.barrier()
            out.append({"starts": starts, "ends": ends, "passes": [tuple(p) for p in timing.passes]})
    finally:
        groups.destroy()
    return out


def ping_pong(groups, rank: int, world: int, rounds: int = 20) -> List[float]:
    """One-way times (s) of a small message between neighbouring ranks: half of each round trip."""
    import torch
    import torch.distributed as dist
    buf, out = torch.zeros(4), []
    for a in range(world - 1):
        if rank not in (a, a + 1):
            continue
        g, peer = groups.group(a, a + 1), a + 1 if rank == a else a
        for i in range(rounds + 2):
            t0 = time.perf_counter()
            if rank == a:
                dist.send(buf, peer, group=g)
                dist.recv(buf, peer, group=g)
                if i >= 2:
                    out.append((time.perf_counter() - t0) / 2)
            else:
                dist.recv(buf, peer, group=g)
                dist.send(buf, peer, group=g)
    return out


def emulate(entries: Sequence[Entry], setting: Setting, timing: Timing = Timing()) -> List[dict]:
    """Run ``entries`` on ``setting.stages`` real processes; one row per entry (see the module doc).
    ``setting``: the stages, microbatches and costs per whole stage (F, B, W, and ``cost_a2a``,
    MoE's all-to-all in every F, B and BW, with ``a2a_overlap``: the schedules get the overlapped
    F&B pairs it asks for, ``core.passes.pairing``, whose passes sleep what the simulator charges
    them, ``runtime.emulate.sleep_passes``; False: no hiding), in units of ``timing.unit_s``
    seconds; its ``cost_comm`` is replaced by the message time measured first."""
    from ..processes.launch import LaunchOptions, run_cases

    if timing.iterations < 1 or timing.warmup < 1:
        raise ValueError(f"need iterations >= 1 and warmup >= 1, got {timing.iterations}, {timing.warmup}")
    st = dataclasses.replace(setting, cost_comm=0.0)
    stages, unit_s, iterations, warmup = st.stages, timing.unit_s, timing.iterations, timing.warmup
    for e in entries:  # a bad entry fails here, before any process starts
        schedule_for(e, st)
    job = {"entries": [dataclasses.asdict(e) for e in entries], "stages": stages, "microbatches": st.microbatches,
           "cost_f": st.cost_f, "cost_b": st.cost_b, "cost_w": st.cost_w, "cost_a2a": st.cost_a2a,
           "a2a_overlap": st.a2a_overlap, "unit_s": unit_s,
           "iterations": iterations, "warmup": warmup, "timeout": timing.timeout}
    per_rank = run_cases(_rank_main, [job], stages, LaunchOptions(timeout=timing.timeout, cpu_shims=False))[0]
    hop = per_rank[0][0]
    st = dataclasses.replace(st, cost_comm=hop / unit_s)
    rows = []
    for k, entry in enumerate(entries):
        ranks = [r[k + 1] for r in per_rank]
        pred = predicted_iteration(entry, st)
        if entry.post_validation:  # steady-state period: iteration i's end minus iteration i-1's
            per_iter = [max(r["ends"][i] - r["ends"][i - 1] for r in ranks)
                        for i in range(warmup, warmup + iterations)]
        else:  # the slowest rank's end, from the common barrier exit (the earliest start)
            per_iter = [max(r["ends"][i] for r in ranks) - min(r["starts"][i] for r in ranks)
                        for i in range(warmup, warmup + iterations)]
        per_iter = [t / unit_s for t in per_iter]
        meas = statistics.median(per_iter)
        rows.append({"label": entry.name, "schedule": entry.schedule, "post_validation": entry.post_validation,
                     "hop": hop / unit_s, "measured": meas, "per_iteration": per_iter, "predicted": pred,
                     "error_pct": 100.0 * (meas - pred) / pred if pred else None,
                     "timeline": _timeline(entry, st, ranks, unit_s)})
    base = rows[0] if rows else None
    for r in rows:
        r["speedup_measured"] = base["measured"] / r["measured"]
        r["speedup_predicted"] = (base["predicted"] / r["predicted"]
                                  if base["predicted"] and r["predicted"] else None)
    return rows


def _timeline(entry: Entry, st: Setting, ranks: List[dict], unit_s: float) -> SimResult:
    """The last timed iteration as it ran: measured pass times, from that iteration's first start
    (peak memory is not measured: zeros). Each rank's passes in the order it ran them."""
    sched, _ = schedule_for(entry, st)
    return dataclasses.replace(_ran_timeline(sched, st, ranks, unit_s), schedule=entry.name)


#: iterations ``emulate_schedules`` profiles after the timed ones (``profiles``)
PROFILED = 2


def _schedules_rank_main(job: dict) -> list:
    """Runs on every rank: each given (schedule, setting) pair's timed iterations (``emulate_schedules``)."""
    import torch.distributed as dist

    from ...core.sim.lower import lower
    from ...runtime.emulate.sleep_passes import sleep_passes
    from ...runtime.emulate.sleep_vocab import SleepVocab, sleep_vocab
    from ...runtime.executor import execute
    from ...runtime.observe.profiler import PassProfiler, WindowCall
    from ...runtime.p2p import P2P, PairGroups

    rank, world = dist.get_rank(), dist.get_world_size()
    groups = PairGroups(list(range(world)), {(a, b) for a in range(world) for b in range(a + 1, world)})
    p2p = P2P(groups, rank, timeout_s=job["timeout"])
    # vocabulary parallelism: its collectives' own groups (every rank creates them, in one order)
    vgroups = SleepVocab.groups(world) if any(st.vocab is not None for _, st in job["pairs"]) else {}
    out = []
    try:
        hops = [None] * world
        dist.all_gather_object(hops, ping_pong(groups, rank, world))
        out.append(statistics.median([x for xs in hops for x in xs]) if world > 1 else 0.0)
        runs = []
        for sched, st in job["pairs"]:
            low = lower(sched, st)
            passes = sleep_passes(st, rank, low.placement, unit=job["unit_s"])
            passes.vocab = sleep_vocab(st, rank, low.placement, job["unit_s"], vgroups)
            runs.append((low, passes, _Ran(), [], []))
        n = job["warmup"] + job["iterations"]
        # each pair's profile, of iterations of its own after the timed ones (the profiler's hooks cost
        # time per pass, more to a schedule of many short passes): each pass's handling
        profs = [PassProfiler((n + 1, n + PROFILED)) if job.get("profiles") else None for _ in runs]
        total = n + (PROFILED if job.get("profiles") else 0)
        # interleaved: iteration i of every pair, then i + 1 (a drifting load weighs on each alike)
        order = ([(i, k) for i in range(total) for k in range(len(runs))] if job["interleave"]
                 else [(i, k) for k in range(len(runs)) for i in range(total)])
        dist.barrier()
        for i, k in order:
            low, passes, timing, starts, ends = runs[k]
            dist.barrier()
            if i == n - 1:
                timing.passes.clear()
            prof = profs[k] if i >= n else None
            hooks = [prof.hook("cpu")] if prof is not None else [timing]
            t0 = time.perf_counter()
            execute(low.orders[rank], rank, low.placement, passes, p2p, hooks=hooks)
            if passes.vocab is not None:
                passes.vocab.finish()
            if prof is None:
                starts.append(t0)
                ends.append(time.perf_counter())
            else:  # (the window's last gathers every rank's samples)
                prof.end_iteration(i + 1, WindowCall(placement=low.placement, num_microbatches=low.num_microbatches,
                                                     rank=rank))
        dist.barrier()
        for (low, passes, timing, starts, ends), prof in zip(runs, profs):
            out.append({"starts": starts, "ends": ends,
                        "passes": [tuple(p) for p in timing.passes] if job["timelines"] else None,
                        "profile": prof.profile if prof is not None else None})
    finally:
        for g in vgroups.values():
            dist.destroy_process_group(g)
        groups.destroy()
    return out


def emulate_schedules(pairs: Sequence[Tuple[Schedule, Setting]], unit_s: float = 1e-3, iterations: int = 3,
                      warmup: int = 1, timeout: float = 600.0, timelines: bool = False, interleave: bool = False,
                      profiles: bool = False):
    """Run each (schedule, setting) -- any costs, per-microbatch ones included, vocabulary passes
    too (``runtime.emulate.sleep_vocab``: their barriers real gloo collectives) -- on its ranks' real
    processes (one launch for all; every schedule the same pipeline size), each pass a wait of its
    cost (``runtime.emulate.sleep_passes``), a barrier before every iteration (Megatron's synchronous step).
    Returns the measured one-way hop of a small message (in the costs' unit) and, per pair, each
    timed iteration's time: the slowest rank's end from the barrier exit, in the costs' unit.
    ``timelines``: also, per pair, the last timed iteration as it ran (a ``SimResult`` as
    ``emulate``'s rows carry: each rank's passes in the order it ran them, measured times).
    ``profiles``: also (last), per pair, the profile of ``PROFILED`` iterations run after the timed ones
    (``runtime.observe.profiler``; on a CPU each pass's handling: ``host_costs``).
    ``interleave``: iteration i of every pair, then iteration i + 1 (else each pair's in turn)."""
    from ..processes.launch import LaunchOptions, run_cases

    pairs = list(pairs)
    ranks = {s.num_ranks for s, _ in pairs}
    if len(ranks) != 1:
        raise ValueError(f"one launch runs one pipeline size, got {sorted(ranks)}")
    job = {"pairs": pairs, "unit_s": unit_s, "iterations": iterations, "warmup": warmup, "timeout": timeout,
           "timelines": timelines, "interleave": interleave, "profiles": profiles}
    per_rank = run_cases(_schedules_rank_main, [job], ranks.pop(), LaunchOptions(timeout=timeout, cpu_shims=False))[0]
    times, tls = [], []
    for k, (sched, st) in enumerate(pairs):
        rs = [r[k + 1] for r in per_rank]
        times.append([(max(r["ends"][i] for r in rs) - min(r["starts"][i] for r in rs)) / unit_s
                      for i in range(warmup, warmup + iterations)])
        if timelines:
            tls.append(_ran_timeline(sched, st, rs, unit_s))
    out = (per_rank[0][0] / unit_s, times) + ((tls,) if timelines else ())
    return out + ([r["profile"] for r in per_rank[0][1:]],) if profiles else out


def host_costs(setting: Setting, placement, profile: dict, unit_s: float) -> Setting:
    """``setting`` with each model chunk's F, B, W and fused BW costing also its host costs as
    ``profile`` measured them on a CPU (each pass's handling -- posting its messages, the
    executor's bookkeeping, the hooks -- and the interference it met: ``runtime.observe.profile_data``),
    in the costs' unit (``unit_s`` seconds each); ``setting`` where the profile has none."""
    from ...core.ir import BW, B, F, W
    from ...runtime.observe.profile_data import chunk_host_costs

    per_chunk = chunk_host_costs(profile) if profile else None
    if per_chunk is None:
        return setting
    st = setting if setting.chunks == placement.chunks else dataclasses.replace(setting, chunks=placement.chunks)
    S = placement.num_stages

    def extra(k: str, s: int) -> float:
        xs, ls = per_chunk[k], placement.logical(s)
        return (xs[ls] if ls < len(xs) else 0.0) / unit_s

    own = lambda k, s: st.pass_cost(k, placement.rank_of(s), s) - st.pass_a2a(k, placement.rank_of(s), s)  # noqa: E731
    costs = {f"cost_{k.lower()}": [own(k, s) + extra(k.lower(), s) for s in range(S)] for k in (F, B, W, BW)}
    return dataclasses.replace(st, **costs)


def _ran_timeline(sched: Schedule, st: Setting, ranks: List[dict], unit_s: float) -> SimResult:
    """The last timed iteration of ``sched`` as it ran (``_timeline``'s, for a given schedule)."""
    t0 = min(r["starts"][-1] for r in ranks)
    tl = [[Timed(Action(kind, stage, mb), rank, (a - t0) / unit_s, (b - t0) / unit_s)
           for kind, stage, mb, a, b in r["passes"]] for rank, r in enumerate(ranks)]
    busy = [sum(t.end - t.start for t in x) for x in tl]
    spans = [x[-1].end - x[0].start if x else 0.0 for x in tl]
    makespan = max(spans)
    p = sched.num_ranks
    return SimResult(sched.name, p, sched.num_microbatches, sched.placement.chunks, makespan,
                     1.0 - sum(busy) / (p * makespan) if makespan else 0.0, [0.0] * p, spans, busy, tl)
