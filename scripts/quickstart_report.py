"""Compare the quickstart's two training runs (ZB-V and 1F1B) from their logs and profiles.

    python scripts/quickstart_report.py out/quickstart
"""
import glob
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from megatron_zb import plot  # noqa: E402
from megatron_zb.core.ir import Setting  # noqa: E402
from megatron_zb.core.schedules import generate  # noqa: E402
from megatron_zb.core.simulate import simulate  # noqa: E402

LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*elapsed time per iteration \(ms\): ([\d.]+).*lm loss: ([\d.E+-]+)")


def read_log(path):
    it = {}
    for line in open(path, errors="replace"):
        m = LINE.search(line)
        if m:
            it[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    return it


def measured_bubble(profile, ms_per_iter):
    """1 - (compute of every rank in one iteration) / (P x iteration time)."""
    p, m = profile["pipeline_size"], profile["microbatches"]
    busy = [m * (f + b + w) for f, b, w in zip(profile["cost_f"], profile["cost_b"], profile["cost_w"])]
    return 1.0 - sum(busy) / (p * ms_per_iter / 1000.0)


def main(out):
    runs = {}
    for s in ("zb-v", "1f1b"):
        logs = sorted(glob.glob(os.path.join(out, f"pretrain_{s}_*.log")))
        if not logs:
            sys.exit(f"no log for {s} in {out}")
        prof_path = os.path.join(out, f"profile_{s}.json")
        runs[s] = (read_log(logs[-1]), json.load(open(prof_path)) if os.path.exists(prof_path) else None)
    its = sorted(set(runs["zb-v"][0]) & set(runs["1f1b"][0]))
    print(f"{'iteration':>9} {'loss zb-v':>12} {'loss 1f1b':>12} {'|diff|':>9}")
    for i in its:
        a, b = runs["zb-v"][0][i][1], runs["1f1b"][0][i][1]
        print(f"{i:>9} {a:>12.6f} {b:>12.6f} {abs(a - b):>9.2e}")
    worst = max(abs(runs["zb-v"][0][i][1] - runs["1f1b"][0][i][1]) for i in its)
    first, last = its[0], its[-1]
    print(f"loss {runs['zb-v'][0][first][1]:.3f} -> {runs['zb-v'][0][last][1]:.3f}; largest |zb-v - 1f1b| = {worst:.2e}")
    print()
    print(f"{'schedule':<8} {'ms/iter (median)':>17} {'bubble (measured)':>18} {'bubble (simulated)':>19}")
    rows = {}
    for s, (log, prof) in runs.items():
        steady = [log[i][0] for i in its if i > 5]
        ms = statistics.median(steady)
        mb = measured_bubble(prof, ms) if prof else float("nan")
        sim = None
        if prof:
            st = Setting(prof["pipeline_size"], prof["microbatches"], cost_f=prof["cost_f"], cost_b=prof["cost_b"],
                         cost_w=prof["cost_w"], cost_comm=prof.get("cost_comm") or 0.0)
            sched = generate(s, st)
            sim = simulate(sched, Setting(**{**st.to_dict(), "chunks": sched.placement.chunks}))
            if s == "zb-v":
                for ext in ("png", "svg"):
                    plot.save(sim, os.path.join(out, f"timeline_{s}.{ext}"),
                              title=f"{s} as run (P={st.stages}, M={st.microbatches}, measured F/B/W costs)")
                plot.save(sim, os.path.join(out, f"timeline_{s}.trace.json"))
        rows[s] = ms
        print(f"{s:<8} {ms:>17.1f} {mb:>18.3f} {sim.bubble_rate if sim else float('nan'):>19.3f}")
    print(f"\nzb-v vs 1f1b: {rows['1f1b'] / rows['zb-v']:.3f}x iteration speed "
          "(tiny model on CPU: per-pass overheads and the shared cores dominate; see benchmarks/ for timed runs)")
    print(f"timeline of the schedule that ran: {os.path.join(out, 'timeline_zb-v.png')} (.svg, .trace.json)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out/quickstart")
