"""What `megatron-zb plan` costs (issue 32 item 6): CPU seconds of one plan for the Llama-3-8B
shape (32 layers, h 4096, 32 heads, s 4096, vocabulary 128256, ffn 14336, 80 GB), in one process
(``jobs=1``), with rows without vocabulary parallelism ('off'), with it only ('on') and both (the
default), and per row: each (schedule, vocabulary barriers or none) row's CPU seconds, the layouts
it built.

    OMP_NUM_THREADS=1 python benchmarks/bench_plan_speed.py [--sizes 8:32 16:64] [--modes off on both]
        [--search quick full] [--out benchmarks/results/plan_speed.json]

``--commands``: instead, the command lines as a user runs them (``megatron-zb plan ... --json``,
the 'within Megatron 1F1B's memory' re-plan included) for Llama-3-8B's shape (the issue's flags),
``--model llama-3-70b`` and ``--model llama-3.2-1b`` at ``--sizes`` (default 8:32 16:32), each in a
fresh process, ``--repeat`` times (the box's speed moves single runs by 15-30%): its CPU seconds
(user + sys, its worker processes included; each run's and their median), the best fitting row
and the row within 1F1B's memory (schedule, layout, time per iteration, bubble, peak GiB); with
``--search full`` as well, the same with ``--full-search`` (every row searched in full, as before
the quick first pass) beside it.

``--gaps``: how much the full search gains over plan's quick first pass, row by row: for each
``--gap-models`` entry (``model:P:M``; ``llama-3-8b-flags`` is the issue's shape at sequence 4096,
the others ``--model`` names at sequence 4096) every row searched quickly and left so, and every
row searched in full; per row the quick row's time over the full one's (where the full search adds
building blocks ``core.plan.FULL_MARGIN`` must cover its gains; elsewhere a row stays quick, its
flags saying so, and this says what that gives up).

CPU time (``time.process_time`` / ``getrusage``), not wall: the box is shared. A mode's rows run in
one fresh process each (nothing remembered from another mode's searches), as the command line runs them.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_zb.core import plan as P  # noqa: E402
from megatron_zb.core.plan import row as plan_row  # noqa: E402
from megatron_zb.core.costs.model import ModelSpec  # noqa: E402

SPEC = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=4096, vocab_size=128256,
            ffn_hidden_size=14336)


def _one_mode(args) -> dict:
    p, m, mode, search = args
    built = []
    orig = plan_row._one

    def timed(ctx, lay, padded):
        t = time.process_time()
        r = orig(ctx, lay, padded)
        built.append({"schedule": ctx.sp.name, "vocab": ctx.vocab, "layout": str(lay),
                      "cpu_s": round(time.process_time() - t, 3)})
        return r

    plan_row._one = timed
    t = time.process_time()
    rows = P.plan(P.PlanRequest(ModelSpec(**SPEC), p, m, 80, vocab=P.VocabLever(mode), search=search))
    total = time.process_time() - t
    per_row: dict = {}
    for b in built:
        key = f"{b['schedule']}{' +vocab' if b['vocab'] else ''}"
        per_row.setdefault(key, {"cpu_s": 0.0, "layouts": []})
        per_row[key]["cpu_s"] = round(per_row[key]["cpu_s"] + b["cpu_s"], 3)
        per_row[key]["layouts"].append(b["layout"])
    best = next((r for r in rows if "error" not in r and r["fits"]), None)
    return {"p": p, "m": m, "mode": mode, "search": search, "cpu_s": round(total, 3), "rows": per_row,
            "best": None if best is None else {"schedule": best["schedule"], "vocab": best.get("vocab_parallel"),
                                               "iteration_time_s": best["iteration_time_s"]}}


L8 = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--seq-length", "4096",
      "--vocab-size", "128256", "--ffn-hidden-size", "14336"]
MODELS = {"llama-3-8b (flags)": L8, "llama-3-70b": ["--model", "llama-3-70b"], "llama-3.2-1b": ["--model", "llama-3.2-1b"]}


def _brief(r):
    if not r:
        return None
    return {"schedule": r["schedule"], "vocab": r.get("vocab_parallel"), "layout": r["layout"],
            "iteration_ms": round(1e3 * r["iteration_time_s"], 3), "bubble": round(r["bubble_rate"], 4),
            "peak_gib": round(max(r["peak_bytes"]) / 1024 ** 3, 3), "fits": r["fits"],
            "search_effort": r.get("search_effort")}


def _command(model: str, p: int, m: int, search: str, jobs: int, repeat: int = 1) -> dict:
    cmd = [sys.executable, "-m", "megatron_zb.cli", "plan", *MODELS[model], "--pipeline-parallel-size", str(p),
           "--num-microbatches", str(m), "--gpu-memory-gb", "80", "--json", "--jobs", str(jobs)]
    if search == "full":
        cmd.append("--full-search")
    runs = []
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                             cwd=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                             env=dict(os.environ, OMP_NUM_THREADS="1")).stdout
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        runs.append(round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 2))
    cpu = sorted(runs)[len(runs) // 2]
    d = json.loads(out)
    rows = [r for r in d["rows"] if "error" not in r]
    best = next((r for r in rows if r["fits"]), rows[0] if rows else None)
    return {"model": model, "p": p, "m": m, "search": search, "jobs": jobs, "cpu_s": round(cpu, 2), "cpu_s_runs": runs,
            "best": _brief(best), "within_1f1b_memory": _brief(d["within_1f1b_memory"])}


def commands(a) -> int:
    out = []
    for size in a.sizes:
        p, m = (int(x) for x in size.split(":"))
        for model in MODELS:
            for search in a.search:
                r = _command(model, p, m, search, a.jobs, a.repeat)
                out.append(r)
                b, w = r["best"], r["within_1f1b_memory"]
                print(f"P={p:<3} M={m:<3} {model:<20} {search:<6} {r['cpu_s']:8.2f} s CPU   best "
                      f"{b['schedule']}{' +vocab' if b['vocab'] else ''} {b['iteration_ms']} ms {b['peak_gib']} GiB"
                      + (f"   within 1F1B: {w['schedule']}{' +vocab' if w['vocab'] else ''} {w['iteration_ms']} ms "
                         f"{w['peak_gib']} GiB" if w else ""), flush=True)
    path = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "plan_speed_commands.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"gpu_memory_gb": 80, "results": out}, f, indent=1)
    print(f"wrote {path}")
    return 0


GAP_MODELS = ["llama-3-8b-flags:8:32", "llama-3.2-1b:8:32", "llama-3-70b:8:32", "qwen2.5-7b:8:32",
              "mixtral-8x7b:8:32", "llama-3-8b-flags:4:16", "llama-3.2-1b:4:8"]


def gaps(a) -> int:
    from megatron_zb.core.costs.models import spec_kwargs
    out = []
    for item in a.gap_models:
        name, p, m = item.split(":")
        spec = ModelSpec(**SPEC) if name == "llama-3-8b-flags" else ModelSpec(**spec_kwargs(name, 4096))
        res = {}
        for search in ("quick", "full"):
            t = time.process_time()
            rows = P.plan(P.PlanRequest(spec, int(p), int(m), 80, vocab=P.VocabLever("both", embedding=True),
                                        search=search, refine=False))
            res[search] = ({f"{r['schedule']}{' +vocab' if r.get('vocab_parallel') else ''}":
                            (r["iteration_time_s"], max(r["peak_bytes"])) for r in rows if "error" not in r},
                           time.process_time() - t)
        quick, full = res["quick"][0], res["full"][0]
        row = {"model": name, "p": int(p), "m": int(m), "cpu_s": {k: round(v[1], 2) for k, v in res.items()},
               "rows": {k: {"quick_over_full": round(quick[k][0] / full[k][0] - 1, 6),
                            "peak_gib": [round(quick[k][1] / 1024 ** 3, 2), round(full[k][1] / 1024 ** 3, 2)]}
                        for k in quick if k in full}}
        out.append(row)
        print(f"{name} P={p} M={m}: quick {row['cpu_s']['quick']} s, full {row['cpu_s']['full']} s CPU")
        for k, g in sorted(row["rows"].items(), key=lambda kv: -kv[1]["quick_over_full"]):
            if abs(g["quick_over_full"]) > 1e-6:
                print(f"    {k:<26} quick/full - 1 = {g['quick_over_full']:+.3%}   peak GiB {g['peak_gib']}")
    path = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "plan_search_gaps.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"gpu_memory_gb": 80, "results": out}, f, indent=1)
    print(f"wrote {path}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=None, help="P:M pairs (default 8:32 16:64; --commands 8:32 16:32)")
    ap.add_argument("--modes", nargs="+", default=["off", "on", "both"], choices=["off", "on", "both"])
    ap.add_argument("--commands", action="store_true", help="the command lines for three models (above)")
    ap.add_argument("--search", nargs="+", default=["quick"], choices=["quick", "full"],
                    help="plan's search: quick first pass (default) and/or every row in full")
    ap.add_argument("--jobs", type=int, default=1, help="--commands: plan's --jobs (default 1)")
    ap.add_argument("--repeat", type=int, default=3, help="--commands: runs of each command (the median is quoted)")
    ap.add_argument("--gaps", action="store_true", help="the full search's gain over the quick pass, row by row")
    ap.add_argument("--gap-models", nargs="+", default=GAP_MODELS, metavar="MODEL:P:M")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.gaps:
        return gaps(a)
    if a.commands:
        a.sizes = a.sizes or ["8:32", "16:32"]
        return commands(a)
    a.sizes = a.sizes or ["8:32", "16:64"]
    a.out = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "plan_speed.json")
    jobs = [(int(s.split(":")[0]), int(s.split(":")[1]), mode, search) for s in a.sizes for mode in a.modes
            for search in a.search]
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    out = []
    for job in jobs:  # one fresh process per mode: nothing remembered between them
        with ctx.Pool(1) as pool:
            out.append(pool.apply(_one_mode, (job,)))
        r = out[-1]
        print(f"P={r['p']:<3} M={r['m']:<3} {r['mode']:<5} {r['search']:<6} {r['cpu_s']:8.2f} s CPU   best {r['best']}")
        for name, x in sorted(r["rows"].items(), key=lambda kv: -kv[1]["cpu_s"]):
            print(f"    {name:<24} {x['cpu_s']:7.2f} s  layouts built: {len(x['layouts'])}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump({"model": SPEC, "gpu_memory_gb": 80, "results": out}, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
