"""Runtime fidelity: measured iteration time of each schedule over real gloo processes, with
compute replaced by sleeps of given F/B/W durations, versus the simulator's makespan for the same
costs; and the measured speed-up of every schedule over 1F1B.

    OMP_NUM_THREADS=1 python benchmarks/bench_runtime_fidelity.py [--unit-ms 1] [--iterations 5]
        [--pp 4 2] [--schedules 1f1b zb-h1 ...] [--out benchmarks/results/runtime_fidelity.json]

Every pass sleeps ``cost * unit`` (``megatron_zb.runtime.emulate.sleep_passes``) and real small tensors
travel through the runtime's p2p (pairwise gloo groups), so what is measured is the executor's
ordering, the ranks waiting on each other, and the runtime's own overhead. Per case: one warm-up
iteration, then ``--iterations`` timed ones, a barrier before each; an iteration's time is the
slowest rank's (barrier exit to its last action done); the median over iterations is compared with
the simulated iteration time for the same costs (comm 0): the end of the last pass in
``simulate(...)``'s timeline, ranks starting together. That equals ``makespan`` (the contract's
max per-rank span) except where the rank finishing last also started late; both are reported
(``error_pct`` vs the iteration time, ``error_vs_makespan_pct`` vs the makespan). ``sim+hop`` re-simulates with the measured one-way
hop time of a small message (ping-pong) as ``cost_comm``, to show how much of the gap is p2p.
Sleeping ranks need no CPU, so P=4 ranks are fine on a 2-core machine.

``--iteration-model`` measures whole training iterations instead (issue 11): ``--iterations``
iterations back to back after ``--warmup`` ones, with the optimizer step as ``--optimizer-step-ms``
of sleep, (a) **synchronous**: after its last pass a rank joins an all-reduce over every rank
(Megatron's global norm / inf check), then steps; (b) **post-validated**: a rank steps at once and
starts its next iteration; the partial reductions go through ``runtime.features.postval`` (its own gloo
links and helper thread) and each rank waits for the result at the executor's validation point
(before its first backward). The steady-state time per iteration (the slowest rank's) is compared
with the simulator's ``iteration_time`` and ``iteration_time_post_validated`` (``core.sim.iteration``).
A schedule ``zb-auto@2p`` is zb-auto under a memory limit of 2 x P (2 x 1F1B's). Per mode the
median over the timed iterations of how far the slowest rank's end moved (the mean is in the JSON);
``wait`` is the worst rank's mean wait at its validation point.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

COST_SETS = {  # milliseconds per whole-stage pass (times unit-ms)
    "F=B=W=20": dict(cost_f=20, cost_b=20, cost_w=20),
    "F=20,B=30,W=15": dict(cost_f=20, cost_b=30, cost_w=15),
}


def cases_for(p, ms, schedules, cost_sets):
    from megatron_zb.core.schedules import get
    out = []
    for cname in cost_sets:
        for m in ms:
            for name in schedules:
                spec = get(name)
                chunks = 2 if spec.chunks is None else None
                out.append({"schedule": name, "p": p, "m": m, "chunks": chunks, "costs": cname,
                            "kw": COST_SETS[cname]})
    return out


def _setting(case):
    from megatron_zb.core.ir import Setting
    return Setting(case["p"], case["m"], chunks=case["chunks"], cost_comm=0.0, **case["kw"])


def simulate_case(case, comm=0.0):
    """(makespan, iteration time) in cost units for the costs of ``case``. The iteration time is
    the last pass's end over all ranks, every rank starting at 0 (as after a barrier); the
    contract's makespan (max per-rank span) is shorter when the rank that ends last also started
    late (zb-h2, V schedules: the loss-side rank waits for the first forward)."""
    import dataclasses

    from megatron_zb.core.schedules import generate
    from megatron_zb.core.sim.simulate import simulate
    st = _setting(case)
    sched = generate(case["schedule"], st)
    st = dataclasses.replace(st, chunks=sched.placement.chunks, cost_comm=comm)
    res = simulate(sched, st)
    return res.makespan, max(tl[-1].end for tl in res.timeline if tl)


def rank_main(rank, world, port, cases, unit, iterations, warmup, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    from megatron_zb.core.sim.lower import lower
    from megatron_zb.core.schedules import generate
    from megatron_zb.runtime.p2p import P2P, PairGroups
    from megatron_zb.runtime.emulate.sleep_passes import sleep_passes, time_iterations
    from megatron_zb.verify.timing.emulate import ping_pong

    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = PairGroups(list(range(world)), {(a, b) for a in range(world) for b in range(a + 1, world)})
    p2p = P2P(groups, rank, timeout_s=120)
    hops = ping_pong(groups, rank, world)
    everyone = [None] * world
    dist.all_gather_object(everyone, hops)
    hop = statistics.median([x for xs in everyone for x in xs]) if world > 1 else 0.0
    results = []
    for case in cases:
        try:
            st = _setting(case)
            low = lower(generate(case["schedule"], st))
            passes = sleep_passes(st, rank, low.placement, unit=unit)
            times = time_iterations(low, rank, passes, p2p, iterations, warmup=warmup)
            err = None
        except Exception as e:  # generation errors are identical on every rank
            times, err = [], f"{type(e).__name__}: {e}"
        allt = [None] * world
        dist.all_gather_object(allt, (times, err))
        if rank == 0:
            errs = [e for _, e in allt if e]
            per_iter = [max(ts) for ts in zip(*[t for t, _ in allt])] if not errs else []
            results.append({"per_iteration_s": per_iter, "error": errs[0] if errs else None})
    if rank == 0:
        q.put({"hop_s": hop, "results": results})
    dist.barrier()
    groups.destroy()
    dist.destroy_process_group()


def _iteration_setting(case):
    from megatron_zb.core.ir import Setting
    name, _, lim = case["schedule"].partition("@")
    limit = 2.0 * case["p"] if lim == "2p" else None
    return name, Setting(case["p"], case["m"], chunks=case["chunks"], cost_comm=0.0, memory_limit=limit, **case["kw"])


def simulate_iterations_case(case, opt_units):
    from megatron_zb.core.sim.iteration import iteration_times
    from megatron_zb.core.schedules import generate
    import dataclasses
    name, st = _iteration_setting(case)
    sched = generate(name, st)
    st = dataclasses.replace(st, chunks=sched.placement.chunks)
    it = iteration_times(sched, st, opt_units, cost_postval=opt_units)  # the emulated steps sleep alike
    return it.iteration_time, it.iteration_time_post_validated


def rank_main_iterations(rank, world, port, cases, unit, opt_s, iterations, warmup, q):
    """Training iterations back to back, synchronous vs post-validated optimizer step."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    from megatron_zb.core.sim.lower import lower
    from megatron_zb.core.schedules import generate
    from megatron_zb.runtime.executor import execute
    from megatron_zb.runtime.hooks import Hook
    from megatron_zb.runtime.p2p import P2P, PairGroups
    from megatron_zb.runtime.features.postval import PostValidation
    from megatron_zb.runtime.emulate.sleep_passes import precise_sleep, sleep_passes

    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = PairGroups(list(range(world)), {(a, b) for a in range(world) for b in range(a + 1, world)})
    p2p = P2P(groups, rank, timeout_s=120)
    world_group = dist.new_group(list(range(world)))
    flag = torch.zeros(2)
    results = []
    for case in cases:
        name, st = _iteration_setting(case)
        low = lower(generate(name, st))
        passes = sleep_passes(st, rank, low.placement, unit=unit)
        out = {}
        for mode in ("synchronous", "post-validated"):
            pv = PostValidation(timeout_s=120) if mode == "post-validated" else None
            if pv is not None:
                pv.channel(world_group)  # collective set-up outside the timed loop
            ends, waits = [], []

            class TimedValidation(Hook):  # time spent waiting at the validation point
                def validate(self, pv=pv):
                    t = time.perf_counter()
                    ok = pv.validate()
                    waits.append(time.perf_counter() - t)
                    return ok
            dist.barrier()
            t0 = time.perf_counter()
            for it in range(warmup + iterations):
                execute(low.orders[rank], rank, low.placement, passes, p2p,
                        hooks=[TimedValidation()] if pv is not None and pv.due else [])
                p2p.reap_sends(block=True)
                if pv is None:
                    dist.all_reduce(flag, group=world_group)  # Megatron's global norm / inf check
                    precise_sleep(opt_s)
                else:
                    precise_sleep(opt_s)  # the eager step, then the reduction along the pipeline
                    pv.submit(world_group, it, torch.zeros(3, dtype=torch.float64),
                              judge=lambda full: True, recover=lambda: None)
                ends.append(time.perf_counter() - t0)
            if pv is not None:
                pv.finish()
            allends = [None] * world
            dist.all_gather_object(allends, ends)
            slowest = [max(e[i] for e in allends) for i in range(len(ends))]
            # per iteration: how far the slowest rank's end moved; the median resists one-off stalls
            # of a busy machine (the mean is kept too)
            steps = [b - a for a, b in zip([0.0] + slowest, slowest)][warmup:]
            out[mode] = statistics.median(steps)
            out[mode + " mean"] = sum(steps) / len(steps)
            allwaits = [None] * world
            dist.all_gather_object(allwaits, waits[warmup:])
            out[mode + " wait"] = max((sum(w) / len(w) for w in allwaits if w), default=0.0)
        results.append(out)
    if rank == 0:
        q.put({"results": results})
    dist.barrier()
    groups.destroy()
    dist.destroy_process_group()


def run_iteration_cases(p, cases, unit, opt_ms, iterations=8, warmup=2, timeout=1800):
    """Synchronous vs post-validated time per iteration, measured and simulated; rows."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=rank_main_iterations,
                         args=(r, p, port, cases, unit, opt_ms / 1e3, iterations, warmup, q)) for r in range(p)]
    for pr in procs:
        pr.start()
    try:
        got = q.get(timeout=timeout)
    finally:
        for pr in procs:
            pr.join(timeout=30)
            if pr.is_alive():
                pr.kill()
    rows = []
    for case, res in zip(cases, got["results"]):
        sim_sync, sim_post = simulate_iterations_case(case, opt_ms / 1e3 / unit)
        row = {k: case[k] for k in ("schedule", "p", "m", "costs")}
        row.update(unit_s=unit, optimizer_step_s=opt_ms / 1e3,
                   simulated_sync_s=sim_sync * unit, measured_sync_s=res["synchronous"],
                   simulated_post_s=sim_post * unit, measured_post_s=res["post-validated"])
        row["mean_sync_s"], row["mean_post_s"] = res["synchronous mean"], res["post-validated mean"]
        row["validation_wait_s"] = res["post-validated wait"]  # the worst rank's mean wait per iteration
        row["error_sync_pct"] = 100 * (row["measured_sync_s"] - row["simulated_sync_s"]) / row["simulated_sync_s"]
        row["error_post_pct"] = 100 * (row["measured_post_s"] - row["simulated_post_s"]) / row["simulated_post_s"]
        rows.append(row)
    base = {(r["p"], r["m"], r["costs"]): r for r in rows if r["schedule"] == "zb-h1"}
    for r in rows:
        b = base.get((r["p"], r["m"], r["costs"]))
        if b:
            r["gain_vs_zbh1_sync_measured"] = b["measured_sync_s"] / r["measured_sync_s"]
            r["gain_vs_zbh1_post_measured"] = b["measured_post_s"] / r["measured_post_s"]
    return rows


def fmt_iteration_table(rows):
    head = (f"{'schedule':<12}{'P':>2}{'M':>4} {'costs (ms)':<15}{'sync sim':>9}{'meas':>8}{'err %':>7}"
            f"{'postval sim':>12}{'meas':>8}{'err %':>7}{'wait':>6}{'vs zb-h1 sync':>14}{'postval':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['schedule']:<12}{r['p']:>2}{r['m']:>4} {r['costs']:<15}{r['simulated_sync_s'] * 1e3:>9.1f}"
                     f"{r['measured_sync_s'] * 1e3:>8.1f}{r['error_sync_pct']:>+7.2f}"
                     f"{r['simulated_post_s'] * 1e3:>12.1f}{r['measured_post_s'] * 1e3:>8.1f}"
                     f"{r['error_post_pct']:>+7.2f}{r['validation_wait_s'] * 1e3:>6.1f}"
                     f"{r.get('gain_vs_zbh1_sync_measured', float('nan')):>14.3f}"
                     f"{r.get('gain_vs_zbh1_post_measured', float('nan')):>8.3f}")
    return "\n".join(lines)


def main_iterations(args):
    unit = args.unit_ms / 1e3
    schedules = args.schedules or ["1f1b", "zb-h1", "zb-h2", "zb-auto@2p", "zb-v"]
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    t0 = time.perf_counter()
    rows = []
    for p in args.pp:
        ms = args.microbatches or [2 * p]
        cases = [{"schedule": n, "p": p, "m": m, "chunks": None, "costs": c, "kw": COST_SETS[c]}
                 for c in args.costs for m in ms for n in schedules]
        got = run_iteration_cases(p, cases, unit, args.optimizer_step_ms, args.iterations, args.warmup)
        print(f"\nP={p}: time per training iteration (ms), optimizer step {args.optimizer_step_ms:g} ms")
        print(fmt_iteration_table(got), flush=True)
        rows += got
    errs = [abs(r[k]) for r in rows for k in ("error_sync_pct", "error_post_pct")]
    summary = {"within_5pct": sum(e <= 5 for e in errs), "figures": len(errs),
               "max_abs_error_pct": max(errs), "median_abs_error_pct": statistics.median(errs)}
    print(f"\n{summary['within_5pct']}/{len(errs)} figures within 5% of the simulated ones; max |error| "
          f"{summary['max_abs_error_pct']:.2f}%, median {summary['median_abs_error_pct']:.2f}%; "
          f"wall {time.perf_counter() - t0:.0f} s; load average before {load_before}")
    out = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
           "loadavg_before": load_before, "loadavg_after": os.getloadavg() if hasattr(os, "getloadavg") else None,
           "unit_s": unit, "optimizer_step_ms": args.optimizer_step_ms, "iterations": args.iterations,
           "warmup": args.warmup, "summary": summary, "rows": rows}
    path = args.out if args.out != "benchmarks/results/runtime_fidelity.json" else \
        "benchmarks/results/runtime_fidelity_iterations.json"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")
    return out


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cases(p, cases, unit, iterations=5, warmup=1, timeout=1800):
    """Run ``cases`` on ``p`` spawned gloo ranks; returns (rows, hop seconds)."""
    import torch.multiprocessing as mp
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=rank_main, args=(r, p, port, cases, unit, iterations, warmup, q))
             for r in range(p)]
    for pr in procs:
        pr.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                got = q.get(timeout=1)
                break
            except queue.Empty:
                dead = [r for r, pr in enumerate(procs) if pr.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank(s) {dead} exited with an error (see their output above)")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no result after {timeout} s")
    finally:
        for pr in procs:
            pr.join(timeout=30)
            if pr.is_alive():
                pr.kill()
    rows = []
    for case, res in zip(cases, got["results"]):
        row = {k: case[k] for k in ("schedule", "p", "m", "chunks", "costs")}
        row["unit_s"] = unit
        if res["error"]:
            row["error"] = res["error"]
            rows.append(row)
            continue
        mk, end = simulate_case(case)
        _, end_hop = simulate_case(case, comm=got["hop_s"] / unit)
        meas = statistics.median(res["per_iteration_s"])
        row.update(makespan_s=mk * unit, simulated_s=end * unit, simulated_with_hop_s=end_hop * unit,
                   measured_s=meas, per_iteration_s=res["per_iteration_s"],
                   error_pct=100.0 * (meas - end * unit) / (end * unit),
                   error_vs_makespan_pct=100.0 * (meas - mk * unit) / (mk * unit),
                   error_with_hop_pct=100.0 * (meas - end_hop * unit) / (end_hop * unit))
        rows.append(row)
    # speed-ups over 1f1b (same p, m, costs)
    base = {(r["p"], r["m"], r["costs"]): r for r in rows if r["schedule"] == "1f1b" and "error" not in r}
    for r in rows:
        b = base.get((r["p"], r["m"], r["costs"]))
        if b and "error" not in r:
            r["speedup_measured"] = b["measured_s"] / r["measured_s"]
            r["speedup_simulated"] = b["simulated_s"] / r["simulated_s"]
    return rows, got["hop_s"]


def fmt_table(rows):
    head = (f"{'schedule':<17}{'P':>2}{'M':>4} {'costs (ms)':<15}{'makespan':>9}{'sim iter':>9}{'measured':>9}"
            f"{'err %':>7}{'sim+hop':>9}{'err %':>7}{'x1f1b meas':>11}{'x1f1b sim':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['schedule']:<17}{r['p']:>2}{r['m']:>4} {r['costs']:<15}  error: {r['error'][:60]}")
            continue
        lines.append(f"{r['schedule']:<17}{r['p']:>2}{r['m']:>4} {r['costs']:<15}{r['makespan_s'] * 1e3:>9.1f}"
                     f"{r['simulated_s'] * 1e3:>9.1f}"
                     f"{r['measured_s'] * 1e3:>9.1f}{r['error_pct']:>+7.2f}{r['simulated_with_hop_s'] * 1e3:>9.1f}"
                     f"{r['error_with_hop_pct']:>+7.2f}{r.get('speedup_measured', float('nan')):>11.3f}"
                     f"{r.get('speedup_simulated', float('nan')):>10.3f}")
    return "\n".join(lines)


def main(argv=None):
    from megatron_zb.core.schedules import names
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--unit-ms", type=float, default=1.0, help="seconds per cost unit, in ms (costs are 20/30/15)")
    ap.add_argument("--iterations", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--pp", type=int, nargs="+", default=[4, 2])
    ap.add_argument("--microbatches", type=int, nargs="+", default=None,
                    help="default: 8 16 for P=4, 8 for P=2")
    ap.add_argument("--schedules", nargs="+", default=None, help="default: every registered schedule")
    ap.add_argument("--costs", nargs="+", default=list(COST_SETS), choices=list(COST_SETS))
    ap.add_argument("--out", default="benchmarks/results/runtime_fidelity.json")
    ap.add_argument("--iteration-model", action="store_true",
                    help="time whole training iterations: synchronous vs post-validated optimizer step")
    ap.add_argument("--optimizer-step-ms", type=float, default=10.0, help="with --iteration-model (default 10)")
    args = ap.parse_args(argv)
    if args.iteration_model:
        return main_iterations(args)
    schedules = args.schedules or names()
    if "1f1b" not in schedules:
        schedules = ["1f1b"] + schedules
    unit = args.unit_ms / 1e3
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    all_rows, hops = [], {}
    t0 = time.perf_counter()
    for p in args.pp:
        ms = args.microbatches or ([8, 16] if p >= 4 else [8])
        rows, hop = run_cases(p, cases_for(p, ms, schedules, args.costs), unit, args.iterations, args.warmup)
        hops[p] = hop
        print(f"\nP={p}: one-way hop of a small gloo message {hop * 1e6:.0f} us")
        print(fmt_table(rows), flush=True)
        all_rows += rows
    ok = [r for r in all_rows if "error" not in r]
    summary = {
        "cases": len(all_rows), "errors": len(all_rows) - len(ok),
        "max_abs_error_vs_makespan_pct": max(abs(r["error_vs_makespan_pct"]) for r in ok) if ok else None,
        "max_abs_error_pct": max(abs(r["error_pct"]) for r in ok) if ok else None,
        "median_abs_error_pct": statistics.median(abs(r["error_pct"]) for r in ok) if ok else None,
        "within_5pct": sum(abs(r["error_pct"]) <= 5 for r in ok),
        "max_abs_error_with_hop_pct": max(abs(r["error_with_hop_pct"]) for r in ok) if ok else None,
    }
    print(f"\n{summary['within_5pct']}/{len(ok)} cases within 5% of the simulated iteration time; "
          f"max |error| {summary['max_abs_error_pct']:.2f}%, median {summary['median_abs_error_pct']:.2f}%; "
          f"wall {time.perf_counter() - t0:.0f} s")
    out = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
           "loadavg_before": load_before, "loadavg_after": os.getloadavg() if hasattr(os, "getloadavg") else None,
           "unit_s": unit, "iterations": args.iterations, "warmup": args.warmup,
           "hop_s": {str(k): v for k, v in hops.items()}, "summary": summary, "rows": all_rows}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
