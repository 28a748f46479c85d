"""MoE expert-parallel all-to-all overlap against Megatron's combined 1F1B (issue 27, item 4).

    OMP_NUM_THREADS=1 python benchmarks/bench_moe_overlap.py [--emulate-stages 8] [--unit-ms 10]
        [--out benchmarks/results/moe_overlap.json]

A DeepSeek-like cost profile: per whole stage F = B = W = 1 (compute), and an all-to-all
(dispatch + combine) in every F, B and fused BW that is 30% or 50% of the pass (a2a = 0.43 or 1.0),
at P = 8 and P = 16 pipeline ranks with M = 4P microbatches. Each setting compares:

* **Megatron combined 1F1B** (the anchor): Megatron's interleaved 1F1B, 2 chunks per rank, with
  ``--overlap-moe-expert-parallel-comm``: one more warm-up forward, then every steady-state F and
  B one overlapped pair (``core.schedules.interleaved.combined_1f1b``);
* Megatron's interleaved 1F1B without the overlap (all-to-all serial), for reference;
* **dualpipe-v** and **zb-v** with EP overlap (the pairs the core forms, ``core.passes.pairing``) at their
  own activation memory, and zb-v with the memory Megatron's combined 1F1B uses as its limit
  (``zb-v @ Megatron's memory``: the core may then move forwards one backward earlier).

An overlapped pair charges each pass's all-to-all only where the other's compute does not hide it
(``core.sim.simulate.paired_cost``) and starts once both passes have their inputs. Simulated: the
time of one training iteration (synchronous optimizer step, no p2p cost). Emulated (``--emulate-
stages``; 0 skips): the same schedules on that many real gloo processes, each pass sleeping its
cost (``--unit-ms`` per cost unit) and the pairs sleeping what the simulator charges them, real
point-to-point messages between them (``megatron_zb.verify.timing.emulate``); the prediction then
includes the measured message time. Peak activation: the largest over the ranks, in units of one
microbatch's activation of a whole 1F1B stage.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_zb.core.ir import Setting  # noqa: E402
from megatron_zb.core.sim.simulate import simulate  # noqa: E402
from megatron_zb.verify.timing.emulate import COMBINED_1F1B, Entry, Timing, emulate, predicted_iteration, schedule_for  # noqa: E402

SHARES = (0.3, 0.5)  # the all-to-all's share of a pass: a2a / (compute + a2a)
STAGES = (8, 16)
ANCHOR = "Megatron combined 1F1B"


def entries(limit: float):
    """(label, Entry) of one setting; ``limit``: the anchor's peak activation."""
    return [(ANCHOR, Entry(COMBINED_1F1B, label=ANCHOR)),
            ("Megatron interleaved 1F1B, no EP overlap",
             Entry("interleaved-1f1b", label="Megatron interleaved 1F1B, no EP overlap", a2a_overlap=False)),
            ("dualpipe-v + EP overlap", Entry("dualpipe-v", label="dualpipe-v + EP overlap")),
            ("zb-v + EP overlap", Entry("zb-v", label="zb-v + EP overlap")),
            ("zb-v + EP overlap @ Megatron's memory",
             Entry("zb-v", label="zb-v + EP overlap @ Megatron's memory", memory_limit=limit))]


def setting(p: int, share: float, unit: float = 1.0, comm: float = 0.0) -> Setting:
    a2a = share / (1 - share)
    return Setting(p, 4 * p, cost_f=unit, cost_b=unit, cost_w=unit, cost_a2a=a2a * unit, cost_comm=comm)


def simulated(p: int, share: float) -> list:
    st = setting(p, share)
    anchor, ast = schedule_for(Entry(COMBINED_1F1B), st)
    limit = max(simulate(anchor, ast).peak_memory)
    rows = []
    for label, e in entries(limit):
        sched, s2 = schedule_for(e, st)
        res = simulate(sched, s2)
        rows.append({"schedule": label, "name": e.schedule, "iteration": predicted_iteration(e, st),
                     "makespan": res.makespan, "peak_activation": max(res.peak_memory),
                     "pairs": sum(1 for o in sched.orders for a in o if a.kind == "OVERLAP_F_B"),
                     "advanced_ranks": len(sched.meta.get("advanced_ranks", [])), "memory_limit": e.memory_limit})
    base = rows[0]["iteration"]
    for r in rows:
        r["speedup_vs_anchor"] = base / r["iteration"]
    return rows


def emulated(p: int, share: float, unit_ms: float, limit: float) -> list:
    st = setting(p, share)
    labelled = entries(limit)
    rows = emulate([e for _, e in labelled],
                   Setting(p, 4 * p, cost_f=unit_ms, cost_b=unit_ms, cost_w=unit_ms, cost_a2a=st.cost_a2a[0] * unit_ms),
                   Timing(unit_s=1e-3, iterations=2, warmup=1, timeout=900))
    out = []
    for r in rows:
        out.append({"schedule": r["label"], "measured_ms": r["measured"], "predicted_ms": r["predicted"],
                    "error_pct": r["error_pct"], "hop_ms": r["hop"], "per_iteration_ms": r["per_iteration"]})
    base = out[0]["measured_ms"]
    for r in out:
        r["speedup_vs_anchor"] = base / r["measured_ms"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--emulate-stages", type=int, nargs="*", default=[8],
                    help="pipeline sizes to emulate on real processes (default 8; 0 or none: skip)")
    ap.add_argument("--unit-ms", type=float, default=10.0, help="ms per cost unit in the emulation (default 10)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "moe_overlap.json"))
    a = ap.parse_args(argv)
    results = []
    for p in STAGES:
        for share in SHARES:
            t0 = time.time()
            sim = simulated(p, share)
            res = {"stages": p, "microbatches": 4 * p, "a2a_share": share,
                   "costs": {"f": 1.0, "b": 1.0, "w": 1.0, "a2a": round(share / (1 - share), 4)},
                   "simulated": sim, "simulate_s": round(time.time() - t0, 2)}
            if p in a.emulate_stages:
                t0, load = time.time(), os.getloadavg()[0]
                res["emulated"] = emulated(p, share, a.unit_ms, sim[0]["peak_activation"])
                res["emulated_unit_ms"] = a.unit_ms
                res["emulate_s"] = round(time.time() - t0, 1)
                res["load_average_before_after"] = [round(load, 2), round(os.getloadavg()[0], 2)]
            results.append(res)
            _print(res)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"cores": os.cpu_count(), "results": results}, f, indent=1)
        f.write("\n")
    print(f"wrote {a.out}")
    return 0


def _print(res: dict) -> None:
    em = {r["schedule"]: r for r in res.get("emulated", [])}
    print(f"\nP={res['stages']} M={res['microbatches']}, all-to-all {100 * res['a2a_share']:.0f}% of a pass "
          f"(F=B=W=1, a2a={res['costs']['a2a']:g} per F/B/BW of a stage)"
          + (f"; emulated with {res['emulated_unit_ms']:g} ms per unit, load average "
             f"{res['load_average_before_after'][0]:g} -> {res['load_average_before_after'][1]:g}" if "emulated" in res else ""))
    print(f"{'schedule':<42} {'sim iter':>9} {'vs anchor':>9} {'peak act':>9} {'pairs':>6}"
          + (f" {'emul ms':>9} {'pred ms':>9} {'err':>6} {'vs anchor':>9}" if em else ""))
    for r in res["simulated"]:
        line = (f"{r['schedule']:<42} {r['iteration']:>9.2f} {r['speedup_vs_anchor']:>8.3f}x "
                f"{r['peak_activation']:>9.2f} {r['pairs']:>6}")
        e = em.get(r["schedule"])
        if e:
            line += (f" {e['measured_ms']:>9.1f} {e['predicted_ms']:>9.1f} {e['error_pct']:>+5.1f}% "
                     f"{e['speedup_vs_anchor']:>8.3f}x")
        print(line)


if __name__ == "__main__":
    sys.exit(main())
