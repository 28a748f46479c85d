"""Bubble rate and peak activation of every schedule on realistic settings, zb-auto's and
v-auto's gap to the lower bound, the ZB paper's Table-5 cells, and how long the automatic
schedulers take (CPU seconds of one process: the wall time on a shared machine says more
about its load than about the search). With --md it writes docs/schedules.md, adding the
summaries of bench_vs_authors.py and bench_exact.py from their JSON results where present.

    python benchmarks/bench_schedules.py [--out benchmarks/results/schedules.json] [--md docs/schedules.md]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from megatron_zb.core.ir import Setting  # noqa: E402
from megatron_zb.core.sim.iteration import iteration_times  # noqa: E402
from megatron_zb.core.schedules import generate, get, names  # noqa: E402
from megatron_zb.core.sim.simulate import simulate  # noqa: E402

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
SPEED = [("zb-auto", 32, 256), ("zb-auto", 64, 512), ("v-auto", 32, 256), ("v-auto", 64, 512), ("zb-v", 32, 256),
         ("v-half", 32, 256), ("v-half", 16, 64)]
SPEED_COSTS = dict(cost_f=10.419, cost_b=10.207, cost_w=7.715, cost_comm=0.408)  # ZB Table 5, 28.3B
# the ZB paper's Table 5 (memory in units of M_B = 34h + 5as, M_W = 32h, limit 2p M_B): (title, setting, paper)
TABLE5 = [("1.5B: p=8, m=24", dict(p=8, m=24, f=18.522, b=18.086, w=9.337, comm=0.601, h=2304, a=24), 0.0433),
          ("28.3B: p=32, m=96", dict(p=32, m=96, f=10.419, b=10.207, w=7.715, comm=0.408, h=6144, a=48), 0.0038)]


def table5_setting(p, m, f, b, w, comm, h, a, s=1024, limit_x=2.0):
    m_b, m_w = 34 * h + 5 * a * s, 32 * h
    return Setting(p, m, cost_f=f, cost_b=b, cost_w=w, cost_comm=comm, mem_f=1.0, mem_w=m_w / m_b,
                   memory_limit=limit_x * p)


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
    print("\nZB paper, Table 5")
    out["table5"] = []
    md.append("\n### The ZB paper's Table 5 (zb-auto)\n\nMemory in units of M_B = 34h + 5as (M_W = 32h), "
              "costs from the paper. `pytest tests/test_core_search.py -k table5` checks the 2 p M_B column.\n\n"
              "| model | limit | paper | zb-auto bubble | gap to lower bound |\n|---|---|---|---|---|")
    for title, kw, paper in TABLE5:
        for lx in (1.0, 1.5, 2.0):
            st = table5_setting(**kw, limit_x=lx)
            s = generate("zb-auto", st)
            r = simulate(s, st)
            out["table5"].append({"title": title, "limit_x_p": lx, "bubble_rate": r.bubble_rate,
                                  "paper": paper if lx == 2.0 else None,
                                  "gap_to_lower_bound": s.meta.get("gap_to_lower_bound")})
            print(f"{title} limit {lx:g} p M_B: bubble {r.bubble_rate:.4f} gap {s.meta.get('gap_to_lower_bound')}")
            md.append(f"| {title} | {lx:g} p M_B | {f'{paper:.4f}' if lx == 2.0 else '-'} | {r.bubble_rate:.4f} | "
                      f"{s.meta.get('gap_to_lower_bound'):.4f} |")
    print("\nautomatic scheduler speed")
    md.append("\n### Automatic scheduler speed\n\nCosts of the 28.3B model (F 10.419, B 10.207, W 7.715, comm 0.408), "
              "mem-w 0.5, default limit (1F1B's, p x mem-f); CPU seconds of one process.\n\n"
              "| schedule | P | M | CPU seconds | bubble rate | gap to lower bound |\n|---|---|---|---|---|---|")
    for name, p, m in SPEED:
        st = Setting(p, m, **SPEED_COSTS)
        t0 = time.process_time()
        s = generate(name, st)
        dt = time.process_time() - t0
        r = simulate(s, Setting(p, m, chunks=s.placement.chunks, **SPEED_COSTS))
        out["speed"].append({"schedule": name, "p": p, "m": m, "cpu_seconds": dt, "bubble_rate": r.bubble_rate,
                             "gap_to_lower_bound": s.meta.get("gap_to_lower_bound")})
        print(f"{name:<10} P={p:<3} M={m:<4} {dt:7.2f} s  bubble {r.bubble_rate:.4f}  gap {s.meta.get('gap_to_lower_bound')}")
        md.append(f"| {name} | {p} | {m} | {dt:.2f} | {r.bubble_rate:.4f} | {s.meta.get('gap_to_lower_bound')} |")
    md += _other_results()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    if args.md:
        tail = _hand_written_sections(args.md)
        with open(args.md, "w") as f:
            f.write("# Schedules compared (simulator)\n\nGenerated by `python benchmarks/bench_schedules.py --md docs/schedules.md`."
                    " Costs are per whole stage (a rank's layers); mem-w defaults to 0.5 x mem-f; peak activation"
                    " is per rank in units of one microbatch's stage activation (1F1B: P). Speed-ups are per training"
                    " iteration (`core/sim/iteration.py`): with Megatron's synchronous optimizer step (the makespan plus"
                    " the late start of the last rank), and with optimizer post-validation (`docs/post_validation.md`);"
                    " optimizer step cost 0.\n" + "\n".join(md) + "\n" + tail)
        print(f"wrote {args.md}")


def _hand_written_sections(path):
    """The file's '## ' sections (written by hand or by other benchmarks), kept after the tables."""
    if not os.path.exists(path):
        return ""
    text = open(path).read()
    at = text.find("\n## ")
    return "" if at < 0 else text[at:]


def _other_results():
    """Markdown summaries of bench_vs_authors.py and bench_exact.py results, where present."""
    md = []
    path = os.path.join(os.path.dirname(__file__), "results", "vs_authors.json")
    if os.path.exists(path):
        d = json.load(open(path))
        md.append("\n### Against the authors' schedulers\n\n`python benchmarks/bench_vs_authors.py "
                  "<checkout of sail-sg/zero-bubble-pipeline-parallelism>`: same settings, both timed by our "
                  "simulator; zb-auto against `zb.py`, v-auto against the better of `zbv.py` (adaptive V) and "
                  "`v_auto_schedule.py` (building blocks). Grid: p as in the table, m in {p, 2p, 3p, 4p}, "
                  "M_W/M_B in {0.5, 0.88}, costs unit, B=2F, ZB Table-5 1.5B and 28.3B, H100 measured; "
                  "\"tie, less memory\": ours at most 0.1% slower (the searches keep the least peak within 0.1% "
                  "of the fastest) with a lower peak than theirs; "
                  "\"theirs: none\": their code finds no schedule within the limit.\n\n"
                  "| ours | p | limit (x p M_B) | settings | worse | tie, less memory | equal | better | theirs: none |\n"
                  "|---|---|---|---|---|---|---|---|---|")
        for kind in ("zb", "v"):
            if kind not in d:
                continue
            ps = ", ".join(str(p) for p in d[kind].get("ps", (4, 8, 16)))
            for lim, c in sorted(d[kind]["by_limit"].items(), key=lambda x: float(x[0])):
                md.append(f"| {d[kind]['schedule']} | {ps} | {float(lim):g} | {sum(c.values())} | {c['worse']} | "
                          f"{c.get('tie, less memory', 0)} | {c['equal']} | {c['better']} | {c['theirs: none']} |")
            c = d[kind]["counts"]
            md.append(f"| {d[kind]['schedule']} | {ps} | all | {sum(c.values())} | {c['worse']} | "
                      f"{c.get('tie, less memory', 0)} | {c['equal']} | {c['better']} | {c['theirs: none']} |")
        import bench_vs_authors as V
        for kind in ("zb", "v"):
            if kind not in d:
                continue
            full = len(V.MW) * len(V.COSTS) * len(V.ZB_LIMITS if kind == "zb" else V.V_LIMITS)
            count = {}
            for r in d[kind]["rows"]:
                count[(r["p"], r["m"])] = count.get((r["p"], r["m"]), 0) + 1
            short = [(p, k) for p in V.PS for k in (1, 2, 3, 4) if count.get((p, k * p), 0) < full]
            if short:
                what = ", ".join(f"p={p} m={k * p}" + (f" ({count[(p, k * p)]} of {full} settings)"
                                                       if count.get((p, k * p)) else "") for p, k in short)
                ks = " ".join(str(k) for k in sorted({k for _, k in short}))
                md.append(f"\n{d[kind]['schedule']}: {what} not (fully) in this run "
                          "(at p=16 and m >= 32 a setting takes minutes, mostly in the authors' scheduler; "
                          f"`--only {kind} --ps 16 --ks {ks} --append --shard I/N` in N processes adds it, "
                          "each saving after every setting).")
    path = os.path.join(os.path.dirname(__file__), "results", "exact.json")
    if os.path.exists(path):
        d = json.load(open(path))
        md.append(f"\n### Exact mode against the heuristics\n\n`python benchmarks/bench_exact.py` (MILP with HiGHS, "
                  f"node limit {d['node_limit']}; settings listed in the script).\n\n"
                  "| schedule | settings | optimum proven | heuristic optimal | worst gap to the optimum |\n|---|---|---|---|---|")
        for sm in d.get("summary", []):
            md.append(f"| {sm['schedule']} | {sm['settings']} | {sm['proven_optimal']} | {sm['heuristic_optimal']} | "
                      f"{sm['worst_gap_to_optimum']:.4f} |")
    return md


if __name__ == "__main__":
    main()
