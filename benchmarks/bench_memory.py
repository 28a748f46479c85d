"""Memory as measured: each pipeline rank's activation peak in a real run next to what the
simulator and plan promised.

    OMP_NUM_THREADS=1 python benchmarks/bench_memory.py [--pp 4] [--microbatches 8]
        [--mcore-path .venv/mcore-0.19.2] [--out benchmarks/results/memory.json]

Every schedule trains the tiny megatron-core GPT of ``megatron-zb verify`` (fp32, hidden 64, 4 heads,
sequence 32, micro-batch 2, vocabulary 128, one layer per stage, no dropout, no flash attention,
Megatron's ``deallocate_pipeline_outputs`` as in training) on P CPU processes; its losses and
gradients are checked against the reference as usual. ``runtime.observe.memory`` measures each rank's live
activation bytes after every pass of the last iteration (what autograd saved for backward, the
stage input, what the W queue holds; offloaded parts not counted). Three numbers per rank:

* **measured**: the peak of that trace;
* **simulated**: the simulator's peak for the same order with this run's measured bytes per F
  (mem-f) and still held after B (mem-w) of each stage (``core.sim.simulate.stage_memory_trace``);
* **plan**: the same trace with plan's formula bytes per stage instead of measured ones
  (``core.plan.ModelSpec``: per layer, the embedding stage's output, the loss stage's softmax and
  final norm; fp32 elements, no dropout, no flash attention).

Prints the table (deviation from measured in %) and writes the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_zb import verify as V  # noqa: E402
from megatron_zb.core.build import build  # noqa: E402
from megatron_zb.core.costs.model import ModelSpec, stage_activation_bytes  # noqa: E402
from megatron_zb.core.sim.simulate import stage_memory_trace  # noqa: E402

CASES = [("1f1b", {}), ("zb-h1", {}), ("zb-h2", {}), ("zb-v", {}), ("v-half", {}), ("v-min", {}),
         ("interleaved-1f1b", {}), ("dualpipe-v", {}), ("zb-v", {"offload_ratio": 1.0})]


def formula_stage_mem(case) -> dict:
    """{stage: (mem_f, mem_w)} in bytes from plan's formula for the case's tiny GPT."""
    cfg = case.model_config()
    spec = ModelSpec(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                     num_attention_heads=cfg.num_attention_heads, seq_length=cfg.seq_length,
                     micro_batch_size=cfg.micro_batch_size, vocab_size=cfg.vocab_size, flash_attention=False,
                     activation_bytes=4, dropout=False)
    return stage_activation_bytes(spec, case.pipeline_parallel_size * case.chunks)


def orders(case):
    from megatron_zb.megatron.execution.options import ScheduleOptions
    kw = dict(case.schedule_options)
    if case.offload_ratio is not None:
        kw.update(offload_ratio=case.offload_ratio, offload_time=case.offload_time)
    opts = ScheduleOptions(case.schedule, case.chunks, case.memory_limit, **kw)
    req = opts.request()
    return build(req.replace(chunks=case.chunks if opts.spec.chunks is None else None), case.pipeline_parallel_size,
                 case.num_microbatches).lowered(False).orders


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mcore-path", default=None)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "memory.json"))
    a = ap.parse_args(argv)
    cases = [V.make_case(name, a.pp, num_microbatches=a.microbatches, iterations=2,
                         config_overrides={"deallocate_pipeline_outputs": True}, **kw) for name, kw in CASES]
    results = V.run_verify_many(cases, timeout=1800, mcore_path=a.mcore_path)
    rows = []
    print(f"activation peak per pipeline rank, KiB (PP={a.pp}, M={a.microbatches}, tiny GPT fp32 on CPU): "
          "measured / simulated from measured mem-f,mem-w / plan's formula (deviation from measured)")
    for case, r in zip(cases, results):
        label = case.schedule + (f" + offload {case.offload_ratio:g}" if case.offload_ratio is not None else "")
        if r.get("error") or "peak_activation_bytes_measured" not in r:
            print(f"{label:24s} FAILED: {r.get('error') or r.get('problems')}")
            rows.append({"schedule": label, "error": r.get("error") or r.get("problems")})
            continue
        meas, sim = r["peak_activation_bytes_measured"], r["peak_activation_bytes_predicted"]
        fm = formula_stage_mem(case)
        plan = [max([0.0] + stage_memory_trace(o, fm)) for o in orders(case)]
        cells = []
        for m, s, p in zip(meas, sim, plan):
            cells.append(f"{m / 1024:7.0f} / {s / 1024:7.0f} ({100 * (s / m - 1):+5.1f}%) / {p / 1024:7.0f} "
                         f"({100 * (p / m - 1):+5.1f}%)")
        print(f"{label:24s} " + " | ".join(cells) + ("" if r["passed"] else "  (gradients FAILED)"))
        rows.append({"schedule": label, "passed": r["passed"], "measured_bytes": meas, "simulated_bytes": sim,
                     "plan_bytes": [round(x) for x in plan],
                     "simulated_dev": [s / m - 1 for m, s in zip(meas, sim)],
                     "plan_dev": [p / m - 1 for m, p in zip(meas, plan)],
                     "per_rank": r.get("memory"), "megatron_core": r.get("megatron_core")})
    ok = [x for x in rows if "error" not in x]
    worst_sim = max((abs(d) for x in ok for d in x["simulated_dev"]), default=None)
    worst_plan = max((abs(d) for x in ok for d in x["plan_dev"]), default=None)
    if ok:
        print(f"largest deviation from measured: simulated {100 * worst_sim:.1f}%, plan {100 * worst_plan:.1f}%")
    out = {"pp": a.pp, "microbatches": a.microbatches, "rows": rows, "max_abs_simulated_dev": worst_sim,
           "max_abs_plan_dev": worst_plan, "host": platform.node(), "python": platform.python_version()}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {a.out}")
    return 0 if ok and len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
