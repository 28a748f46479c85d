"""The memory-bound regime's section of ``docs/results.md`` (``bench_memory_levers.py``): per model
shape under a tight budget, plan's best row that fits (every lever searched together), Megatron's best
configuration that fits, and the best row with no memory limit, with and without offload.

Same conventions as ``report_sections.py``: a block takes ``(res, names, src)`` and returns markdown
lines, raising on a shape it does not know.
"""
from __future__ import annotations

from report_sections import num, provenance, table, times


def _label(r):
    if r is None:
        return "none fits"
    v = r.get("vocab_parallel")
    interleaved = r["schedule"] in ("interleaved-1f1b", "interleaved-zb", "zeropp", "looped-bfs")
    return (r["schedule"] + (f" x{r['chunks']}" if interleaved and r.get("chunks") else "")
            + (" +vocab" if v == 1 else " +vocab2" if v else "") + ("+emb" if r.get("vocab_embedding") else "")
            + (" +rc" if r.get("recompute_layers") else "") + (" +off" if r.get("offload") else ""))


def memory_levers_block(res, names, src):
    """One row per shape and lever set: the best that fits, its time against the unlimited best and
    against Megatron's best that fits, and Megatron's best itself."""
    out = provenance(src, names)
    rows = []
    for n in names:
        for s in res[n]["shapes"]:
            for how in ("plain", "offload"):
                x = s[how]
                best, base = x["best"], x["megatron_baseline"]
                rows.append([s["shape"], f"{s['gpu_memory_gb']:g}", "auto, 50 GB/s" if how == "offload" else "-",
                             _label(best), num(1e3 * best["iteration_time_s"], 0) if best else "-",
                             f"{best['peak_gib']:.1f}" if best else "-", times(x.get("over_unlimited")),
                             times(x.get("over_megatron")),
                             f"{base['schedule']}{' x' + str(base['chunks']) if base.get('chunks', 1) > 1 else ''}, "
                             f"{base['recompute'] or 'no recompute'}: {num(1e3 * base['iteration_time_s'], 0)} ms"
                             if base else f"none ({x['megatron_baseline_reason']})",
                             _label(s["unlimited"]), num(1e3 * s["unlimited"]["iteration_time_s"], 0),
                             num(x["cpu_s"], 1)])
    out += table(["shape", "GiB", "offload", "best that fits", "ms", "peak GiB", "over unlimited", "over Megatron",
                  "Megatron's best that fits", "unlimited best", "ms", "plan CPU s"], rows)
    return out


SECTIONS = (
    ("The memory-bound regime", "Tight GPU budgets: plan's best row that fits with every memory lever searched "
     "together (recompute per model chunk, offload, vocabulary parallelism, the memory limit, the layout, the "
     "interleaved schedules' chunks per rank), against "
     "Megatron's own best configuration that fits and against the best row with no memory limit (docs/memory.md). "
     "Simulated, H100 at 0.5 efficiency.",
     (("memory_levers*.json", memory_levers_block),)),
)
