"""The training-iteration model: how long one training iteration takes, optimizer step included.

A schedule's makespan (the longest per-rank span) is not what training gets. Megatron's optimizer
step all-reduces the gradient norm and the inf/NaN flag over every rank of the model, pipeline
ranks included, so each iteration ends with a barrier:

* **synchronous** (``iteration_time``): every rank starts iteration k+1 at the same moment, the
  end of the last pass of iteration k on any rank plus the optimizer step (``cost_optimizer``).
  One iteration lasts ``max end - min start + cost_optimizer`` (all ranks start at 0).
* **post-validated** (``iteration_time_post_validated``): each rank steps its optimizer as soon
  as its own last pass ends and starts its next iteration after its own step. The partial
  reductions travel rank 0 -> 1 -> ... -> P-1 (each hop ``cost_comm``, a rank adds its part when
  its last pass has ended), the full result travels back P-1 -> ... -> 0, and a rank's first
  backward pass (B or BW) of the next iteration waits for that result (the validation point:
  the forwards before it are redone if the step is rolled back, nothing after it may use
  unvalidated weights). Measured, not by formula: ``ITERATIONS`` iterations are simulated back
  to back (``simulate(..., release=...)``) and the steady-state period is the average over the
  last ones.

The post-validated step is dearer than Megatron's: it keeps what a rollback needs and validates
afterwards. ``cost_postval`` is its time (default ``POSTVAL_STEP_FACTOR`` x ``cost_optimizer``).

Reference values, unit costs, P=4, M=8, cost_optimizer 0: 1f1b 33 / 33, zb-h1 27 / 27, zb-h2 27 / 24.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..ir import BW, B, Schedule, ScheduleError, Setting
from .simulate import Plain, SimResult, Timed, simulate

# iterations simulated back to back, and how many of the last ones the period is averaged over
# (a multiple of 1, 2, 3, 4 and 6 so a periodic steady state of that length averages exactly)
ITERATIONS = 16
AVERAGE_OVER = 12

#: the post-validated optimizer step (the eager step, its rollback copy, its validation) over
#: Megatron's synchronous one, where it is not measured: the GPU check's postval section on an H200
#: (bf16, 2 layers h2048 s2048, Adam) measured 1.36x and 1.49x (benchmarks/results/gpu_check_h200/)
POSTVAL_STEP_FACTOR = 1.4


def steady_shift(ends: List[List[float]]) -> Optional[float]:
    """Where the last two iterations' per-rank ends each moved every rank by the same time (to
    float noise): that time, the steady period. An iteration's times are a function of the
    previous one's ends alone (its release, its validation result), unchanged by a shift: once
    every rank's end moved by the same time, so does every later iteration's (the iterations
    left need not be simulated). None until then."""
    if len(ends) < 3:
        return None
    shifts = []
    for a, b in ((ends[-3], ends[-2]), (ends[-2], ends[-1])):
        d = [y - x for x, y in zip(a, b)]
        if not d:
            return None
        tol = 1e-12 * max(1.0, max(abs(y) for y in b))
        if max(d) - min(d) > tol:
            return None
        shifts.append(d)
    if abs(shifts[0][0] - shifts[1][0]) > 1e-12 * max(1.0, max(abs(y) for y in ends[-1])):
        return None
    return max(ends[-1]) - max(ends[-2])


@dataclass
class IterationResult:
    schedule: str
    cost_optimizer: float
    iteration_time: float  # synchronous optimizer step (Megatron's)
    iteration_time_post_validated: float
    # per iteration simulated back to back (post-validated): per rank, (start of its first pass,
    # end of its last pass) and the time the validation result of that iteration reaches it
    windows: List[List[Tuple[float, float]]] = field(default_factory=list, repr=False)
    validated_at: List[List[float]] = field(default_factory=list, repr=False)
    cost_postval: object = None  # the post-validated step's time (one, or one per rank)

    def to_dict(self) -> dict:
        def r(c):
            return [_r(x) for x in c] if isinstance(c, list) else _r(c or 0.0)
        return {"iteration_time": _r(self.iteration_time),
                "iteration_time_post_validated": _r(self.iteration_time_post_validated),
                "cost_optimizer": r(self.cost_optimizer), "cost_optimizer_post_validated": r(self.cost_postval)}


def _r(x: float) -> float:
    return round(float(x), 10)


def _check_cost(cost_optimizer):
    """A number >= 0, or one per rank (each rank's own step: ``core.optimizer.offload``)."""
    if isinstance(cost_optimizer, (list, tuple)):
        return [_check_cost(c) for c in cost_optimizer]
    if isinstance(cost_optimizer, bool) or not isinstance(cost_optimizer, (int, float)) \
            or not (0 <= cost_optimizer < float("inf")):
        raise ScheduleError(f"cost-optimizer must be a non-negative number, got {cost_optimizer!r}")
    return float(cost_optimizer)


def _rank_cost(cost, r: int) -> float:
    return cost[r] if isinstance(cost, list) else cost


def _max_cost(cost) -> float:
    return max(cost, default=0.0) if isinstance(cost, list) else cost


def postval_cost(cost_optimizer, cost_postval=None):
    """The post-validated step's time (one, or one per rank): ``cost_postval`` where given, else
    ``POSTVAL_STEP_FACTOR`` x Megatron's step ``cost_optimizer``."""
    if cost_postval is not None:
        return _check_cost(cost_postval)
    cost = _check_cost(cost_optimizer)
    return [POSTVAL_STEP_FACTOR * c for c in cost] if isinstance(cost, list) else POSTVAL_STEP_FACTOR * cost


def validation_points(schedule: Schedule) -> List[Optional[int]]:
    """Per rank: the position (among its compute passes, overlapped pairs expanded) of its first
    B or BW, where it validates the previous step; None for a rank without a backward."""
    out = []
    for order in schedule.flat().orders:
        passes = [a for a in order if a.is_compute]
        out.append(next((i for i, a in enumerate(passes) if a.kind in (B, BW)), None))
    return out


def validation_times(ends: Sequence[float], hop: float) -> List[float]:
    """When the fully reduced result reaches each rank: partials go 0 -> P-1 (rank r adds its part
    once its last pass ended at ``ends[r]``), the full result comes back P-1 -> 0; ``hop`` per message."""
    p = len(ends)
    acc = ends[0]
    for r in range(1, p):
        acc = max(acc + hop, ends[r])
    out = [0.0] * p
    out[p - 1] = acc
    for r in range(p - 2, -1, -1):
        out[r] = out[r + 1] + hop
    return out


def _rank_window(tl: List[Timed], default: float) -> Tuple[float, float]:
    return (tl[0].start, tl[-1].end) if tl else (default, default)


def simulate_iterations(schedule: Schedule, setting: Setting, iterations: int, cost_optimizer: float = 0.0,
                        post_validated: bool = True, steady: bool = False) -> Tuple[List[SimResult], List[List[float]]]:
    """Simulate ``iterations`` training iterations back to back (absolute times).

    Returns (one ``SimResult`` per iteration, per iteration the time each rank gets the
    validation result of that iteration's step; empty lists when synchronous). ``steady``: stop
    once the iterations repeat (``steady_shift``), fewer results then. ``cost_optimizer``: the
    step's time, Megatron's (synchronous) or the post-validated one's (``postval_cost``)."""
    cost_optimizer = _check_cost(cost_optimizer)
    if not isinstance(iterations, int) or iterations < 1:
        raise ScheduleError(f"iterations must be an integer >= 1, got {iterations!r}")
    if setting.chunks != schedule.placement.chunks:
        setting = dataclasses.replace(setting, chunks=schedule.placement.chunks)
    first = simulate(schedule, setting)
    p = len(first.timeline)
    if isinstance(cost_optimizer, list) and len(cost_optimizer) != p:
        raise ScheduleError(f"cost-optimizer: {len(cost_optimizer)} values for {p} ranks")
    if not post_validated:
        t = max((tl[-1].end for tl in first.timeline if tl), default=0.0) + _max_cost(cost_optimizer)
        return [_shifted(first, k * t) for k in range(iterations)], []
    points = validation_points(schedule)
    results, validated = [first], []
    history = []
    for k in range(1, iterations + 1):
        prev = results[-1]
        ends = [_rank_window(tl, 0.0)[1] for tl in prev.timeline]
        history.append(ends)
        v = validation_times(ends, setting.cost_comm)
        validated.append(v)
        if k == iterations or steady and steady_shift(history) is not None:
            break
        release: Dict[Tuple[int, int], float] = {}
        for r in range(p):
            release[(r, 0)] = ends[r] + _rank_cost(cost_optimizer, r)
            if points[r] is not None:
                release[(r, points[r])] = max(release.get((r, points[r]), 0.0), v[r])
        results.append(simulate(schedule, setting, release=release))
    return results, validated


def _shifted(res: SimResult, dt: float) -> SimResult:
    tl = [[Timed(t.action, t.rank, t.start + dt, t.end + dt) for t in rank] for rank in res.timeline]
    return dataclasses.replace(res, timeline=tl)


def iteration_times(schedule: Schedule, setting: Setting, cost_optimizer: float = 0.0,
                    cost_postval=None) -> IterationResult:
    """Synchronous and post-validated time per training iteration of ``schedule`` (see the module):
    Megatron's step takes ``cost_optimizer``, the post-validated one ``cost_postval`` (``postval_cost``)."""
    cost_optimizer = _check_cost(cost_optimizer)
    post_step = postval_cost(cost_optimizer, cost_postval)
    fast = _plain_iterations(schedule, setting, cost_optimizer, post_step)
    if fast is not None:
        return fast
    sync_runs, _ = simulate_iterations(schedule, setting, 1, cost_optimizer, post_validated=False)
    base = sync_runs[0]
    starts = [tl[0].start for tl in base.timeline if tl]
    ends = [tl[-1].end for tl in base.timeline if tl]
    sync = (max(ends) - min(starts) if ends else 0.0) + _max_cost(cost_optimizer)
    runs, validated = simulate_iterations(schedule, setting, ITERATIONS, post_step, post_validated=True,
                                          steady=True)
    windows = [[_rank_window(tl, 0.0) for tl in res.timeline] for res in runs]
    post = _period([[w[1] for w in run] for run in windows])
    return IterationResult(schedule.name, cost_optimizer, sync, post, windows, validated, post_step)


def _plain_iterations(schedule: Schedule, setting: Setting, cost_optimizer, post_step) -> Optional[IterationResult]:
    """``iteration_times`` by ``simulate.Plain`` where it applies (the passes coded once, no
    timeline built: the same times as ``simulate_iterations``'); None where it does not."""
    if setting.chunks != schedule.placement.chunks:
        setting = dataclasses.replace(setting, chunks=schedule.placement.chunks)
    flat = schedule.flat()
    if flat.placement.num_ranks != setting.stages or not Plain.plain(flat, setting):
        return None
    plain = Plain.of([[a for a in o if a.is_compute] for o in flat.orders], flat.placement, setting)
    t = plain.times() if plain.ok else None
    if t is None:
        return None
    codes = plain.codes

    def windows(t) -> List[Tuple[float, float]]:
        return [(t[0][c[0]], t[1][c[-1]]) if c else (0.0, 0.0) for c in codes]

    first = windows(t)
    starts = [w[0] for w, c in zip(first, codes) if c]
    ends = [w[1] for w, c in zip(first, codes) if c]
    sync = (max(ends) - min(starts) if ends else 0.0) + _max_cost(cost_optimizer)
    for cost in (cost_optimizer, post_step):
        if isinstance(cost, list) and len(cost) != len(codes):
            raise ScheduleError(f"cost-optimizer: {len(cost)} values for {len(codes)} ranks")
    points = validation_points(schedule)
    runs, validated, history = [first], [], []
    for k in range(1, ITERATIONS + 1):
        ends = [w[1] for w in runs[-1]]
        history.append(ends)
        v = validation_times(ends, setting.cost_comm)
        validated.append(v)
        if k == ITERATIONS or steady_shift(history) is not None:
            break
        release: Dict[Tuple[int, int], float] = {}
        for r in range(len(codes)):
            release[(r, 0)] = ends[r] + _rank_cost(post_step, r)
            if points[r] is not None:
                release[(r, points[r])] = max(release.get((r, points[r]), 0.0), v[r])
        t = plain.times(release)
        if t is None:
            return None
        runs.append(windows(t))
    post = _period([[w[1] for w in run] for run in runs])
    return IterationResult(schedule.name, cost_optimizer, sync, post, runs, validated, post_step)


def _period(ends: List[List[float]]) -> float:
    """The post-validated time per iteration from the iterations simulated (per rank, their
    ends): the steady shift where they repeat, else the average over the last ``AVERAGE_OVER``."""
    shift = steady_shift(ends)
    if shift is not None:
        return shift
    last_end = [max(e) for e in ends]
    k1 = len(last_end) - 1
    return (last_end[k1] - last_end[k1 - AVERAGE_OVER]) / AVERAGE_OVER


def back_to_back(schedule: Schedule, setting: Setting, iterations: int, cost_optimizer: float = 0.0,
                 post_validated: bool = False, measured: bool = False) -> SimResult:
    """One ``SimResult`` holding ``iterations`` iterations back to back (for pictures): its timeline
    has every pass of every iteration at its absolute time; makespan is the whole stretch.
    ``cost_optimizer``: Megatron's step (post-validated: ``postval_cost`` of it), or with ``measured``
    the step's own time."""
    step = postval_cost(cost_optimizer) if post_validated and not measured else cost_optimizer
    runs, _ = simulate_iterations(schedule, setting, iterations, step, post_validated)
    first = runs[0]
    tl = [[t for res in runs for t in res.timeline[r]] for r in range(len(first.timeline))]
    start = min((x[0].start for x in tl if x), default=0.0)
    end = max((x[-1].end for x in tl if x), default=0.0)
    busy = [sum(t.end - t.start for t in x) for x in tl]
    span = end - start
    bubble = 1.0 - sum(busy) / (len(tl) * span) if span > 0 else 0.0
    return dataclasses.replace(first, makespan=span, bubble_rate=bubble, busy=busy,
                               spans=[(x[-1].end - x[0].start) if x else 0.0 for x in tl], timeline=tl)
