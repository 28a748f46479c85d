"""Vocabulary parallelism with emulated compute: Megatron's 1F1B with the best layout ``plan`` finds
for it (the output layer and loss on the last stage) against ``plan``'s best schedule with
vocabulary parallelism, both run on real processes (``emulate.emulate_schedules``: every pass,
VS/VT/VW included, waits its cost; the barriers are real gloo collectives,
``runtime.emulate.sleep_vocab``), next to the simulator's prediction for the same schedules.

    rows = compare(spec, p=4, m=8, slow_down=3.0)

Costs are ``plan``'s (FLOPs at a GPU's peak x efficiency, per model chunk as the layout holds
it); a pass of c seconds sleeps ``slow_down`` x c (the runtime's own overheads -- a message, a
wake-up -- then weigh 1/slow_down of what they would at the GPU's speed); times are reported back
in the GPU's seconds. The prediction: the simulator for the same schedule and costs, with the
one-way time of a small message measured on this machine (``hop``) between neighbouring stages and
each pass's host costs as profiled in iterations run after the timed ones (``runtime.observe.profiler`` on a
CPU: posting its messages, the executor's bookkeeping, the interference it met; ``emulate.host_costs``):
an interleaved schedule runs four times the passes of a one-chunk one, and on a 2-core machine
each costs a few tenths of a millisecond beside its wait (``predicted_nominal``: without them).
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import List, Optional, Sequence

from ...core.costs.model import ModelSpec
from ...core.plan import PlanRequest, VocabLever, plan
from ...core.plan.schedule import row_schedule
from ...core.sim.iteration import iteration_times

__all__ = ["RowChoice", "Emulation", "pick_rows", "compare"]


@dataclasses.dataclass(frozen=True)
class RowChoice:
    """The plan rows are chosen from: a GPU of ``gpu_memory_gb`` running at ``tflops`` x ``efficiency``
    (the rows' costs), the ``schedules`` plan weighs (None: its own), vocabulary parallelism with
    ``vocab_barriers`` barriers, plan on ``jobs`` processes."""

    gpu_memory_gb: float = 80.0
    schedules: Optional[Sequence[str]] = None
    vocab_barriers: int = 1
    tflops: float = 989.0
    efficiency: float = 0.5
    jobs: int = 1


@dataclasses.dataclass(frozen=True)
class Emulation:
    """How ``compare`` runs the rows besides their slow-down and timed iterations: ``warmup``
    iterations first, the launch's ``timeout`` (seconds), each row's last iteration as it ran kept
    (``timelines``)."""

    warmup: int = 1
    timeout: float = 600.0
    timelines: bool = True


def pick_rows(spec: ModelSpec, p: int, m: int, choice: Optional[RowChoice] = None) -> List[dict]:
    """[Megatron's 1F1B row (plan's layout search, no vocabulary parallelism), the best fitting row
    with vocabulary parallelism] from ``plan`` (its ranking: time per iteration, then memory)."""
    c = choice if choice is not None else RowChoice()
    rows = plan(PlanRequest(spec, p, m, c.gpu_memory_gb, tflops=c.tflops, efficiency=c.efficiency,
                            schedules=c.schedules, vocab=VocabLever("both", barriers=c.vocab_barriers)), jobs=c.jobs)
    ok = [r for r in rows if "error" not in r and r["fits"]]
    base = next((r for r in ok if r["schedule"] == "1f1b" and not r.get("vocab_parallel")), None)
    best = next((r for r in ok if r.get("vocab_parallel")), None)
    if base is None or best is None:
        raise ValueError("plan has no fitting 1f1b row or no fitting row with vocabulary parallelism")
    return [base, best]


def compare(spec: ModelSpec, p: int, m: int, slow_down: float = 3.0, iterations: int = 8,
            rows: Optional[List[dict]] = None, choice: Optional[RowChoice] = None,
            emulation: Optional[Emulation] = None) -> List[dict]:
    """Emulate ``rows`` (default ``pick_rows`` with ``choice``; their costs from ``choice``'s GPU) on
    ``p`` processes; one dict per row: label, schedule, layout, vocab_parallel, flags, per_iteration /
    measured (median) / predicted, in milliseconds of the GPU, error_pct, speedup_measured (median
    over the iterations of the first row's time over this row's, paired by index) /
    speedup_predicted, predicted_nominal (without the host costs) and handling_ms (a pass's, median),
    hop_ms, timeline (a ``SimResult`` of the last iteration as it ran, in ms) where
    ``emulation.timelines``."""
    from .emulate import emulate_schedules, host_costs

    if slow_down <= 0:
        raise ValueError(f"slow_down must be > 0, got {slow_down}")
    c = choice if choice is not None else RowChoice()
    e = emulation if emulation is not None else Emulation()
    timelines = e.timelines
    rows = rows or pick_rows(spec, p, m, c)
    request = PlanRequest(spec, p, m, 80.0, tflops=c.tflops, efficiency=c.efficiency)  # (the budget plays no part)
    pairs = [row_schedule(request, r) for r in rows]
    got = emulate_schedules(pairs, unit_s=slow_down, iterations=iterations, warmup=e.warmup, timeout=e.timeout,
                            timelines=timelines, interleave=True, profiles=True)
    hop, times, profiles = got[0], got[1], got[-1]
    out = []
    for k, (r, (sched, st)) in enumerate(zip(rows, pairs)):
        st = dataclasses.replace(st, cost_comm=hop)
        nominal = iteration_times(sched, st).iteration_time * 1e3
        pred = iteration_times(sched, host_costs(st, sched.placement, profiles[k], slow_down)).iteration_time * 1e3
        per = [t * 1e3 for t in times[k]]
        meas = statistics.median(per)
        vp = r.get("vocab_parallel")
        label = ("Megatron 1F1B" if r["schedule"] == "1f1b" and not vp else r["schedule"]) + \
            (f" + vocab-{vp}" if vp else "")
        row = {"label": label, "schedule": r["schedule"], "layout": r["layout"], "vocab_parallel": vp,
               "flags": r["flags"], "plan_ms": r["iteration_time_s"] * 1e3, "per_iteration": per, "measured": meas,
               "predicted": pred, "error_pct": 100.0 * (meas - pred) / pred, "predicted_nominal": nominal,
               "handling_ms": _handling_ms(profiles[k], slow_down), "hop_ms": hop * 1e3,
               "peak_gib": [x / 2 ** 30 for x in r["peak_bytes"]], "slow_down": slow_down}
        if timelines:
            tl = got[2][k]
            row["timeline"] = dataclasses.replace(
                tl, makespan=tl.makespan * 1e3, spans=[x * 1e3 for x in tl.spans], busy=[x * 1e3 for x in tl.busy],
                timeline=[[t._replace(start=t.start * 1e3, end=t.end * 1e3) for t in x]
                          for x in tl.timeline])
        out.append(row)
    base = out[0]
    for r in out:
        ratios = [b / x for b, x in zip(base["per_iteration"], r["per_iteration"])]
        r["speedup_measured"] = statistics.median(ratios)
        r["speedup_measured_range"] = [min(ratios), max(ratios)]
        r["speedup_predicted"] = base["predicted"] / r["predicted"]
    return out


def _handling_ms(profile: Optional[dict], slow_down: float) -> Optional[float]:
    """The median over model chunks and kinds of one pass's host costs (handling and interference),
    in the GPU's milliseconds (None where the profile measured none)."""
    from ...runtime.observe.profile_data import chunk_host_costs

    per_chunk = chunk_host_costs(profile) if profile else None
    if per_chunk is None:
        return None
    return statistics.median(x for k in ("f", "b", "w") for x in per_chunk[k]) / slow_down * 1e3
