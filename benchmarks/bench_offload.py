"""Activation offload in the simulator: per schedule and offload ratio, the simulated time and the
peak activation memory (docs/offload.md has the table).

    python benchmarks/bench_offload.py                      # p=8, m=32, unit costs, K 0.5 and 1
    python benchmarks/bench_offload.py --stages 4 --microbatches 16 --offload-time 0.25 0.5

Memory is in units of one microbatch's stage activation (mem-f = 1, mem-w = 0.5); time in units
of F. ``time +%`` is the makespan over the same schedule without offload; ``peak/base`` the peak
activation (max over ranks) over the same without offload; ``act. off`` / ``W off`` the parts
offloaded (all ranks); ``link busy`` the busiest copy queue's busy time over the makespan. Pure Python (the schedule core).
Writes benchmarks/results/offload.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_zb.core.ir import Setting  # noqa: E402
from megatron_zb.core.sim.hostlink import OffloadOptions  # noqa: E402
from megatron_zb.core.passes.offload import add_offload  # noqa: E402
from megatron_zb.core.schedules import generate, get  # noqa: E402
from megatron_zb.core.sim.simulate import simulate  # noqa: E402

SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min")
RATIOS = (0.0, 0.25, 0.5, 0.75, 1.0)


def row(name, p, m, ratio, k, overlap, costs):
    spec = get(name)
    st = Setting(p, m, chunks=spec.resolve_chunks(None), **costs)
    base_sched = generate(name, st)
    base = simulate(base_sched, st)
    t0 = time.perf_counter()
    sched = add_offload(base_sched, st, OffloadOptions(ratio=ratio, time=k, overlap=overlap))
    plan_s = time.perf_counter() - t0
    res = simulate(sched, st)
    o = res.offload.to_dict()
    return {"schedule": name, "stages": p, "microbatches": m, "ratio": ratio, "offload_time": k,
            "duplex": "full" if overlap else "half", "makespan": res.makespan, "makespan_base": base.makespan,
            "time_increase": res.makespan / base.makespan - 1.0, "peak": max(res.peak_memory),
            "peak_base": max(base.peak_memory), "peak_ratio": max(res.peak_memory) / max(base.peak_memory),
            "peak_per_rank": res.peak_memory, "offloaded": o["offloaded"], "offloaded_w": o["offloaded_w"],
            "link_busy_max": max(o["link_busy_d2h"] + o["link_busy_h2d"]) / res.makespan if overlap
            else max(o["link_busy"]) / res.makespan, "stall": sum(o["stall"]),
            "planning_s": round(plan_s, 3)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=32)
    ap.add_argument("--offload-time", type=float, nargs="+", default=[0.5, 1.0])
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    ap.add_argument("--cost-f", type=float, default=1.0)
    ap.add_argument("--cost-b", type=float, default=1.0)
    ap.add_argument("--cost-w", type=float, default=1.0)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "offload.json"))
    a = ap.parse_args(argv)
    costs = dict(cost_f=[a.cost_f], cost_b=[a.cost_b], cost_w=[a.cost_w])
    rows = []
    hdr = (f"{'schedule':<17} {'K':>4} {'link':>4} {'ratio':>5} {'makespan':>9} {'time +%':>8} {'peak':>6} "
           f"{'base':>6} {'peak/base':>9} {'act. off':>8} {'W off':>6} {'link busy':>9}")
    print(f"p={a.stages} m={a.microbatches} F={a.cost_f:g} B={a.cost_b:g} W={a.cost_w:g}; memory in microbatch "
          "stage activations (mem-w 0.5), peak = max over ranks")
    print(hdr)
    print("-" * len(hdr))
    for k in a.offload_time:
        for name in a.schedules:
            for ratio in RATIOS:
                r = row(name, a.stages, a.microbatches, ratio, k, True, costs)
                rows.append(r)
                _print(r)
            r = row(name, a.stages, a.microbatches, 1.0, k, False, costs)  # one copy stream
            rows.append(r)
            _print(r)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"command": "python benchmarks/bench_offload.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                   "stages": a.stages, "microbatches": a.microbatches, "costs": costs, "mem_w_ratio": 0.5,
                   "rows": rows}, f, indent=1)
    print(f"wrote {a.out}")


def _print(r):
    print(f"{r['schedule']:<17} {r['offload_time']:>4g} {r['duplex']:>4} {r['ratio']:>5g} {r['makespan']:>9g} "
          f"{100 * r['time_increase']:>7.2f}% {r['peak']:>6g} {r['peak_base']:>6g} {r['peak_ratio']:>9.3f} "
          f"{sum(r['offloaded']):>8} {sum(r['offloaded_w']):>6} {100 * r['link_busy_max']:>8.0f}%")


if __name__ == "__main__":
    main()
