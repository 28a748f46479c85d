"""What the V search's building-block families are worth (``schedules.search.vsearch._v_searched``): the
automatic V schedule (v-auto) over the authors' grid (``bench_vs_authors.settings``) searched in full
as the product does (``full``), and again without the unit-slot blocks (``novs``: ``vslots``),
without the real-cost blocks (``novb``: ``vblock``) or without both (``none``), each with nothing
remembered from another search: its makespan, peak memory and CPU seconds. A family is worth its
time where leaving it out makes schedules slower or leaner ones lost; vsearch.py keeps each family
where it is (the unit-slot blocks under 1F1B's peak, the real-cost blocks but at 1F1B's peak itself
on settings above p x m = 64).

    OMP_NUM_THREADS=1 python benchmarks/bench_v_families.py [--ps 4 8 16] [--limits 1.0]
        [--variants full none] [--out benchmarks/results/v_families.json]

The families are switched off by replacing ``vslots.search`` / ``vblock.search`` in this process,
so ``full`` measures whatever vsearch.py does with them in: to measure a family vsearch.py now leaves out
at some limit, run this script on a checkout from before that change (``git worktree add``).
Prints, per (P, limit), the settings where a variant is slower than ``full`` or leaner, and the CPU
seconds of each variant.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from bench_vs_authors import settings  # noqa: E402
from megatron_zb.core.ir.memo import Memo  # noqa: E402
from megatron_zb.core.schedules.search import auto, vblock, vsearch, vslots
from megatron_zb.core.schedules import generate  # noqa: E402
from megatron_zb.core.sim.simulate import simulate  # noqa: E402

VARIANTS = ("full", "novs", "novb", "none")
_VS, _VB = vslots.search, vblock.search


def _fresh():
    """Nothing remembered from another search (each variant pays for its own blocks)."""
    auto._DONE, vsearch._DONE, auto._CANDIDATES = Memo(32), Memo(32), Memo(64)
    vslots._ORDERS, vslots._BUILT, vblock._GRIDS = Memo(8), Memo(4096), Memo(8)


def run(setting, variant: str) -> tuple:
    _fresh()
    vslots.search = (lambda *a, **k: []) if variant in ("novs", "none") else _VS
    vblock.search = (lambda *a, **k: None) if variant in ("novb", "none") else _VB
    try:
        t = time.process_time()
        s = generate("v-auto", setting)
        cpu = time.process_time() - t
    finally:
        vslots.search, vblock.search = _VS, _VB
    r = simulate(s, setting)
    return round(r.makespan, 9), round(max(r.peak_memory), 9), round(cpu, 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ps", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--limits", type=float, nargs="+", default=[1.0], help="x p x M_B (1.0: 1F1B's peak)")
    ap.add_argument("--variants", nargs="+", default=["full", "none"], choices=VARIANTS)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "v_families.json"))
    a = ap.parse_args()
    if "full" not in a.variants:
        a.variants = ["full"] + a.variants
    rows = []
    for meta, st in settings(a.limits, ps=tuple(a.ps)):
        row = dict(meta, **{v: run(st, v) for v in a.variants})
        rows.append(row)
        f = row["full"]
        notes = [f"{v} {row[v][0] / f[0] - 1:+.3%} peak {row[v][1]:g}/{f[1]:g}" for v in a.variants[1:]
                 if row[v][0] > f[0] * (1 + 1e-9) or row[v][1] != f[1]]
        print(f"p={meta['p']:<3} m={meta['m']:<3} mw={meta['mw']:<5} {meta['cost']:<20} limit {meta['limit']:<5g} "
              f"full {f[0]:<10g} {f[2]:6.2f} s" + ("   " + "; ".join(notes) if notes else ""), flush=True)
    cpu = defaultdict(lambda: defaultdict(float))
    worse = defaultdict(lambda: defaultdict(int))
    for r in rows:
        key = f"p={r['p']} limit={r['limit'] / r['p']:g}x"
        for v in a.variants:
            cpu[key][v] += r[v][2]
            if v != "full" and (r[v][0] > r["full"][0] * (1 + 1e-9) or r[v][1] > r["full"][1] + 1e-9):
                worse[key][v] += 1
    print("\nper (P, limit): CPU seconds of each variant, settings where it is slower or holds more memory")
    for key in cpu:
        print(f"  {key:<18}" + "  ".join(f"{v} {cpu[key][v]:7.1f} s ({worse[key][v]} worse)" if v != "full"
                                          else f"full {cpu[key][v]:7.1f} s" for v in a.variants))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump({"variants": a.variants, "rows": rows}, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
