"""The ZB paper's Table-5 settings at half of 1F1B's activation memory with activation offload
(issue 26, item 3): v-auto and zb-auto with ``--offload-ratio auto --offload-time 0.5``.

    python benchmarks/bench_offload_table5.py                     # all 12 settings, both schedules
    python benchmarks/bench_offload_table5.py --models 28.3B --schedules v-auto --microbatches 256

Costs per stage from the ZB paper's Table 5 (F, B, W, comm in ms); memory in units of one
microbatch's stage activation M_B = 34h + 5as (mem-f = 1, mem-w = 32h / M_B, s = 1024), as
``benchmarks/bench_schedules.py`` normalises them; the limit is P/2 (1F1B's peak is P); K = 0.5
(one stage activation's copy takes 0.5 x (F + B)). Each row: bubble, makespan, peak (max over
ranks), parts offloaded and generation time (``core.build.build``, CPU seconds by
``time.process_time``; the box may be shared, so not wall-clock). ``digest``: a hash of the built
schedule's orders (a refactoring of the search must leave it as it is).
Writes benchmarks/results/offload_table5.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_zb.core.build import OffloadRequest, ScheduleRequest, build  # noqa: E402
from megatron_zb.core.ir import ScheduleError  # noqa: E402

# model: (P, microbatch counts, F, B, W, comm, hidden h, attention heads a) -- ZB paper, Tables 3 and 5
MODELS = {
    "1.5B": (8, (24, 32, 64), 18.522, 18.086, 9.337, 0.601, 2304, 24),
    "6.2B": (8, (24, 32, 64), 29.718, 29.444, 19.927, 0.527, 4096, 32),
    "14.6B": (16, (48, 64, 128), 11.347, 11.248, 8.132, 0.377, 5120, 40),
    "28.3B": (32, (96, 128, 256), 10.419, 10.207, 7.715, 0.408, 6144, 48),
}
SEQ = 1024


def request(name: str, model: str, k: float = 0.5, limit_x: float = 0.5) -> ScheduleRequest:
    p, _, f, b, w, comm, h, a = MODELS[model]
    m_b = 34 * h + 5 * a * SEQ
    return ScheduleRequest(name, cost_f=[f], cost_b=[b], cost_w=[w], cost_comm=comm, mem_f=[1.0],
                           mem_w=[32 * h / m_b], memory_limit=limit_x * p,
                           offload=OffloadRequest(ratio="auto", time=k))


def row(name: str, model: str, m: int, k: float = 0.5) -> dict:
    p = MODELS[model][0]
    req = request(name, model, k)
    t0 = time.process_time()
    try:
        built = build(req, p, m)
    except ScheduleError as e:
        return {"schedule": name, "model": model, "stages": p, "microbatches": m, "error": str(e),
                "cpu_s": round(time.process_time() - t0, 3)}
    cpu = time.process_time() - t0
    res = built.result
    off = res.offload
    digest = hashlib.sha256(repr([[str(a) for a in o] for o in built.schedule.orders]).encode()).hexdigest()[:16]
    return {"schedule": name, "model": model, "stages": p, "microbatches": m, "limit": req.memory_limit,
            "offload_time": k, "bubble": res.bubble_rate, "makespan": res.makespan,
            "peak": max(res.peak_memory), "offloaded": sum(off.offloaded) if off is not None else 0,
            "offloaded_w": sum(off.offloaded_w) if off is not None else 0,
            "retargeted_from": built.schedule.meta.get("retargeted_from"), "cpu_s": round(cpu, 3), "digest": digest}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--schedules", nargs="+", default=["v-auto", "zb-auto"])
    ap.add_argument("--microbatches", type=int, nargs="+", default=None, help="only these counts")
    ap.add_argument("--offload-time", type=float, default=0.5)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "offload_table5.json"))
    a = ap.parse_args(argv)
    rows = []
    hdr = f"{'model':<6} {'P':>3} {'M':>4} {'schedule':<8} {'bubble':>8} {'makespan':>10} {'peak':>6} " \
          f"{'off':>5} {'off W':>5} {'from M':>6} {'CPU s':>6}"
    print(f"half of 1F1B's activation memory (limit P/2 x M_B), offload ratio auto, K={a.offload_time:g}")
    print(hdr)
    print("-" * len(hdr))
    for model in a.models:
        p, counts = MODELS[model][:2]
        for m in counts:
            if a.microbatches and m not in a.microbatches:
                continue
            for name in a.schedules:
                r = row(name, model, m, a.offload_time)
                rows.append(r)
                if "error" in r:
                    print(f"{model:<6} {p:>3} {m:>4} {name:<8} error: {r['error']}")
                    continue
                print(f"{model:<6} {p:>3} {m:>4} {name:<8} {100 * r['bubble']:>7.2f}% {r['makespan']:>10.3f} "
                      f"{r['peak']:>6.3f} {r['offloaded']:>5} {r['offloaded_w']:>5} "
                      f"{r['retargeted_from'] or '-':>6} {r['cpu_s']:>6.2f}", flush=True)
    print(markdown(rows))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"command": "python benchmarks/bench_offload_table5.py "
                   + " ".join(argv if argv is not None else sys.argv[1:]),
                   "models": {k: dict(zip(("stages", "microbatches", "cost_f", "cost_b", "cost_w", "cost_comm",
                                           "hidden", "heads"), v)) for k, v in MODELS.items()},
                   "seq_length": SEQ, "offload_time": a.offload_time, "time": "CPU seconds (time.process_time)",
                   "rows": rows}, f, indent=1)
    print(f"wrote {a.out}")


def markdown(rows) -> str:
    """docs/offload.md's rows: per model and M, bubble (%) / CPU seconds of each schedule."""
    cell = {(r["model"], r["microbatches"], r["schedule"]): r for r in rows}
    out = []
    for (model, m) in dict.fromkeys((r["model"], r["microbatches"]) for r in rows):
        cells = []
        for name in ("v-auto", "zb-auto"):
            r = cell.get((model, m, name))
            cells.append("-" if r is None else "error" if "error" in r else
                         f"{100 * r['bubble']:.2f} / {r['cpu_s']:.1f} s")
        out.append(f"| {model} ({MODELS[model][0]}) | {m} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
