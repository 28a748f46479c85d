"""Variable-length batches (issue 34): Megatron's 1F1B with sequential microbatches against
megatron-zb's per-microbatch schedules with the global batch balanced over the data-parallel
replicas, simulated, and measured with emulated compute on real processes.

    OMP_NUM_THREADS=1 python benchmarks/bench_varlen.py [--batches 8] [--emulate-batches 2]
        [--unit 0.25] [--no-emulate] [--out benchmarks/results/varlen.json]

Lengths (SFT-like, capped at 8192 tokens, the longer ones truncated as SFT pipelines do):

* ``lognormal``: median 1024 tokens, sigma 1.0;
* ``sharegpt``: the token lengths of the ShareGPT 90k conversations (a public dataset), as a
  histogram: ``SHAREGPT_HISTOGRAM`` below holds its numbers, read off the vector data of the CDF
  published in github.com/YitaoYuan/sharegpt-statistics (``conversation_len.pdf``: every
  conversation's length in LLaMA tokens, 0..10000 on its axis; 10.1% lie beyond 10000). Lengths are
  drawn bin by bin, uniformly inside a bin.

Costs: a Llama-3-8B-like stage at 4096 tokens (32 layers over P ranks; one H100 transformer layer
F 43.8, B 59.2, W 32.0 ms at h4096 s4096: ``benchmarks/results/fbw_h100_h4096_s4096.json``); the
attention share of F at 4096 tokens 0.133 and of B 0.235 (Q.K^T and scores.V against Llama-3-8B's
GEMMs); microbatches of one sequence (Megatron's variable-seq-lengths with micro-batch size 1).

Rows: per setting (P, D, sequences per global batch) and distribution, every schedule unbalanced
(Megatron's order: each replica the same number of microbatches, in the order the sequences come,
the schedule built for equal microbatches; ``1f1b`` is Megatron's 1F1B) and balanced (the balancer
and per-microbatch schedules): the mean simulated iteration (synchronous optimizer step: the
slowest replica), the speed-up over Megatron's 1F1B and over the same schedule unbalanced. Then
what planning costs: the balancer alone, one replica's microbatch order and schedule (what a
training rank computes for itself), one replica's build and lowering, against the iteration.

The batches go to ``results/varlen_lengths_<distribution>_<n>.txt`` too, for ``megatron-zb compare -p 8
--data-parallel-size 4 --seq-lengths ... --seq-length 4096 --cost-f 175.2 --cost-b 236.8 --cost-w 128
--attention-share 0.133,0.235`` gives the simulated rows.

Emulated (``--emulate-batches``): the rows that matter for the issue -- Megatron's 1F1B, the best
balanced row and the same schedule unbalanced -- run on P real processes (gloo p2p through
megatron-zb's runtime, every pass a wait of its cost x ``--unit`` ms), each replica's schedule in
turn; an iteration ends when the slowest replica's does (the gradient reduction waits for it), so
the measured iteration is the largest of the replicas' measured times. Compared with the simulator
timed with the measured one-way message time.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_zb.core.build import ScheduleRequest, build  # noqa: E402
from megatron_zb.core.ir import B, F  # noqa: E402
from megatron_zb.core.varlen.mb_schedule import end_time  # noqa: E402
from megatron_zb.core.costs.microbatch_costs import LengthModel  # noqa: E402
from megatron_zb.core.varlen.seqlens import format_seq_lengths  # noqa: E402
from megatron_zb.core.varlen.batch import Templates, VarlenConfig, assign, plan_batch, plan_replica  # noqa: E402

LAYER = {"F": 43.8, "B": 59.2, "W": 32.0}  # ms, one H100 transformer layer at h4096 s4096
LAYERS = 32
REF_TOKENS = 4096
MAX_TOKENS = 8192
ATTENTION = {F: 0.133, B: 0.235}
SCHEDULES = ["1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v"]
SETTINGS = [(8, 4, 128), (4, 2, 64)]  # P, D, sequences per global batch

# ShareGPT 90k conversation lengths (LLaMA tokens): (bin start, bin end, share of conversations)
SHAREGPT_HISTOGRAM = [
    (1, 64, 0.0314), (64, 128, 0.0370), (128, 256, 0.0558), (256, 512, 0.1204), (512, 768, 0.0899),
    (768, 1024, 0.0722), (1024, 1536, 0.1044), (1536, 2048, 0.0760), (2048, 3072, 0.1024),
    (3072, 4096, 0.0662), (4096, 6144, 0.0794), (6144, 8192, 0.0445), (8192, 10000, 0.0192),
    (10000, 16384, 0.1013),  # beyond the figure's axis: all truncated to MAX_TOKENS here
]


def draw(dist: str, n: int, seed: int):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if dist == "lognormal":
            s = int(round(rng.lognormvariate(math.log(1024), 1.0)))
        else:
            u, acc = rng.random(), 0.0
            total = sum(w for _, _, w in SHAREGPT_HISTOGRAM)
            for lo, hi, w in SHAREGPT_HISTOGRAM:
                acc += w / total
                if u <= acc:
                    break
            s = rng.randint(lo, hi - 1)
        out.append(max(16, min(MAX_TOKENS, s)))
    return out


def request(name: str, p: int) -> ScheduleRequest:
    per = LAYERS / p
    return ScheduleRequest(name, chunks=2 if name == "interleaved-1f1b" else None, cost_f=[LAYER["F"] * per],
                           cost_b=[LAYER["B"] * per], cost_w=[LAYER["W"] * per])


def model() -> LengthModel:
    return LengthModel(REF_TOKENS, ATTENTION)


def simulate_setting(p: int, d: int, n: int, dist: str, batches: int, schedules):
    cfg = VarlenConfig(d, model())
    data = [draw(dist, n, 1000 * k + 7) for k in range(batches)]
    rows, plans = [], {}
    for name in schedules:
        req = request(name, p)
        templates = Templates(req, p, n // d)
        for balanced in (False, True):
            its, walls = [], []
            for k, lengths in enumerate(data):
                t0 = time.process_time()  # CPU time: the box may be shared
                plan = plan_batch(lengths, req, p, cfg, balanced, templates)
                walls.append(time.process_time() - t0)
                its.append(plan.iteration_time)
                plans[(name, balanced, k)] = plan
            rows.append({"schedule": name, "balanced": balanced, "iteration_ms": statistics.mean(its),
                         "per_batch_ms": its, "plan_ms_per_batch": 1e3 * statistics.mean(walls[1:] or walls),
                         "microbatches_per_replica": [[r.num_microbatches for r in plans[(name, balanced, k)].replicas]
                                                      for k in range(len(data))]})
    base = next(r for r in rows if r["schedule"] == "1f1b" and not r["balanced"])
    unbal = {r["schedule"]: r for r in rows if not r["balanced"]}
    for r in rows:
        r["speedup_vs_megatron_1f1b"] = base["iteration_ms"] / r["iteration_ms"]
        r["speedup_vs_unbalanced"] = unbal[r["schedule"]]["iteration_ms"] / r["iteration_ms"]
    return data, rows, plans


def planning_costs(p: int, d: int, data, name: str, repeats: int = 3):
    """What re-planning one iteration costs a training rank (CPU ms of this process; the box may be
    shared): the balancer, its replica's microbatch order and schedule, the schedule's build
    (validation) and lowering -- a rank runs all of them for its own replica; the dearest replica
    counts. Each batch planned ``repeats`` times, the least CPU time kept (``first``: the first
    round's, where a microbatch count not seen before builds its template)."""
    req = request(name, p)
    cfg = VarlenConfig(d, model())
    templates = Templates(req, p, len(data[0]) // d)
    sched, base = templates.build(name, templates.reference_m)  # the reference template: once per run
    templates.caps(name)
    weights = {k: max(base.rank_values(n, sched.placement)) for k, n in (("F", "cost_f"), ("B", "cost_b"),
                                                                          ("W", "cost_w"))}
    keys = ("balancer", "replica_schedule", "build_and_lower")
    rounds = []
    for _ in range(repeats):
        per_batch = []
        for lengths in data:
            t0 = time.process_time()
            groups = assign(lengths, cfg, weights, p, True)
            row = {"balancer": time.process_time() - t0, "replica_schedule": 0.0, "build_and_lower": 0.0}
            worst = -1.0
            for r in range(d):
                lens = [[lengths[i] for i in mb] for mb in groups[r]]
                t0 = time.process_time()
                rp = plan_replica(name, templates, cfg.model, lens, groups[r], cfg.packed, True)
                t1 = time.process_time()
                build(req, p, rp.num_microbatches, base=rp.schedule).lowered()
                t2 = time.process_time()
                if t2 - t0 > worst:
                    worst, row["replica_schedule"], row["build_and_lower"] = t2 - t0, t1 - t0, t2 - t1
            per_batch.append({k: 1e3 * v for k, v in row.items()})
        rounds.append(per_batch)
    best = [{k: min(rd[b][k] for rd in rounds) for k in keys} for b in range(len(data))]
    res = {k: {"mean": statistics.mean(x[k] for x in best), "max": max(x[k] for x in best)} for k in keys}
    total = [sum(x.values()) for x in best]
    res["total"] = {"mean": statistics.mean(total), "max": max(total)}
    first = [sum(x.values()) for x in rounds[0]]
    res["first"] = {"mean": statistics.mean(first), "max": max(first)}
    return res


def emulate_rows(p: int, plans, picks, batches: int, unit: float, iterations: int):
    from megatron_zb.verify.timing.emulate import emulate_schedules
    pairs, index = [], []
    for name, balanced in picks:
        for k in range(batches):
            for d, rp in enumerate(plans[(name, balanced, k)].replicas):
                pairs.append((rp.schedule, rp.setting))
                index.append((name, balanced, k, d))
    hop, times = emulate_schedules(pairs, unit_s=unit * 1e-3, iterations=iterations)
    out = {}
    for (name, balanced, k, d), ts, (sched, st) in zip(index, times, pairs):
        import dataclasses
        pred = end_time(sched, dataclasses.replace(st, cost_comm=hop))
        e = out.setdefault((name, balanced, k), {"measured": [], "predicted": []})
        e["measured"].append(statistics.median(ts))
        e["predicted"].append(pred)
    rows = []
    for (name, balanced), in [((n, b),) for n, b in picks]:
        meas = [max(out[(name, balanced, k)]["measured"]) for k in range(batches)]
        pred = [max(out[(name, balanced, k)]["predicted"]) for k in range(batches)]
        rows.append({"schedule": name, "balanced": balanced, "measured_ms": statistics.mean(meas),
                     "simulated_ms": statistics.mean(pred), "hop_ms": hop,
                     "error_pct": 100.0 * (statistics.mean(meas) / statistics.mean(pred) - 1)})
    base = next(r for r in rows if r["schedule"] == "1f1b" and not r["balanced"])
    for r in rows:
        r["speedup_measured"] = base["measured_ms"] / r["measured_ms"]
        r["speedup_simulated"] = base["simulated_ms"] / r["simulated_ms"]
    return rows


def figures(out_dir: str, plans, dist: str, best: str):
    """Timelines of batch 0's slowest replica (``megatron_zb.plot``), one PNG per row picked."""
    from megatron_zb.core.sim.simulate import simulate
    from megatron_zb.plot import plot_timeline
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, balanced in (("1f1b", False), (best, False), (best, True)):
        plan = plans[(name, balanced, 0)]
        rp = max(plan.replicas, key=lambda r: r.end)
        tag = "balanced" if balanced else "unbalanced"
        path = os.path.join(out_dir, f"varlen_{dist}_{name}_{tag}.png")
        plot_timeline(simulate(rp.schedule, rp.setting), path,
                      title=f"{name} {tag}, {dist} lengths: the slowest of 4 replicas, {rp.num_microbatches} "
                            f"microbatches, iteration {plan.iteration_time / 1e3:.1f} s")
        paths.append(path)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, default=8, help="global batches per distribution (simulated)")
    ap.add_argument("--emulate-batches", type=int, default=2, help="of those, emulated on real processes")
    ap.add_argument("--unit", type=float, default=0.25, help="emulation: wall ms per cost ms (default 0.25)")
    ap.add_argument("--iterations", type=int, default=2, help="emulation: timed iterations per schedule")
    ap.add_argument("--no-emulate", action="store_true")
    ap.add_argument("--figures", default=None, metavar="DIR",
                    help="write timelines (PNG) of batch 0's slowest replica at P=8 D=4: Megatron's 1F1B, the best "
                         "schedule unbalanced and balanced")
    ap.add_argument("--schedules", nargs="+", default=SCHEDULES)
    ap.add_argument("--distributions", nargs="+", default=["lognormal", "sharegpt"], choices=["lognormal", "sharegpt"])
    ap.add_argument("--settings", nargs="+", default=[f"{p}x{d}" for p, d, _ in SETTINGS],
                    choices=[f"{p}x{d}" for p, d, _ in SETTINGS], help="PxD settings to run")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "varlen.json"))
    a = ap.parse_args(argv)
    report = {"host": platform.node(), "python": platform.python_version(), "layer_ms": LAYER, "layers": LAYERS,
              "reference_tokens": REF_TOKENS, "max_tokens": MAX_TOKENS, "attention_share": ATTENTION,
              "sharegpt_histogram": SHAREGPT_HISTOGRAM, "settings": [],
              "emulation": {"unit_wall_ms_per_cost_ms": a.unit, "iterations": a.iterations,
                            "batches": a.emulate_batches, "load_average_at_start": os.getloadavg()}}
    for p, d, n in [x for x in SETTINGS if f"{x[0]}x{x[1]}" in a.settings]:
        for dist in a.distributions:
            data, rows, plans = simulate_setting(p, d, n, dist, a.batches, a.schedules)
            lens = [s for b in data for s in b]
            lengths_file = os.path.join(os.path.dirname(a.out), f"varlen_lengths_{dist}_{n}.txt")
            with open(lengths_file, "w") as f:  # the same batches for `megatron-zb compare --seq-lengths`
                f.write(f"# bench_varlen.py: {a.batches} global batches of {n} {dist} sequence lengths\n")
                f.write(format_seq_lengths(data))
            print(f"\n== P={p} D={d}, {n} sequences per global batch, {dist} lengths (median "
                  f"{statistics.median(lens):.0f}, mean {statistics.mean(lens):.0f}, max {max(lens)}), "
                  f"{a.batches} batches, simulated ==")
            print(f"{'schedule':<18} {'balanced':>8} {'iteration ms':>13} {'vs Megatron 1F1B':>17} "
                  f"{'vs unbalanced':>14} {'plan CPU ms':>12}  microbatches per replica (batch 0)")
            for r in sorted(rows, key=lambda r: r["iteration_ms"]):
                print(f"{r['schedule']:<18} {('yes' if r['balanced'] else 'no'):>8} {r['iteration_ms']:>13.1f} "
                      f"{r['speedup_vs_megatron_1f1b']:>16.3f}x {r['speedup_vs_unbalanced']:>13.3f}x "
                      f"{r['plan_ms_per_batch']:>12.1f}  {r['microbatches_per_replica'][0]}")
            best = min((r for r in rows if r["balanced"]), key=lambda r: r["iteration_ms"])
            cost = planning_costs(p, d, data, best["schedule"])
            it = best["iteration_ms"]
            cpu = cost["total"]["mean"]
            print(f"re-planning one iteration for {best['schedule']} (a rank: the balancer, then its replica's order, "
                  f"schedule, build and lowering; the dearest replica), CPU ms mean/max: balancer "
                  f"{cost['balancer']['mean']:.1f}/{cost['balancer']['max']:.1f}, replica order + schedule "
                  f"{cost['replica_schedule']['mean']:.1f}/{cost['replica_schedule']['max']:.1f}, build + lowering "
                  f"{cost['build_and_lower']['mean']:.1f}/{cost['build_and_lower']['max']:.1f}; in all {cpu:.1f}/"
                  f"{cost['total']['max']:.1f} ms = {100 * cpu / it:.2f}%/{100 * cost['total']['max'] / it:.2f}% of its "
                  f"{it:.0f} ms iteration (first time, new microbatch counts' templates included: "
                  f"{cost['first']['mean']:.1f}/{cost['first']['max']:.1f} ms)")
            entry = {"stages": p, "data_parallel_size": d, "sequences": n, "distribution": dist, "rows": rows,
                     "lengths_file": os.path.relpath(lengths_file, os.path.dirname(os.path.dirname(a.out))),
                     "planning_ms": cost, "best_balanced": best["schedule"]}
            if a.figures and (p, d) == SETTINGS[0][:2]:
                entry["figures"] = figures(a.figures, plans, dist, best["schedule"])
                print("figures: " + ", ".join(entry["figures"]))
            if not a.no_emulate and a.emulate_batches > 0 and (p, d) == SETTINGS[0][:2]:
                picks = [("1f1b", False), (best["schedule"], False), (best["schedule"], True)]
                em = emulate_rows(p, plans, picks, min(a.emulate_batches, a.batches), a.unit, a.iterations)
                print(f"emulated on {p} real processes ({min(a.emulate_batches, a.batches)} batches, each replica in "
                      f"turn, pass waits x{a.unit}; one-way hop {em[0]['hop_ms']:.3f} ms):")
                for r in em:
                    print(f"  {r['schedule']:<16} {('balanced' if r['balanced'] else 'unbalanced'):>10}: measured "
                          f"{r['measured_ms']:.1f} ms, simulated {r['simulated_ms']:.1f} ms ({r['error_pct']:+.1f}%); "
                          f"speed-up over Megatron 1F1B {r['speedup_measured']:.3f}x measured, "
                          f"{r['speedup_simulated']:.3f}x simulated")
                entry["emulated"] = em
            report["settings"].append(entry)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
