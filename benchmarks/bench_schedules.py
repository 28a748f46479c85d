"""Bubble rate and peak activation of every schedule on realistic settings, zb-auto's and
v-auto's gap to the lower bound, and how long the automatic schedulers take.

    python benchmarks/bench_schedules.py [--out benchmarks/results/schedules.json] [--md docs/schedules.md]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from megatron_zb.core.ir import Setting  # noqa: E402
from megatron_zb.core.iteration import iteration_times  # noqa: E402
from megatron_zb.core.schedules import generate, get, names  # noqa: E402
from megatron_zb.core.simulate import simulate  # noqa: E402

SETTINGS = [
    ("P=4 M=16, F=B=W", dict(stages=4, microbatches=16)),
    ("P=8 M=32, F=1 B=1.1 W=0.9, comm 0.05", dict(stages=8, microbatches=32, cost_f=1, cost_b=1.1, cost_w=0.9, cost_comm=0.05)),
    ("P=8 M=32, heavy loss stage", dict(stages=8, microbatches=32, cost_f=[1.2] + [1] * 6 + [1.5],
                                         cost_b=[1.2] + [1] * 6 + [1.8], cost_w=[0.9] * 8, cost_comm=0.05, mem_w=0.6)),
    ("P=16 M=64, F=1 B=2 W=1", dict(stages=16, microbatches=64, cost_f=1, cost_b=2, cost_w=1)),
    ("P=8 M=32, measured H100 layer costs (F 43.8, B 59.2, W 32 ms, comm 0.5)",
     dict(stages=8, microbatches=32, cost_f=43.8, cost_b=59.2, cost_w=32.0, cost_comm=0.5)),
]
# v-auto's bubble against its memory limit (x mem-f; 1F1B's peak is P)
SWEEP = [("P=8 M=32, F=B=W, mem-w = mem-f", dict(stages=8, microbatches=32, mem_w=1.0)),
         ("P=8 M=32, H100 costs", dict(stages=8, microbatches=32, cost_f=43.8, cost_b=59.2, cost_w=32.0,
                                      cost_comm=0.5))]
SWEEP_LIMITS = (8 / 3 + 1, 4, 5, 6, 7, 8)
SPEED = [("zb-auto", 32, 256), ("zb-auto", 64, 512), ("zb-v", 32, 256), ("v-auto", 32, 256), ("v-half", 32, 256),
         ("v-half", 16, 64)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/schedules.json")
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    out = {"settings": [], "speed": []}
    md = []
    for title, kw in SETTINGS:
        rows = []
        base = None
        for name in names():
            sp = get(name)
            st = Setting(**kw, chunks=2 if sp.chunks is None else None)
            t0 = time.perf_counter()
            s = generate(name, st)
            dt = time.perf_counter() - t0
            sim_st = Setting(**{**st.to_dict(), "chunks": s.placement.chunks})
            r = simulate(s, sim_st)
            it = iteration_times(s, sim_st)
            row = {"schedule": name, "chunks": s.placement.chunks, "makespan": r.makespan,
                   "iteration_time": it.iteration_time, "iteration_time_post_validated": it.iteration_time_post_validated,
                   "bubble_rate": r.bubble_rate, "peak_memory": max(r.peak_memory),
                   "gap_to_lower_bound": s.meta.get("gap_to_lower_bound"), "generate_s": dt}
            if name == "1f1b":
                base = row
            rows.append(row)
        for row in rows:  # per training iteration: Megatron's synchronous step, and post-validated
            row["speedup_vs_1f1b"] = base["iteration_time"] / row["iteration_time"]
            row["speedup_post_validated_vs_1f1b"] = base["iteration_time"] / row["iteration_time_post_validated"]
        rows.sort(key=lambda r: (r["iteration_time"], r["makespan"]))
        out["settings"].append({"title": title, "setting": kw, "rows": rows})
        md.append(f"\n### {title}\n\n| schedule | chunks | bubble rate | speed-up vs 1F1B | post-validated | peak activation (x mem-f) | gap to lower bound |\n|---|---|---|---|---|---|---|")
        print(f"\n{title}")
        print(f"{'schedule':<17} {'v':>2} {'bubble':>7} {'speed-up':>9} {'peak':>6} {'gap':>7} {'gen s':>6}")
        for r in rows:
            gap = "" if r["gap_to_lower_bound"] is None else f"{r['gap_to_lower_bound']:.3f}"
            print(f"{r['schedule']:<17} {r['chunks']:>2} {r['bubble_rate']:>7.4f} {r['speedup_vs_1f1b']:>8.3f}x "
                  f"{r['peak_memory']:>6.2f} {gap:>7} {r['generate_s']:>6.2f}")
            md.append(f"| {r['schedule']} | {r['chunks']} | {r['bubble_rate']:.4f} | {r['speedup_vs_1f1b']:.3f}x | "
                      f"{r['speedup_post_validated_vs_1f1b']:.3f}x | {r['peak_memory']:.2f} | {gap or '-'} |")
    out["sweep"] = []
    md.append("\n### v-auto: bubble against the memory limit\n\n| setting | 1F1B bubble | "
              + " | ".join(f"limit {x:.2f}" for x in SWEEP_LIMITS) + " |\n|---|---|" + "---|" * len(SWEEP_LIMITS))
    print("\nv-auto bubble against the memory limit")
    for title, kw in SWEEP:
        one = simulate(generate("1f1b", Setting(**kw)), Setting(**kw))
        cells = []
        for lim in SWEEP_LIMITS:
            st = Setting(**kw, memory_limit=lim)
            s = generate("v-auto", st)
            r = simulate(s, Setting(**{**st.to_dict(), "chunks": 2}))
            cells.append(f"{r.bubble_rate:.4f} (peak {max(r.peak_memory):.2f})")
            out["sweep"].append({"title": title, "limit": lim, "bubble_rate": r.bubble_rate,
                                 "peak_memory": max(r.peak_memory), "bubble_1f1b": one.bubble_rate})
        print(f"{title}: 1F1B {one.bubble_rate:.4f} | " + " | ".join(cells))
        md.append(f"| {title} | {one.bubble_rate:.4f} | " + " | ".join(cells) + " |")
    print("\nautomatic scheduler speed")
    md.append("\n### Automatic scheduler speed\n\n| schedule | P | M | seconds | bubble rate | gap to lower bound |\n|---|---|---|---|---|---|")
    for name, p, m in SPEED:
        st = Setting(p, m)
        t0 = time.perf_counter()
        s = generate(name, st)
        dt = time.perf_counter() - t0
        r = simulate(s, Setting(p, m, chunks=s.placement.chunks))
        out["speed"].append({"schedule": name, "p": p, "m": m, "seconds": dt, "bubble_rate": r.bubble_rate,
                             "gap_to_lower_bound": s.meta.get("gap_to_lower_bound")})
        print(f"{name:<10} P={p:<3} M={m:<4} {dt:7.2f} s  bubble {r.bubble_rate:.4f}  gap {s.meta.get('gap_to_lower_bound')}")
        md.append(f"| {name} | {p} | {m} | {dt:.2f} | {r.bubble_rate:.4f} | {s.meta.get('gap_to_lower_bound')} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    if args.md:
        with open(args.md, "w") as f:
            f.write("# Schedules compared (simulator)\n\nGenerated by `python benchmarks/bench_schedules.py --md docs/schedules.md`."
                    " Costs are per whole stage (a rank's layers); mem-w defaults to 0.5 x mem-f; peak activation"
                    " is per rank in units of one microbatch's stage activation (1F1B: P). Speed-ups are per training"
                    " iteration (`core/iteration.py`): with Megatron's synchronous optimizer step (the makespan plus"
                    " the late start of the last rank), and with optimizer post-validation (`docs/post_validation.md`);"
                    " optimizer step cost 0.\n" + "\n".join(md) + "\n")
        print(f"wrote {args.md}")


if __name__ == "__main__":
    main()
