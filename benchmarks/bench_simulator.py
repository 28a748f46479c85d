"""How long generating + validating + simulating big schedules takes (schedule core only).

    python benchmarks/bench_simulator.py [--out benchmarks/results/simulator.json]
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from megatron_zb.core.ir import Setting  # noqa: E402
from megatron_zb.core.schedules import generate  # noqa: E402
from megatron_zb.core.sim.simulate import simulate  # noqa: E402
from megatron_zb.core.sim.validate import validate  # noqa: E402

CASES = [("1f1b", 32, 256, None), ("zb-h1", 32, 256, None), ("zb-h2", 32, 256, None),
         ("interleaved-1f1b", 32, 256, 4), ("1f1b", 64, 512, None), ("zb-h2", 64, 512, None)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/simulator.json")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = []
    print(f"{'schedule':<18} {'P':>3} {'M':>4} {'V':>2} {'passes':>7} {'generate s':>10} {'simulate s':>10} {'validate s':>10}")
    for name, p, m, v in CASES:
        st = Setting(p, m, chunks=v)
        best = [float("inf")] * 3
        for _ in range(args.repeat):
            t0 = time.perf_counter(); s = generate(name, st)
            t1 = time.perf_counter(); simulate(s, st)
            t2 = time.perf_counter(); validate(s, st)
            t3 = time.perf_counter()
            best = [min(a, b) for a, b in zip(best, (t1 - t0, t2 - t1, t3 - t2))]
        n = sum(len(o) for o in s.orders)
        rows.append({"schedule": name, "p": p, "m": m, "v": v or 1, "passes": n,
                     "generate_s": best[0], "simulate_s": best[1], "validate_s": best[2]})
        print(f"{name:<18} {p:>3} {m:>4} {v or 1:>2} {n:>7} {best[0]:>10.4f} {best[1]:>10.4f} {best[2]:>10.4f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"python": sys.version.split()[0], "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
