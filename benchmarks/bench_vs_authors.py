"""Our automatic schedulers against the ZB authors' public ones, setting by setting.

    python benchmarks/bench_vs_authors.py /path/to/zero-bubble-pipeline-parallelism \
        [--quick | --ps 4 8 16] [--ks 1 2 3 4] [--only zb|v] [--append [--reuse-theirs]] [--shard I/N]
        [--out benchmarks/results/vs_authors.json]

The authors' repository is not a dependency: give the path of a local checkout (e.g.
``git clone https://github.com/sail-sg/zero-bubble-pipeline-parallelism``); its scheduler files
are loaded from there (``benchmarks/authors.py``). Both sides get the same setting and their
schedules are timed by our simulator (``makespan`` = the longest rank span, the paper's measure).

Grid: p in {4, 8, 16}, m in {p, 2p, 3p, 4p}, M_W/M_B in {0.5, 0.88}, the cost sets below, and a
memory limit of {1, 1.5, 2} x p x M_B for ``zb-auto`` against ``zb.py``; ``v-auto`` against
``zbv.py`` (their adaptive V scheduler) and ``v_auto_schedule.py`` (their building-block search)
at {0.5, 0.75, 1, 1.5, 2} x p x M_B. A setting counts as worse / equal / better by the makespan
(relative tolerance 1e-9), and as "tie, less memory" where ours is slower by at most the
searches' tie (0.1%) with a lower peak than their fastest (ours keeps the least memory within
0.1% of the fastest it found: issue 26); where the authors' code finds no schedule, or one over
the limit in our memory model, it counts as "theirs: none". Prints the counts and every worse
or tied setting.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from authors import Authors  # noqa: E402
from megatron_zb.core.ir import Setting  # noqa: E402
from megatron_zb.core.schedules import generate  # noqa: E402
from megatron_zb.core.schedules.search.auto import TIE  # noqa: E402
from megatron_zb.core.sim.validate import validate  # noqa: E402

# name: (F, B, W, comm), whole-stage times
COSTS = {
    "unit": (1.0, 1.0, 1.0, 0.0),
    "B=2F": (1.0, 2.0, 1.0, 0.0),
    "1.5B (ZB Table 5)": (18.522, 18.086, 9.337, 0.601),
    "28.3B (ZB Table 5)": (10.419, 10.207, 7.715, 0.408),
    "H100 measured": (43.8, 59.2, 32.0, 0.5),
}
PS = (4, 8, 16)
MW = (0.5, 0.88)
ZB_LIMITS = (1.0, 1.5, 2.0)
V_LIMITS = (0.5, 0.75, 1.0, 1.5, 2.0)
REL = 1e-9
VERDICTS = ("worse", "tie, less memory", "equal", "better", "theirs: none")


def settings(limits, ps=PS, ks=(1, 2, 3, 4)):
    for p, k, mw, cost, lim in itertools.product(ps, ks, MW, COSTS, limits):
        f, b, w, c = COSTS[cost]
        yield dict(p=p, m=k * p, mw=mw, cost=cost, limit=lim * p), Setting(
            p, k * p, cost_f=f, cost_b=b, cost_w=w, cost_comm=c, mem_f=1.0, mem_w=mw, memory_limit=lim * p)


def theirs_makespan(sched, st, limit):
    """(makespan, peak) of their schedule, or (why not, None)."""
    if sched is None:
        return None, None
    try:
        res = validate(sched, st, memory_limit=float("inf"))
    except Exception as e:  # noqa: BLE001 - count an invalid schedule of theirs as none
        return f"invalid: {e}", None
    if max(res.peak_memory) > limit + 1e-9:
        return f"over the limit ({max(res.peak_memory):.3f})", None
    return res.makespan, max(res.peak_memory)


def compare(name, st, limit, others, known=None):
    """One setting: our schedule and the others' (``known``: their results from an earlier run of
    the same setting, used instead of running their code again)."""
    t0 = time.perf_counter()
    ours = generate(name, st)
    dt = time.perf_counter() - t0
    res = validate(ours, st)
    assert max(res.peak_memory) <= limit + 1e-9
    row = {"ours": res.makespan, "ours_bubble": res.bubble_rate, "ours_peak": max(res.peak_memory),
           "seconds": dt, "gap_to_lower_bound": ours.meta.get("gap_to_lower_bound")}
    best = best_peak = None
    for label, fn in others:
        v, peak = (known[label], known.get(label + "_peak")) if known and label in known else (None, None)
        slower = isinstance(v, float) and res.makespan > v * (1 + REL)
        if v is None or (slower and peak is None):  # not known, or their peak is needed and not kept
            v, peak = theirs_makespan(fn(st, limit), st, limit)
        row[label], row[label + "_peak"] = v, peak
        if isinstance(v, float) and (best is None or v < best):
            best, best_peak = v, peak
    row["theirs_best"] = best
    if best is None:
        row["verdict"] = "theirs: none"
    elif res.makespan < best * (1 - REL):
        row["verdict"] = "better"
    elif res.makespan <= best * (1 + REL):
        row["verdict"] = "equal"
    elif res.makespan <= best * (1 + TIE) + 1e-9 and row["ours_peak"] < best_peak - 1e-9:
        row["verdict"] = "tie, less memory"
    else:
        row["verdict"] = "worse"
    return row


def run(kind, A, ps=PS, ks=(1, 2, 3, 4), earlier=(), reuse_theirs=False, shard=(0, 1), save=None):
    """Compare over the grid; ``earlier``: rows of a previous run (``--append``) kept unless redone;
    with ``reuse_theirs`` their makespans in those rows stand for running their code again (it is
    deterministic and does not depend on ours)."""
    before = {_key(r): r for r in earlier}

    def merged():  # the earlier rows not run again, then this run's
        done = {_key(r) for r in rows}
        return [r for r in earlier if _key(r) not in done] + rows
    if kind == "zb":
        name, limits, others = "zb-auto", ZB_LIMITS, [("authors_zb", A.zb_schedule)]
    else:
        name, limits, others = "v-auto", V_LIMITS, [("authors_zbv", A.zbv_schedule),
                                                     ("authors_v_auto", A.vauto_schedule)]
    rows = []
    for i, (key, st) in enumerate(settings(limits, ps, ks)):
        if i % shard[1] != shard[0]:
            continue
        if kind == "v":
            st = Setting(**{**st.to_dict(), "chunks": 2})
        row = {**key, **compare(name, st, key["limit"], others,
                                known=before.get(_key(key)) if reuse_theirs else None)}
        rows.append(row)
        if save is not None:  # after every setting: an interrupted run keeps what it did
            save(summarize(name, merged(), quiet=True))
        if row["verdict"] in ("worse", "tie, less memory"):
            print(f"  {row['verdict']}: {name} {key}: ours {row['ours']:.6g} (peak {row['ours_peak']:.4g}) "
                  f"theirs {row['theirs_best']:.6g}", flush=True)
    return summarize(name, merged())


def _key(row):
    return tuple(row[k] for k in ("p", "m", "mw", "cost", "limit"))


def summarize(name, rows, quiet=False):
    counts = {v: sum(1 for r in rows if r["verdict"] == v) for v in VERDICTS}
    slow = max(rows, key=lambda r: r["seconds"])
    say = (lambda *a, **k: None) if quiet else print
    say(f"{name}: {len(rows)} settings: " + ", ".join(f"{k} {v}" for k, v in counts.items())
          + f"; slowest {slow['seconds']:.2f} s (p={slow['p']} m={slow['m']})", flush=True)
    by_limit = {}
    for r in rows:
        d = by_limit.setdefault(r["limit"] / r["p"], dict.fromkeys(VERDICTS, 0))
        d[r["verdict"]] += 1
    for lim, d in sorted(by_limit.items()):
        say(f"  limit {lim:g} x p: " + ", ".join(f"{k} {v}" for k, v in d.items()))
    return {"schedule": name, "ps": sorted({r["p"] for r in rows}), "counts": counts,
            "by_limit": {str(k): v for k, v in by_limit.items()}, "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("authors_repo", help="local checkout of sail-sg/zero-bubble-pipeline-parallelism")
    ap.add_argument("--only", choices=("zb", "v"), default=None)
    ap.add_argument("--quick", action="store_true", help="p in {4, 8} only (same as --ps 4 8)")
    ap.add_argument("--ps", type=int, nargs="+", default=None, help="pipeline sizes of the grid (default 4 8 16)")
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4], help="m = k x p for these k (default 1 2 3 4)")
    ap.add_argument("--append", action="store_true",
                    help="add to the rows already in --out (a grid run in parts); settings run again replace theirs")
    ap.add_argument("--reuse-theirs", action="store_true",
                    help="with --append: take the authors' results of settings already in --out from there "
                         "(after a change to ours, re-runs only ours)")
    ap.add_argument("--shard", default="0/1", metavar="I/N",
                    help="run only every N-th setting of the grid, from the I-th (0-based): N processes, one per core")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "vs_authors.json"))
    args = ap.parse_args()
    try:
        shard = tuple(int(x) for x in args.shard.split("/"))
        assert len(shard) == 2 and 0 <= shard[0] < shard[1]
    except (ValueError, AssertionError):
        ap.error(f"--shard {args.shard!r}: expected I/N with 0 <= I < N, e.g. 0/2")
    A = Authors(args.authors_repo)
    ps = tuple(args.ps) if args.ps else ((4, 8) if args.quick else PS)
    out = {}
    if (args.only or args.append) and os.path.exists(args.out):  # keep the other scheduler's results
        with open(args.out) as f:
            out = json.load(f)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)

    def save(kind, summary):
        out[kind] = summary
        with open(args.out + ".tmp", "w") as f:
            json.dump(out, f, indent=1)
        os.replace(args.out + ".tmp", args.out)
    for kind in ("zb", "v"):
        if args.only in (None, kind):
            earlier = out.get(kind, {}).get("rows", []) if args.append else []
            save(kind, run(kind, A, ps, tuple(args.ks), earlier, reuse_theirs=args.reuse_theirs, shard=shard,
                           save=lambda summary, kind=kind: save(kind, summary)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
