"""What `megatron-zb plan` costs (issue 32 item 6): CPU seconds of one plan for the Llama-3-8B
shape (32 layers, h 4096, 32 heads, s 4096, vocabulary 128256, ffn 14336, 80 GB), in one process
(``jobs=1``), with rows without vocabulary parallelism ('off'), with it only ('on') and both (the
default), and per row: each (schedule, vocabulary barriers or none) row's CPU seconds, the layouts
it built.

    OMP_NUM_THREADS=1 python benchmarks/bench_plan_speed.py [--sizes 8:32 16:64] [--modes off on both]
        [--out benchmarks/results/plan_speed.json]

CPU time (``time.process_time``), not wall: the box is shared. A mode's rows run in one fresh
process each (nothing remembered from another mode's searches), as the command line runs them.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_zb.core import plan as P  # noqa: E402
from megatron_zb.core import plan_row  # noqa: E402
from megatron_zb.core.model import ModelSpec  # noqa: E402

SPEC = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=4096, vocab_size=128256,
            ffn_hidden_size=14336)


def _one_mode(args) -> dict:
    p, m, mode = args
    built = []
    orig = plan_row._one

    def timed(sp, spec, p_, m_, v, pl, lay, *a, **k):
        t = time.process_time()
        r = orig(sp, spec, p_, m_, v, pl, lay, *a, **k)
        built.append({"schedule": sp.name, "vocab": a[-1][0], "layout": str(lay),
                      "cpu_s": round(time.process_time() - t, 3)})
        return r

    plan_row._one = timed
    t = time.process_time()
    rows = P.plan(ModelSpec(**SPEC), p, m, 80, vocab_parallel=mode)
    total = time.process_time() - t
    per_row: dict = {}
    for b in built:
        key = f"{b['schedule']}{' +vocab' if b['vocab'] else ''}"
        per_row.setdefault(key, {"cpu_s": 0.0, "layouts": []})
        per_row[key]["cpu_s"] = round(per_row[key]["cpu_s"] + b["cpu_s"], 3)
        per_row[key]["layouts"].append(b["layout"])
    best = next((r for r in rows if "error" not in r and r["fits"]), None)
    return {"p": p, "m": m, "mode": mode, "cpu_s": round(total, 3), "rows": per_row,
            "best": None if best is None else {"schedule": best["schedule"], "vocab": best.get("vocab_parallel"),
                                               "iteration_time_s": best["iteration_time_s"]}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["8:32", "16:64"], help="P:M pairs")
    ap.add_argument("--modes", nargs="+", default=["off", "on", "both"], choices=["off", "on", "both"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "plan_speed.json"))
    a = ap.parse_args()
    jobs = [(int(s.split(":")[0]), int(s.split(":")[1]), mode) for s in a.sizes for mode in a.modes]
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    out = []
    for job in jobs:  # one fresh process per mode: nothing remembered between them
        with ctx.Pool(1) as pool:
            out.append(pool.apply(_one_mode, (job,)))
        r = out[-1]
        print(f"P={r['p']:<3} M={r['m']:<3} {r['mode']:<5} {r['cpu_s']:8.2f} s CPU   best {r['best']}")
        for name, x in sorted(r["rows"].items(), key=lambda kv: -kv[1]["cpu_s"]):
            print(f"    {name:<24} {x['cpu_s']:7.2f} s  layouts built: {len(x['layouts'])}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump({"model": SPEC, "gpu_memory_gb": 80, "results": out}, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
