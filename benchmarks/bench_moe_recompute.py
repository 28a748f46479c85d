"""Schedule family x Megatron model feature: is every combination exact against the non-pipelined
reference? (``tests/test_moe_recompute.py`` runs a representative part in CI; this runs the grid.)

    OMP_NUM_THREADS=1 python benchmarks/bench_moe_recompute.py [--mcore-path .venv/mcore-0.19.2]
        [--out benchmarks/results/moe_recompute.json]

Families: 1F1B-like (1f1b, Megatron's own 1F1B), ZB single placement (zb-h1, zb-h2), V (zb-v, v-half,
dualpipe-v), looped (interleaved-1f1b), bitpipe. Features (PP=2; 4 CPU processes, 2 for full recompute alone): MoE (4 experts,
top-2, aux loss 0.01) with EP=2 over DP=2; full recompute (uniform, 1 layer); selective recompute with
TP=2 + sequence parallelism; MoE + full recompute; multi-token prediction (one-chunk schedules,
untied embeddings). Prints max rel grad diff per cell (n/a where the combination is refused) and
writes the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_zb import verify as V  # noqa: E402

SCHEDULES = ("1f1b", "megatron-1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "dualpipe-v", "interleaved-1f1b", "bitpipe")
MOE = dict(num_experts=4, expert_model_parallel_size=2, data_parallel_size=2, moe_aux_loss_coeff=0.01)
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
FEATURES = {
    "moe ep2": MOE,
    "recompute full": FULL,
    "recompute selective tp2+sp": dict(recompute_granularity="selective", tensor_parallel_size=2, sequence_parallel=True),
    "moe ep2 + recompute full": {**MOE, **FULL},
    "mtp (untied)": dict(mtp_num_layers=1, tie_embeddings=False, data_parallel_size=2),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mcore-path", default=None)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "moe_recompute.json"))
    a = ap.parse_args(argv)
    cells, cases = {}, []
    for feat, kw in FEATURES.items():
        for sched in SCHEDULES:
            kw2 = dict(kw)
            tp = kw2.pop("tensor_parallel_size", 1)
            try:
                case = V.make_case(sched, 2, tp, num_microbatches=4, iterations=2, label=f"{feat}", **kw2)
            except V.VerifyUsageError as e:
                cells[(feat, sched)] = {"refused": str(e)}
                continue
            cases.append(((feat, sched), case))
    results = {}
    for world in sorted({c.world_size for _, c in cases}):  # one launch per world size
        group = [(k, c) for k, c in cases if c.world_size == world]
        for (k, _), r in zip(group, V.run_verify_many([c for _, c in group], timeout=3600, mcore_path=a.mcore_path)):
            results[k] = r
    for key, r in results.items():
        cells[key] = {"passed": r["passed"], "max_rel_grad_diff": r.get("max_rel_grad_diff"),
                      "max_abs_loss_diff": r.get("max_abs_loss_diff"),
                      "max_abs_aux_loss_diff": r.get("max_abs_aux_loss_diff"),
                      "megatron_core": r.get("megatron_core"), "error": r.get("error"), "problems": r.get("problems")}
    version = next((c["megatron_core"] for c in cells.values() if c.get("megatron_core")), "?")
    print(f"max rel grad diff vs the non-pipelined reference (PP=2, 4 processes, megatron-core {version}); "
          "FAIL = over 1e-5 or a loss/aux-loss difference; n/a = refused")
    width = max(len(s) for s in SCHEDULES) + 2
    print(f"{'feature':28s}" + "".join(f"{s:>{width}s}" for s in SCHEDULES))
    bad = 0
    for feat in FEATURES:
        row = []
        for sched in SCHEDULES:
            c = cells[(feat, sched)]
            if "refused" in c:
                row.append("n/a")
            elif not c["passed"]:
                bad += 1
                row.append("FAIL")
            else:
                row.append(f"{c['max_rel_grad_diff']:.1e}")
        print(f"{feat:28s}" + "".join(f"{x:>{width}s}" for x in row))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"megatron_core": version, "cells": [{"feature": k[0], "schedule": k[1], **v} for k, v in cells.items()]},
                  f, indent=1)
    print(f"wrote {a.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
