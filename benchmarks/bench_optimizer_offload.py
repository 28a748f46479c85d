"""Optimizer states in host memory (docs/optimizer_offload.md): for one public model shape, per
schedule, whether it fits the GPU without offload, with Megatron's static CPU offload (one fraction
for every rank), with each rank's own share ('auto', CPU updates) and with the states visiting the
GPU in the pipeline's troughs ('trough'); the simulated time per iteration (optimizer step and the
optimizer's host transfers counted) and the peak memory per rank. Then the headline: the fastest
row that fits only with trough offload against the fastest that fits without.

    python benchmarks/bench_optimizer_offload.py        # llama-3-70b TP=8 SP, PP=4, M=16, sequence 20480, 80 GiB

Costs from FLOPs (989 TFLOPS x 0.5), activations by Megatron's per-layer formula; the optimizer's
speeds are ``core.optimizer.offload.HostCosts``' defaults (host link 25 GB/s per direction, GPU Adam
2,000 GB/s, CPU Adam 25 GB/s of memory traffic, 34 bytes per parameter). Pure Python (the schedule
core). Writes benchmarks/results/optimizer_offload.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_zb.core.costs.models import spec_kwargs  # noqa: E402
from megatron_zb.core.plan import ModelSpec, OptimizerOffload, PlanRequest, plan  # noqa: E402

GIB = 2.0 ** 30


def _spec(args) -> ModelSpec:
    kw = spec_kwargs(args.model, args.seq_length)
    kw.update(tensor_parallel_size=args.tensor_parallel_size, sequence_parallel=True, micro_batch_size=1)
    return ModelSpec(**kw)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3-70b")
    ap.add_argument("--tensor-parallel-size", type=int, default=8)
    ap.add_argument("--pipeline-parallel-size", type=int, default=4)
    ap.add_argument("--num-microbatches", type=int, default=16)
    ap.add_argument("--seq-length", type=int, default=20480)
    ap.add_argument("--gpu-memory-gb", type=float, default=80.0)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "optimizer_offload.json"))
    a = ap.parse_args(argv)
    spec = _spec(a)
    p, m, gb = a.pipeline_parallel_size, a.num_microbatches, a.gpu_memory_gb
    req = PlanRequest(spec, p, m, gb)
    modes = {mode: {r["schedule"]: r for r in plan(req.replace(optimizer_offload=OptimizerOffload(mode)), jobs=a.jobs)
                    if "error" not in r} for mode in ("static", "auto", "trough")}
    rows = []
    for name, t in modes["trough"].items():
        o = t.get("optimizer_offload")
        row = {"schedule": name, "fits_without": o is None and t["fits"],
               "peak_without_gib": max(o["peak_bytes_without"] if o else t["peak_bytes"]) / GIB,
               "shares": o["fractions"] if o else [0.0] * p}
        for mode, rs in modes.items():
            r = rs[name]
            ok = r["fits"]
            row[mode] = {"fits": ok, "iteration_s": r["iteration_time_s"] if ok else None,
                         "peak_gib": max(r["peak_bytes"]) / GIB, "step_s": r.get("step_time_s"),
                         "flags": r["flags"]}
        if row["fits_without"]:
            row["without_s"] = t["iteration_time_s"]
        rows.append(row)
    rows.sort(key=lambda r: (r["trough"]["iteration_s"] is None, r["trough"]["iteration_s"] or 0.0))
    print(f"{a.model}: TP={a.tensor_parallel_size} (sequence parallel), PP={p}, M={m}, sequence {a.seq_length}, "
          f"{gb:g} GiB per GPU; time per iteration (synchronous step), ms; '-' = does not fit")
    hdr = (f"{'schedule':<17} {'peak w/o':>9} {'without':>9} {'static':>9} {'auto':>9} {'trough':>9}  "
           f"{'peak with':>9}  host shares per rank")
    print(hdr)
    print("-" * len(hdr))

    def ms(x):
        return f"{1e3 * x:9.1f}" if x is not None else f"{'-':>9}"
    for r in rows:
        print(f"{r['schedule']:<17} {r['peak_without_gib']:9.1f} {ms(r.get('without_s'))} "
              f"{ms(r['static']['iteration_s'])} {ms(r['auto']['iteration_s'])} {ms(r['trough']['iteration_s'])}  "
              f"{r['trough']['peak_gib']:9.1f}  " + ",".join(f"{s:.2f}" if s is not None else "n/a" for s in r["shares"]))
    without = [r for r in rows if r["fits_without"]]
    only = [r for r in rows if not r["fits_without"] and r["trough"]["fits"]]
    head = None
    if without and only:
        best_w = min(without, key=lambda r: r["without_s"])
        best_t = min(only, key=lambda r: r["trough"]["iteration_s"])
        head = {"fastest_only_with_trough": best_t["schedule"], "its_iteration_s": best_t["trough"]["iteration_s"],
                "its_static_iteration_s": best_t["static"]["iteration_s"],
                "best_without": best_w["schedule"], "best_without_iteration_s": best_w["without_s"],
                "speedup": best_w["without_s"] / best_t["trough"]["iteration_s"],
                "flags": best_t["trough"]["flags"]}
        print()
        print(f"fastest that fits only with trough offload: {best_t['schedule']} {1e3 * head['its_iteration_s']:.1f} ms; "
              f"best that fits without: {best_w['schedule']} {1e3 * head['best_without_iteration_s']:.1f} ms "
              f"-> {head['speedup']:.3f}x (with Megatron's static offload instead: "
              + (f"{1e3 * head['its_static_iteration_s']:.1f} ms)" if head["its_static_iteration_s"] else "does not fit)"))
        print(f"flags: {head['flags']}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump({"model": a.model, "tensor_parallel_size": a.tensor_parallel_size, "pipeline_parallel_size": p,
                   "num_microbatches": m, "seq_length": a.seq_length, "gpu_memory_gb": gb, "rows": rows,
                   "headline": head}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
