"""How far the automatic schedulers are from optimal on small settings: zb-auto (and v-auto on
the smallest V settings) against the exact MILP (``--exact``, HiGHS, node limit), and against
the lower bound.

    python benchmarks/bench_exact.py [--nodes 20000] [--out benchmarks/results/exact.json]

Grid (zb-auto): p in {2, 3, 4}, m in {p, 2p} (m <= 8), memory limit {1, 1.5, 2} x p x M_B,
M_W/M_B in {0.5, 0.88}, cost sets unit, B=2F, ZB Table-5 1.5B, H100 measured. v-auto:
p = 2, m in {2, 4}, the same limits and costs. ``gap to optimum`` = heuristic makespan /
proven optimum - 1 (only where the MILP proves its optimum within the node limit).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from megatron_zb.core.ir import Setting  # noqa: E402
from megatron_zb.core.schedules import generate  # noqa: E402
from megatron_zb.core.schedules.search.exact import refine  # noqa: E402
from megatron_zb.core.sim.simulate import simulate  # noqa: E402

COSTS = {"unit": (1.0, 1.0, 1.0, 0.0), "B=2F": (1.0, 2.0, 1.0, 0.0),
         "1.5B (ZB Table 5)": (18.522, 18.086, 9.337, 0.601), "H100 measured": (43.8, 59.2, 32.0, 0.5)}


def grid(kind):
    if kind == "zb-auto":
        pm = [(p, m) for p in (2, 3, 4) for m in (p, 2 * p) if m <= 8]
    else:
        pm = [(2, 2), (2, 4)]
    for (p, m), cost, mw, lim in itertools.product(pm, COSTS, (0.5, 0.88), (1.0, 1.5, 2.0)):
        f, b, w, c = COSTS[cost]
        yield dict(p=p, m=m, cost=cost, mw=mw, limit=lim * p), Setting(
            p, m, chunks=2 if kind == "v-auto" else None, cost_f=f, cost_b=b, cost_w=w, cost_comm=c, mem_w=mw,
            memory_limit=lim * p)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=20000)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "exact.json"))
    args = ap.parse_args()
    out = {"node_limit": args.nodes, "rows": []}
    for kind in ("zb-auto", "v-auto"):
        n = proven = at_opt = 0
        worst = 0.0
        for key, st in grid(kind):
            heur = generate(kind, st)
            hm = simulate(heur, st).makespan
            t0 = time.process_time()
            ex = refine(heur, st, node_limit=args.nodes)
            dt = time.process_time() - t0
            e = ex.meta["exact"]
            row = {"schedule": kind, **key, "heuristic": hm, "exact": simulate(ex, st).makespan,
                   "optimal": e["optimal"], "status": e["status"], "nodes": e.get("nodes", 0),
                   "lower_bound": heur.meta["lower_bound"], "cpu_s": dt}
            n += 1
            if e["optimal"]:
                proven += 1
                gap = hm / row["exact"] - 1
                row["gap_to_optimum"] = gap
                worst = max(worst, gap)
                at_opt += gap <= 1e-9
            out["rows"].append(row)
            print(f"{kind} p={key['p']} m={key['m']} {key['cost']:<18} mw={key['mw']} limit={key['limit']:<4g} "
                  f"heuristic {hm:10.4f} exact {row['exact']:10.4f} {e['status']:<36} nodes {row['nodes']:>6} "
                  f"{dt:6.2f} s", flush=True)
        summary = {"schedule": kind, "settings": n, "proven_optimal": proven, "heuristic_optimal": at_opt,
                   "worst_gap_to_optimum": worst}
        out.setdefault("summary", []).append(summary)
        print(f"{kind}: {n} settings, optimum proven in {proven}, heuristic optimal in {at_opt}, "
              f"worst gap to the optimum {worst:.4f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
