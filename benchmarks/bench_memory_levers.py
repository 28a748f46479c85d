"""The memory-bound regime (issue 55): for public model shapes under tight GPU memory, plan's best
row that fits (every lever searched together), Megatron's best configuration that fits (its own
schedules, layouts and recompute), and the best row with no memory limit (1000 GiB), each with and
without --offload-ratio auto over a 50 GB/s host link. Simulated (H100 at 0.5 efficiency).

    OMP_NUM_THREADS=1 python benchmarks/bench_memory_levers.py [--shapes A B ...] \\
        [--out benchmarks/results/memory_levers.json]

Each plan runs as the command line runs it (``megatron-zb plan ... --json --jobs 1``, each in a
fresh process); its CPU seconds (user + sys, interpreter start included) are recorded beside it.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

#: name -> (plan flags of the model and parallelism, GPU memory GiB)
SHAPES = {
    "A": (["--model", "llama-3-70b", "--tensor-parallel-size", "4", "--sequence-parallel",
           "--pipeline-parallel-size", "8", "--seq-length", "8192", "--num-microbatches", "32"], 80),
    "B": (["--model", "llama-3-8b", "--pipeline-parallel-size", "8", "--num-microbatches", "32"], 27),
    "llama-3-8b s16k P=8": (["--model", "llama-3-8b", "--pipeline-parallel-size", "8", "--seq-length", "16384",
                             "--num-microbatches", "32", "--tensor-parallel-size", "2", "--sequence-parallel"], 40),
    "qwen2.5-72b P=16": (["--model", "qwen2.5-72b", "--tensor-parallel-size", "4", "--sequence-parallel",
                          "--pipeline-parallel-size", "16", "--seq-length", "4096", "--num-microbatches", "64"], 48),
}
OFFLOAD = ["--offload-ratio", "auto", "--host-link-gbps", "50"]


def _plan(flags) -> tuple:
    """One plan as the command line runs it, in a fresh process (nothing remembered from another
    plan's searches): its JSON and its CPU seconds (user + sys)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "megatron_zb.cli", "plan"] + flags + ["--jobs", "1", "--json"],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"plan {' '.join(flags)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(proc.stdout), cpu


def _row(r) -> dict:
    if r is None:
        return None
    keep = ("schedule", "chunks", "vocab_parallel", "vocab_embedding", "recompute_layers", "iteration_time_s",
            "bubble_rate", "peak_bytes", "flags", "speedup_vs_megatron")
    out = {k: r[k] for k in keep if k in r}
    out["offload"] = bool(r.get("offload"))
    out["peak_gib"] = round(max(r["peak_bytes"]) / 1024 ** 3, 2)
    return out


def _best(d) -> dict:
    return next((r for r in d["rows"] if "error" not in r and r["fits"]), None)


def shape(name: str) -> dict:
    flags, gb = SHAPES[name]
    rec = {"shape": name, "flags": flags, "gpu_memory_gb": gb}
    roomy, cpu = _plan(flags + ["--gpu-memory-gb", "1000"])
    rec["unlimited"] = _row(_best(roomy))
    for label, extra in (("plain", []), ("offload", OFFLOAD)):
        d, cpu = _plan(flags + ["--gpu-memory-gb", str(gb)] + extra)
        best = _best(d)
        base = d["megatron_baseline"]
        rec[label] = {"best": _row(best), "cpu_s": round(cpu, 2),
                      "megatron_baseline": None if base is None else {k: base[k] for k in (
                          "schedule", "chunks", "recompute", "iteration_time_s", "flags") if k in base}
                      | {"peak_gib": round(max(base["peak_bytes"]) / 1024 ** 3, 2)},
                      "megatron_baseline_reason": d["megatron_baseline_reason"]}
        if best is not None:
            rec[label]["over_unlimited"] = round(best["iteration_time_s"] / rec["unlimited"]["iteration_time_s"], 4)
            rec[label]["over_megatron"] = best.get("speedup_vs_megatron")
    return rec


def main_(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "memory_levers.json"))
    a = ap.parse_args(argv)
    rows = []
    for name in a.shapes:
        rows.append(shape(name))
        r = rows[-1]
        for label in ("plain", "offload"):
            x = r[label]
            print(f"{name:<22} {label:<8} best {x['best'] and x['best']['schedule']} "
                  f"{x['best'] and round(1e3 * x['best']['iteration_time_s'], 1)} ms, "
                  f"x{x.get('over_unlimited')} of unlimited, {x.get('over_megatron')}x Megatron, {x['cpu_s']} CPU s",
                  flush=True)
    with open(a.out, "w") as f:
        json.dump({"benchmark": "memory_levers", "cores": os.cpu_count(),
                   "command": "python benchmarks/bench_memory_levers.py", "shapes": rows}, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main_())
