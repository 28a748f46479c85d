"""Where a real-compute iteration's time goes, per rank, beside the simulator (issue 53 item 2).

    OMP_NUM_THREADS=1 python benchmarks/bench_attribution.py [--rounds 3] [--iters 10]
        [--schedules megatron 1f1b zb-h1 zb-v] [--out benchmarks/results/attribution_cpu.json]

The quickstart's real-compute run (``scripts/quickstart_report.py``'s REAL_MODEL: a GPT of 8 layers,
hidden 256, sequence 256, vocabulary 7168, on 2 pipeline ranks, each a gloo process on its own core,
8 microbatches, fp32, each schedule with the layout plan picks for it) trained by Megatron's own 1F1B
(no megatron-zb flag) and by megatron-zb's 1f1b, zb-h1 and zb-v, in interleaved rounds, each run
through ``benchmarks/attribution_rank.py``: megatron-zb's entry point with every place an iteration
spends its time timed (exclusive times that add up to the iteration). megatron-zb's runs are
profiled in iterations 2-4 (``--zero-bubble-profile-window 2 4``); the iterations from ``TIMED_FROM``
on are attributed. Per run and rank the median over those iterations of

  compute     Megatron's forward_step and backward_step, and W passes (the W queue run)
  waits       blocked on a message (megatron-zb: the receive's wait; Megatron: its requests' wait)
  messages    posting sends and receives, reaping finished sends (gloo's calls)
  executor    megatron-zb's executor between and around passes, its passes' glue, building the call;
              Megatron's 1F1B: its own loop between passes
  hooks       megatron-zb's hook points (progress, gradient sync, profiler and memory meter in the window)
  step        the rest of Megatron's iteration: finalize_model_grads, the optimizer step, zeroing
  gc          Python's cyclic collector
  off core    the time the rank was runnable while another thread or process held its core

and beside them the simulation of the same schedule with that run's profile and its host costs
(Megatron's own 1F1B: megatron-zb's 1f1b profile of the same round, fused backwards measured): each
rank's compute, its idle time (waits) and the step (the profile's gap between two forward-backward
calls); also without the host costs, Megatron's own 1F1B as zb-h1's profile timed it (split B and W,
medians), and a replay of each schedule with every pass's duration drawn from its window samples
against the same replay at their means (what the spread of pass durations adds). Per table cell: the
median over the rounds. Then each pass kind per stage (the median per pass, timed iterations, median
over rounds) beside Megatron's own pass on that stage and the profile's median for it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from benchmarks.attribution_sim import GROUPS, group_times, jitter, pass_table, simulated_ranks  # noqa: E402

TIMED_FROM = 5
SCHEDULES = ["megatron", "1f1b", "zb-h1", "zb-v"]
ENV = dict(PP="2", NUM_LAYERS="8", HIDDEN="256", HEADS="4", SEQ_LEN="256", MBS="1", GBS="8", VOCAB="7168",
           LOG_INTERVAL="1", PREFLIGHT="0", OMP_NUM_THREADS="1", FORCE_CPU="1")
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*elapsed time per iteration \(ms\): ([\d.]+)")


def layouts():
    """The layout plan picks for each schedule (Megatron's own 1F1B: 1f1b's), as the quickstart runs them."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from quickstart_report import REAL_MODEL
    from megatron_zb.core.plan import ModelSpec, plan
    rows = plan(ModelSpec(**REAL_MODEL), 2, 8, 80.0, schedules=["1f1b", "zb-h1", "zb-v"], jobs=1)
    got = {r["schedule"]: r["layout"] for r in rows if "layout" in r}
    got["megatron"] = got["1f1b"]
    return got


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(schedule, layout, iters, profile):
    """The training command pretrain_gpt_zb.sh would run, with attribution_rank.py as the entry point."""
    extra = f"--zero-bubble-deterministic-init --pipeline-model-parallel-layout {layout}"
    if profile:
        extra += f" --zero-bubble-profile-window 2 4 --zero-bubble-profile-path {profile}"
    env = dict(os.environ, SCHEDULE=schedule, ITERS=str(iters), EXTRA_ARGS=extra, DRY_RUN="1",
               MASTER_PORT=str(free_port()), **ENV)
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "pretrain_gpt_zb.sh")], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    argv = shlex.split(out)
    i = argv.index("megatron_zb.megatron.pretrain_gpt")
    return argv[:i - 1] + [os.path.join(ROOT, "benchmarks", "attribution_rank.py")] + argv[i + 1:]


def run(schedule, layout, iters, work, tag):
    """One training run; returns (the ranks' records, the profile or None, Megatron's logged ms per
    timed iteration, wall seconds)."""
    d = os.path.join(work, tag)
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):
        os.remove(os.path.join(d, f))
    profile = os.path.join(d, "profile.json") if schedule != "megatron" else None
    argv = command(schedule, layout, iters, profile)
    mcore = os.path.join(ROOT, ".venv", "mcore-0.19.2")
    env = dict(os.environ, MZB_ATTRIBUTION_OUT=d, PYTHONPATH=f"{mcore}:{ROOT}", CUDA_VISIBLE_DEVICES="", **ENV)
    t0 = time.time()
    with open(os.path.join(d, "train.log"), "w") as log:
        p = subprocess.run(argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        raise SystemExit(f"bench_attribution: run {tag} failed (exit {p.returncode}); see {d}/train.log")
    ranks = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(2)]
    logged = [float(m.group(2)) for line in open(os.path.join(d, "train.log"), errors="replace")
              for m in [LINE.search(line)] if m and int(m.group(1)) >= TIMED_FROM]
    return ranks, (json.load(open(profile)) if profile else None), logged, time.time() - t0


def measured_ranks(ranks):
    """Per rank: the median over the timed iterations of each group's seconds and of the iteration (a
    busy host's other processes make some iterations' figures jump: the medians are the typical
    iteration's; they need not add up exactly)."""
    out = []
    for rk in ranks:
        its = [it for it in rk["iterations"] if it["iteration"] >= TIMED_FROM]
        groups = [group_times(it["exclusive"]) for it in its]
        row = {g: statistics.median(x[g] for x in groups) for g in GROUPS}
        row["iteration"] = statistics.median(it["seconds"] for it in its)
        row["off_core"] = statistics.median(it.get("run_delay_s", 0.0) for it in its)
        row["cpu"] = statistics.median(it.get("cpu_s", 0.0) for it in its)
        row["calls"] = {k: statistics.median(it.get("calls", {}).get(k, 0) for it in its)
                        for k in its[0].get("calls", {})}
        out.append(row)
    return out


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _median_rows(rows_per_round):
    """The median over rounds of each rank's numbers."""
    n = len(rows_per_round[0])
    return [{k: _med([rr[r][k] for rr in rows_per_round]) for k in rows_per_round[0][r] if k != "calls"}
            for r in range(n)]


def print_table(label, meas, sim):
    print(f"\n{label}: ms per iteration, per rank (median over the timed iterations, median over rounds)")
    head = "".join(f"{g:>10}" for g in GROUPS)
    print(f"{'':<16}{'iteration':>10}{head}{'off core':>10}")
    for r, (m, s) in enumerate(zip(meas, sim or [None] * len(meas))):
        print(f"{'rank ' + str(r) + ' measured':<16}{1e3 * m['iteration']:>10.1f}"
              + "".join(f"{1e3 * m[g]:>10.1f}" for g in GROUPS) + f"{1e3 * m['off_core']:>10.1f}")
        if s:
            print(f"{'  simulated':<16}{1e3 * s['iteration']:>10.1f}"
                  + "".join(f"{1e3 * s[g]:>10.1f}" if s.get(g) is not None else f"{'-':>10}" for g in GROUPS))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--schedules", nargs="+", default=SCHEDULES)
    ap.add_argument("--work", default="/tmp/mzb_bench_attribution")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "attribution_cpu.json"))
    args = ap.parse_args(argv)
    bad = [s for s in args.schedules if s not in SCHEDULES]
    if args.rounds < 1 or args.iters <= TIMED_FROM or bad or "megatron" in args.schedules and "1f1b" not in args.schedules:
        print(f"bench_attribution: need --rounds >= 1, --iters > {TIMED_FROM}, schedules among {SCHEDULES} "
              "(megatron needs 1f1b: its simulation takes 1f1b's profile)", file=sys.stderr)
        return 2
    lay = layouts()
    runs = {s: [] for s in args.schedules}
    loads = [os.getloadavg()[0]]
    t0 = time.time()
    for rnd in range(1, args.rounds + 1):
        for s in args.schedules:
            ranks, prof, logged, secs = run(s, lay[s], args.iters, args.work, f"{s}_r{rnd}")
            runs[s].append({"ranks": ranks, "profile": prof, "logged": logged})
            loads.append(os.getloadavg()[0])
            print(f"round {rnd}: {s:<9} {statistics.median(logged):8.1f} ms per iteration (Megatron's log, "
                  f"median from iteration {TIMED_FROM}; {secs:.0f} s; load {loads[-1]:.2f})", flush=True)
    result = {"schedules": {}, "model": "quickstart REAL_MODEL", "pp": 2, "microbatches": 8, "layouts": lay,
              "rounds": args.rounds, "iters": args.iters, "timed_from": TIMED_FROM}
    for s in args.schedules:
        meas = _median_rows([measured_ranks(x["ranks"]) for x in runs[s]])
        src = "1f1b" if s == "megatron" else s
        sims = [simulated_ranks(x["profile"]) for x in runs[src]]
        bare = [simulated_ranks(x["profile"], handling=False) for x in runs[src]]
        jit = [jitter(x) for x in runs[src]]
        row = {"layout": lay[s], "measured": meas, "simulated": _median_rows(sims),
               "simulated_without_host_costs": _median_rows(bare), "simulated_from": f"{src}'s profile",
               "logged_rounds_ms": [statistics.median(x["logged"]) for x in runs[s]],
               "measured_rounds_ms": [1e3 * measured_ranks(x["ranks"])[0]["iteration"] for x in runs[s]],
               "simulated_rounds_ms": [1e3 * x[0]["iteration"] for x in sims],
               "jitter_factor": _med([j["jitter_factor"] for j in jit]),
               "message_calls": [_med([measured_ranks(x["ranks"])[r]["calls"].get("p2p_post", 0) for x in runs[s]])
                                 for r in (0, 1)]}
        if s == "megatron" and runs.get("zb-h1"):  # the prediction before: zb-h1's profile, medians alone
            row["simulated_from_zb_h1_medians"] = _median_rows(
                [simulated_ranks(dict(x["profile"], built_schedule=runs["1f1b"][i]["profile"]["built_schedule"]),
                                 handling=False) for i, x in enumerate(runs["zb-h1"])])
        result["schedules"][s] = row
        print_table("Megatron's own 1F1B" if s == "megatron" else f"megatron-zb {s}", meas, row["simulated"])
        print(f"  simulated without host costs {1e3 * row['simulated_without_host_costs'][0]['iteration']:.1f} ms; "
              f"pass durations drawn from the window, replayed: x{row['jitter_factor']:.3f} the mean-duration replay")
    passes = pass_table({s: runs[s] for s in args.schedules}, TIMED_FROM)
    result["passes"] = passes
    print("\nper pass (ms, median per pass over the timed iterations, median over rounds; profile: what the "
          "simulator is given)")
    for row in passes:
        print(f"  {row['schedule']:<9} stage {row['stage']} {row['kind']:<3} {row['measured_ms']:>8.2f}"
              + (f"  profile {row['profile_ms']:>8.2f}" if row.get("profile_ms") is not None else "")
              + (f"  Megatron {row['megatron_ms']:>8.2f} ({row['vs_megatron_pct']:+.1f}%)"
                 if row.get("megatron_ms") is not None else ""))
    result.update(command=f"python benchmarks/bench_attribution.py --rounds {args.rounds} --iters {args.iters}"
                  + ("" if args.schedules == SCHEDULES else " --schedules " + " ".join(args.schedules)),
                  host=platform.node(), cpus=os.cpu_count(), load_average=[min(loads), max(loads)],
                  seconds=time.time() - t0)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
