"""The other schedules of the field (BitPipe, ZeroPP, interleaved zero bubble) against interleaved
1F1B, ZB-V and DualPipeV: simulated bubble, activation peak, weight copies, and BitPipe's replica
gradient sync; on the settings of docs/schedules.md and on the BitPipe paper's own models.

    python benchmarks/bench_field.py [--out benchmarks/results/field.json] [--md docs/field_tables.md]

Costs follow the simulator's convention (per whole 1F1B stage; a chunk's pass costs its share).
Equal memory: every schedule is listed with its activation peak (x one microbatch's 1F1B stage
activation) and its model weights per rank (x a 1F1B stage's); BitPipe holds two replicas' weights.
The paper settings use ``megatron-zb plan``'s FLOPs and bytes model (A100 80 GB at 50% of peak, an
assumption: the paper does not state its per-layer times) and print GiB per rank, weights included.

"bitpipe by P and M": P = 4..16 (even), M = P, 2P, 4P, F=B=W=1 and F=1 B=2 W=1, bitpipe's bubble
against 1F1B and interleaved 1F1B (fused backward, like bitpipe) and ZB-H1 and ZB-V (split
backward), with the BitPipe authors' own order where ``benchmarks/results/bitpipe_vs_authors.json``
(``benchmarks/bench_bitpipe_authors.py``) has the setting.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatron_zb.core.ir import Setting  # noqa: E402
from megatron_zb.core.plan import GPU_PEAK_TFLOPS, ModelSpec, PlanRequest, plan  # noqa: E402
from megatron_zb.core.schedules import generate, get  # noqa: E402
from megatron_zb.core.sim.simulate import simulate  # noqa: E402

NAMES = ["1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "dualpipe-v", "interleaved-zb", "zeropp", "bitpipe"]

SETTINGS = [  # the settings of docs/schedules.md, plus P=4 M=8 (the check)
    ("P=4 M=8, F=B=W", dict(stages=4, microbatches=8)),
    ("P=4 M=16, F=B=W", dict(stages=4, microbatches=16)),
    ("P=8 M=32, F=1 B=1.1 W=0.9, comm 0.05", dict(stages=8, microbatches=32, cost_f=1, cost_b=1.1, cost_w=0.9,
                                                  cost_comm=0.05)),
    ("P=8 M=32, heavy loss stage", dict(stages=8, microbatches=32, cost_f=[1.2] + [1] * 6 + [1.5],
                                         cost_b=[1.2] + [1] * 6 + [1.8], cost_w=[0.9] * 8, cost_comm=0.05, mem_w=0.6)),
    ("P=16 M=64, F=1 B=2 W=1", dict(stages=16, microbatches=64, cost_f=1, cost_b=2, cost_w=1)),
    ("P=8 M=32, measured H100 layer costs (F 43.8, B 59.2, W 32 ms, comm 0.5)",
     dict(stages=8, microbatches=32, cost_f=43.8, cost_b=59.2, cost_w=32.0, cost_comm=0.5)),
]

# BitPipe's replica all-reduce on the H100 setting: one layer's bf16 gradients (h=4096: 12 h^2 x 2 bytes
# = 403 MB) between two GPUs at 150 GB/s is ~2.7 ms per 1F1B stage of that setting; 27 ms is a ten
# times slower link (PCIe or a network hop)
SYNC = [("P=8 M=32, H100 costs", dict(stages=8, microbatches=32, cost_f=43.8, cost_b=59.2, cost_w=32.0,
                                      cost_comm=0.5), (0.0, 2.7, 27.0))]

# the BitPipe paper's models (its README's example scripts): GPT 96 layers h3072 a32 s1024, micro
# batch 1, global batch 16, P=8; BERT 64 layers h2560 a64 s512, micro batch 4, global batch 32, P=8
PAPER = [
    ("BitPipe paper GPT: L=96 h=3072 a=32 s=1024 b=1, P=8 M=16",
     ModelSpec(num_layers=96, hidden_size=3072, num_attention_heads=32, seq_length=1024, micro_batch_size=1,
               vocab_size=50257), 8, 16),
    ("BitPipe paper BERT-like: L=64 h=2560 a=64 s=512 b=4, P=8 M=8",
     ModelSpec(num_layers=64, hidden_size=2560, num_attention_heads=64, seq_length=512, micro_batch_size=4,
               vocab_size=28996), 8, 8),
]


# bitpipe by P and M (the statements of docs/schedules.md and README's schedule table)
GRID_PS = tuple(range(4, 17, 2))
GRID_KS = (1, 2, 4)
GRID_COSTS = {"F=B=W=1": dict(cost_f=1, cost_b=1, cost_w=1), "F=1 B=2 W=1": dict(cost_f=1, cost_b=2, cost_w=1)}
GRID_NAMES = ["bitpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"]
AUTHORS_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "bitpipe_vs_authors.json")


def bitpipe_grid():
    """Rows of the grid, and the markdown table."""
    authors = {}
    if os.path.exists(AUTHORS_JSON):
        with open(AUTHORS_JSON) as f:
            authors = {(r["p"], r["m"], r["costs"]): r["theirs_bubble"] for r in json.load(f)["rows"]}
    rows = []
    md = ["### bitpipe by P and M", "",
          "Bubble rate. Fused backward: 1f1b, interleaved-1f1b (2 chunks), bitpipe; split backward (B and W): "
          "zb-h1, zb-v. `authors` is the BitPipe authors' own order (their code run under stubs, "
          "`benchmarks/bench_bitpipe_authors.py`). Peak activation: bitpipe, 1f1b, zb-h1, zb-v P x mem-f; "
          "interleaved-1f1b more (P=8: 11.5).", "",
          "| costs | P | M | authors | bitpipe | 1f1b | interleaved-1f1b | zb-h1 | zb-v | bitpipe vs 1f1b | "
          "vs interleaved |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, costs in GRID_COSTS.items():
        for p in GRID_PS:
            for k in GRID_KS:
                m = k * p
                row = {"costs": label, "p": p, "m": m, "authors": authors.get((p, m, label))}
                for name in GRID_NAMES:
                    sp = get(name)
                    st = Setting(p, m, chunks=2 if sp.chunks is None else None, **costs)
                    s = generate(name, st)
                    r = simulate(s, Setting(**{**st.to_dict(), "chunks": s.placement.chunks}))
                    row[name] = r.bubble_rate
                    row[name + "_makespan"] = r.makespan
                rows.append(row)
                b = row["bitpipe_makespan"]
                a = "-" if row["authors"] is None else f"{row['authors']:.4f}"
                md.append(f"| {label} | {p} | {m} | {a} | " + " | ".join(f"{row[n]:.4f}" for n in GRID_NAMES) +
                          f" | {row['1f1b_makespan'] / b:.3f}x | {row['interleaved-1f1b_makespan'] / b:.3f}x |")
                print(f"bitpipe grid {label} P={p} M={m}: " + ", ".join(f"{n} {row[n]:.4f}" for n in GRID_NAMES),
                      flush=True)
    return rows, md + [""]


def run_setting(kw, cost_sync=0.0, names=NAMES):
    rows, base = [], None
    for name in names:
        sp = get(name)
        st = Setting(**kw, chunks=2 if sp.chunks is None else None, cost_sync=cost_sync)
        s = generate(name, st)
        r = simulate(s, Setting(**{**st.to_dict(), "chunks": s.placement.chunks}))
        row = {"schedule": name, "makespan": r.makespan, "bubble_rate": r.bubble_rate,
               "peak_activation": max(r.peak_memory), "weight_copies": max(r.weight_copies or [1.0]),
               "unit": s.meta.get("unit")}
        if name == "1f1b":
            base = row
        rows.append(row)
    for row in rows:
        row["speedup_vs_1f1b"] = base["makespan"] / row["makespan"]
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/field.json")
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    out = {"settings": [], "sync": [], "paper": [], "bitpipe_grid": []}
    md = ["Generated by `python benchmarks/bench_field.py --md docs/field_tables.md`. Peak activation per rank in "
          "units of one microbatch's 1F1B stage activation (1F1B: P); weights per rank in 1F1B stages.", ""]
    for title, kw in SETTINGS:
        rows = run_setting(kw)
        out["settings"].append({"setting": title, "kw": kw, "rows": rows})
        md += [f"### {title}", "", "| schedule | bubble rate | speed-up vs 1F1B | peak activation | weights |",
               "|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: r["makespan"]):
            md.append(f"| {r['schedule']} | {r['bubble_rate']:.4f} | {r['speedup_vs_1f1b']:.3f}x | "
                      f"{r['peak_activation']:.2f} | {r['weight_copies']:g} |")
        md.append("")
        print(f"{title}: " + ", ".join(f"{r['schedule']} {r['bubble_rate']:.3f}" for r in rows))
    for title, kw, syncs in SYNC:
        md += [f"### bitpipe's replica gradient sync ({title}; cost-sync per 1F1B stage's gradients, ms)", "",
               "| cost-sync | makespan | bubble rate | speed-up vs 1F1B | exposed sync |", "|---|---|---|---|---|"]
        zero = None
        for cs in syncs:
            rows = run_setting(kw, cs, ["1f1b", "bitpipe"])
            b = rows[1]
            zero = b["makespan"] if zero is None else zero
            out["sync"].append({"setting": title, "cost_sync": cs, "row": b})
            md.append(f"| {cs:g} | {b['makespan']:.1f} | {b['bubble_rate']:.4f} | {b['speedup_vs_1f1b']:.3f}x | "
                      f"{b['makespan'] - zero:.1f} |")
            print(f"bitpipe cost_sync {cs}: makespan {b['makespan']:.1f} (exposed {b['makespan'] - zero:.1f})")
        md.append("")
    out["bitpipe_grid"], grid_md = bitpipe_grid()
    md += grid_md
    gib = 1024 ** 3
    for title, spec, p, m in PAPER:
        rows = plan(PlanRequest(spec, p, m, 80.0, tflops=GPU_PEAK_TFLOPS["a100"], efficiency=0.5, schedules=NAMES))
        rows = [r for r in rows if "error" not in r]
        out["paper"].append({"setting": title, "rows": [{k: v for k, v in r.items() if k != "flags"} for r in rows]})
        md += [f"### {title} (A100 80 GB at 50% of peak, FLOPs model)", "",
               "| schedule | bubble rate | throughput vs 1F1B | max GiB per rank (weights + activations) | weights |",
               "|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: r["makespan_s"]):
            md.append(f"| {r['schedule']} | {r['bubble_rate']:.4f} | {r['throughput_vs_1f1b']:.3f}x | "
                      f"{max(r['peak_bytes']) / gib:.1f} | {max(r['weight_copies']):g} |")
        md.append("")
        print(f"{title}: " + ", ".join(f"{r['schedule']} {r['bubble_rate']:.3f}" for r in rows))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    if args.md:
        with open(args.md, "w") as f:
            f.write("# The other schedules of the field (simulator)\n\n" + "\n".join(md))
        print(f"wrote {args.md}")


if __name__ == "__main__":
    main()
