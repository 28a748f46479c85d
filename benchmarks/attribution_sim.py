"""``bench_attribution.py``'s arithmetic: the recorded names grouped, the simulation of a profiled run
per rank, and the pass-for-pass table (no processes, no clocks)."""
from __future__ import annotations

import json
import statistics
from collections import defaultdict

from megatron_zb.core.ir import io as sched_io
from megatron_zb.core.ir import Setting
from megatron_zb.core.sim.iteration import iteration_times
from megatron_zb.core.sim.simulate import simulate

__all__ = ["GROUPS", "NAMES", "group_times", "simulated_ranks", "pass_table", "profile_setting", "jitter"]

# each group of the table and the recorded names (``attribution_rank``) it adds up
NAMES = {
    "compute": ("forward_step", "backward_step", "w"),
    "waits": ("p2p_wait",),
    "messages": ("p2p_post",),
    "executor": ("execute", "step", "glue", "fb"),
    "hooks": ("hooks",),
    "step": ("train_step", "finalize"),
    "gc": ("gc",),
}
GROUPS = tuple(NAMES)


def group_times(exclusive: dict) -> dict:
    """Seconds per group from one iteration's exclusive seconds per recorded name."""
    known = {n for names in NAMES.values() for n in names}
    out = {g: sum(exclusive.get(n, 0.0) for n in names) for g, names in NAMES.items()}
    out["executor"] += sum(v for k, v in exclusive.items() if k not in known)  # nothing else is expected
    return out


def profile_setting(prof: dict, handling: bool = True) -> tuple:
    """(the schedule that ran, the Setting of its profile: each chunk's profiled costs, the fused backward
    where the run measured one, the message time; ``handling``: each pass's handling added, where the
    profile measured it)."""
    from megatron_zb.runtime.observe.profile_data import profile_to_setting_kwargs
    sched = sched_io.from_json(json.dumps(prof["built_schedule"]))
    kw = profile_to_setting_kwargs(prof, per_chunk=True, host_costs=handling)
    kw = {k: v for k, v in kw.items() if k in ("cost_f", "cost_b", "cost_w", "cost_bw", "cost_comm")}
    return sched, Setting(prof["pipeline_size"], prof["microbatches"], chunks=sched.placement.chunks, **kw)


def simulated_ranks(prof: dict, handling: bool = True) -> list:
    """Per rank of the simulated iteration (seconds): the iteration with Megatron's synchronous step (the
    profile's time between two forward-backward calls), the rank's compute (with each pass's handling where
    ``handling``), its idle time (waits) and the step. The simulator has no message handling, executor or
    hooks of its own: those cells are None."""
    sched, st = profile_setting(prof, handling)
    step = prof.get("between_iterations_s") or 0.0
    res = simulate(sched, st)
    total = iteration_times(sched, st, step).iteration_time
    return [{"iteration": total, "compute": busy, "waits": total - busy - step, "messages": None,
             "executor": None, "hooks": None, "step": step, "gc": None} for busy in res.busy]


def _per_pass(run, timed_from: int) -> dict:
    """(kind, stage) -> the median seconds of one pass over the run's timed iterations (Megatron's own
    loop records no stage: its rank's, one chunk per rank)."""
    got = defaultdict(list)
    for r, rank in enumerate(run["ranks"]):
        for it, kind, stage, mb, secs, *_ in rank["passes"]:
            if it >= timed_from:
                got[(kind, r if stage < 0 else stage)].append(secs)
    return {k: statistics.median(v) for k, v in got.items()}


def _profile_costs(prof) -> dict:
    out = {}
    for c in (prof or {}).get("per_chunk", []):
        for kind, key in (("F", "f"), ("B", "b"), ("W", "w"), ("BW", "bw")):
            if c.get(key) is not None:
                out[(kind, c["stage"])] = c[key]
    return out


def pass_table(runs: dict, timed_from: int) -> list:
    """Rows (schedule, stage, kind, measured_ms, profile_ms, megatron_ms, vs_megatron_pct): each pass
    kind per stage, the median over rounds of its median per pass; beside it the profile's cost (median
    over rounds) and, where Megatron's own 1F1B ran the same stage (one chunk per rank), its pass
    (BW beside a fused BW and beside B+W)."""
    meds = {}
    for s, rs in runs.items():
        per = [_per_pass(x, timed_from) for x in rs]
        profs = [_profile_costs(x["profile"]) for x in rs]
        keys = sorted(set().union(*per), key=lambda k: (k[1], ["F", "B", "W", "BW"].index(k[0])))
        meds[s] = {k: (statistics.median([p[k] for p in per if k in p]),
                       statistics.median([p[k] for p in profs if k in p]) if any(k in p for p in profs) else None)
                   for k in keys}
        for stage in {k[1] for k in keys}:
            if ("B", stage) in meds[s] and ("W", stage) in meds[s]:
                b, w = meds[s][("B", stage)], meds[s][("W", stage)]
                meds[s][("B+W", stage)] = (b[0] + w[0], b[1] + w[1] if b[1] is not None and w[1] is not None else None)
    base = meds.get("megatron", {})
    rows = []
    for s, m in meds.items():
        for (kind, stage), (x, prof) in m.items():
            ref = base.get(("BW" if kind in ("BW", "B+W") else kind, stage)) if s != "megatron" and s != "zb-v" else None
            row = {"schedule": s, "stage": stage, "kind": kind, "measured_ms": 1e3 * x,
                   "profile_ms": 1e3 * prof if prof is not None else None}
            if ref is not None:
                row["megatron_ms"] = 1e3 * ref[0]
                row["vs_megatron_pct"] = 100.0 * (x / ref[0] - 1.0)
            rows.append(row)
    return rows


def _replay(sched, durations, comm: float) -> float:
    """The span of one iteration of ``sched`` (its compute passes in each rank's order) with the given
    duration per pass ((kind, stage, mb) -> s): each pass starts when its rank's previous pass ended and
    its input is there (``comm`` later where it comes from another rank); the simulator's rules."""
    pl = sched.placement
    orders = [[a for a in o if a.kind in ("F", "B", "BW", "W")] for o in sched.orders]
    end, pos, clock = {}, [0] * len(orders), [0.0] * len(orders)
    left = sum(map(len, orders))
    while left:
        moved = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                a = order[pos[r]]
                if a.kind == "F":
                    dep = ("F", pl.prev_stage(a.stage)) if not pl.is_first(a.stage) else None
                elif a.kind == "W":
                    dep = ("B", a.stage)
                else:
                    dep = ("F", a.stage) if pl.is_last(a.stage) else ("B", pl.next_stage(a.stage))
                start = clock[r]
                if dep is not None:
                    t = end.get((dep[0], dep[1], a.mb))
                    if t is None:
                        break
                    start = max(start, t + (comm if pl.rank_of(dep[1]) != r else 0.0))
                clock[r] = start + durations[(a.kind, a.stage, a.mb)]
                end[("B" if a.kind == "BW" else a.kind, a.stage, a.mb)] = clock[r]
                pos[r] += 1
                left -= 1
                moved = True
        if not moved:
            raise ValueError("replay: the order deadlocks")
    return max(clock)


def jitter(run: dict, window=(2, 4), draws: int = 200, seed: int = 0) -> dict:
    """The machine's jitter as one run's profile window saw it: each pass of the schedule that ran drawn
    from the durations its kind and stage had in the window (the attribution's per-pass records), plus
    its host costs' handling, replayed ``draws`` times; beside it the same replay with every pass at its
    mean duration. Their ratio is what the spread of pass durations adds to a schedule's iteration (a
    stall on one rank delays the other where no bubble absorbs it), which no per-pass cost can carry."""
    import random
    prof = run["profile"]
    sched = sched_io.from_json(json.dumps(prof["built_schedule"]))
    samples = defaultdict(list)
    for r, rank in enumerate(run["ranks"]):
        for it, kind, stage, mb, secs, *_ in rank["passes"]:
            if window[0] <= it <= window[1]:
                samples[(kind, r if stage < 0 else stage)].append(secs)
    lg = sched.placement.logical
    hand = {k: prof.get(f"chunk_handling_{k.lower()}") or [0.0] * len(prof["chunk_cost_f"]) for k in ("F", "B", "W", "BW")}
    passes = [(a.kind, a.stage, a.mb) for o in sched.orders for a in o if a.kind in ("F", "B", "BW", "W")]
    comm, step = prof.get("cost_comm") or 0.0, prof.get("between_iterations_s") or 0.0
    mean = {p: statistics.fmean(samples[p[:2]]) + hand[p[0]][lg(p[1])] for p in passes}
    rng = random.Random(seed)
    spans = sorted(_replay(sched, {p: rng.choice(samples[p[:2]]) + hand[p[0]][lg(p[1])] for p in passes}, comm)
                   for _ in range(draws))
    at_mean = _replay(sched, mean, comm)
    return {"replay_mean_durations_s": at_mean + step, "replay_drawn_median_s": statistics.median(spans) + step,
            "jitter_factor": (statistics.median(spans) + step) / (at_mean + step), "draws": draws}
