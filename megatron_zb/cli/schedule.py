"""`megatron-zb simulate`, `compare` and `plot`: one schedule's time, bubble and memory; every
schedule side by side; a schedule's timeline as a picture or a Chrome trace."""
from __future__ import annotations

import argparse
import json
import os
from typing import List, Optional

from ..argtypes import positive_int
from ..core.ir import io as sched_io
from ..core import schedules
from ..core.build import Built, ScheduleRequest, build
from ..core.passes.fuse import split_cost
from ..core.ir import OVERLAP, Schedule, ScheduleError
from ..core.sim.iteration import back_to_back, iteration_times
from ..core.plan import by_memory_among_ties
from . import varlen
from .common import (UsageError, add_exact_args, add_post_validation_arg, add_setting_args, build_from_args, fmt,
                     request, sizes, writable)


def add_parsers(sub) -> None:
    s = sub.add_parser("simulate", help="time, bubble and memory of one schedule")
    add_setting_args(s)
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--save", metavar="FILE", help="also write the schedule (.json or torch .csv)")
    add_exact_args(s)
    varlen.add_varlen_args(s, simulate=True)
    s.set_defaults(func=cmd_simulate)
    c = sub.add_parser("compare", help="every schedule for one setting in one table")
    add_setting_args(c, schedule_required=False)
    c.add_argument("--json", action="store_true")
    add_post_validation_arg(c, "rank by the time per iteration")
    c.add_argument("--schedules", nargs="+", metavar="NAME", default=None,
                   help="the rows to compare (default: every schedule; with --seq-lengths: "
                        + ", ".join(varlen.DEFAULT_SCHEDULES) + ")")
    varlen.add_varlen_args(c)
    c.set_defaults(func=cmd_compare)
    pl = sub.add_parser("plot", help="timeline picture (.png/.svg) or Chrome trace (.json)")
    add_setting_args(pl)
    pl.add_argument("--out", nargs="+", required=True, metavar="FILE")
    pl.add_argument("--time-unit", choices=["ms", "s", "us"], default="ms",
                    help="unit of the --cost-* values (default ms): the picture's axis and the trace's "
                         "microsecond timestamps follow it")
    pl.add_argument("--iterations", type=_plot_iterations, default=1,
                    help="draw 1 to 3 training iterations back to back (the optimizer barrier shows)")
    pl.add_argument("--memory", metavar="JSON",
                    help="draw a run's measured activation memory under the timeline: a profile JSON written with "
                         "--zero-bubble-profile-window, or the output of verify --json (their memory_traces)")
    add_post_validation_arg(pl, "draw the iterations")
    pl.set_defaults(func=cmd_plot)


def _memory_traces(path: str):
    """The per-rank measured activation traces of a profile JSON or of verify --json's output."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise UsageError(f"--memory {path!r}: cannot read it ({e.strerror})") from None
    data = None
    for chunk in (text, text.strip().splitlines()[-1] if text.strip() else ""):  # verify prints JSON last
        try:
            data = json.loads(chunk)
            break
        except ValueError:
            continue
    traces = data.get("memory_traces") if isinstance(data, dict) else None
    if not (isinstance(traces, list) and traces and all(isinstance(t, list) for t in traces)
            and all(isinstance(row, dict) and isinstance(row.get("pass"), str)
                    and isinstance(row.get("bytes"), (int, float)) for t in traces for row in t)):
        raise UsageError(f"--memory {path!r}: no measured memory traces in it (memory_traces: written by a profile "
                         "window or verify --json)")
    return traces


def _plot_iterations(text):
    v = positive_int("--iterations")(text)
    if v > 3:
        raise argparse.ArgumentTypeError(f"--iterations draws 1 to 3 iterations, got {v}")
    return v


def _result_dict(built: Built, it) -> dict:
    sched, setting = built.schedule, built.setting
    d = built.result.to_dict()
    d.update(it.to_dict())
    d.update(_split(built))
    for k in ("lower_bound", "gap_to_lower_bound", "exact"):
        if k in sched.meta:
            d[k] = sched.meta[k]
    d.update({"placement": sched.placement.style, "cost_f": setting.cost_f, "cost_b": setting.cost_b,
              "cost_w": setting.cost_w, "cost_bw": setting.cost_bw, "cost_comm": setting.cost_comm,
              "cost_a2a": setting.cost_a2a,
              "a2a_overlap": setting.a2a_overlap, "mem_f": setting.mem_f,
              "mem_w": setting.mem_w, "memory_limit": setting.memory_limit})
    if any(setting.cost_a2a):
        d.update(overlap_pairs=_pair_count(sched), advanced_ranks=sched.meta.get("advanced_ranks", []))
    return d


def _split(built: Built) -> dict:
    """What the split backward costs the built schedule (only where --cost-bw makes it cost)."""
    if built.setting.cost_bw is None:
        return {}
    return {"split_cost": round(split_cost(built.schedule, built.setting), 10),
            "fused_backwards": built.schedule.meta.get("fused_backwards", 0)}


def _pair_count(sched: Schedule) -> int:
    return sum(1 for o in sched.orders for a in o if a.kind == OVERLAP)


def _row_request(args):
    """compare's request of one row (its chunks: --chunks for the schedules that take them)."""
    def of(name):
        spec = schedules.get(name)
        return request(args, name=name, chunks=args.chunks if spec.chunks is None else None, p=args.stages)
    return of


def cmd_simulate(args) -> int:
    varlen.check_varlen_args(args, "simulate")
    if args.seq_lengths:
        return varlen.cmd_simulate_varlen(args, _row_request(args))
    if args.save:
        writable("--save", args.save)
    built = build_from_args(args)
    sched, setting = built.schedule, built.setting
    it = iteration_times(sched, setting, args.cost_optimizer, args.cost_optimizer_post_validated)
    if args.save:
        _save_schedule(sched, args.save)
    if args.json:
        print(json.dumps(_result_dict(built, it)))
        return 0
    d = built.result.to_dict()
    print(f"schedule      {sched.name} (placement {sched.placement.style}, {d['chunks']} chunk(s)/rank)")
    print(f"stages        {setting.stages}   microbatches {sched.num_microbatches}")
    print(f"makespan      {d['makespan']:g}")
    print(f"bubble rate   {d['bubble_rate']:.4f}")
    print(f"iteration     {it.iteration_time:g} with Megatron's synchronous optimizer step, "
          f"{it.iteration_time_post_validated:g} with optimizer post-validation"
          + (f" (optimizer step {args.cost_optimizer:g})" if args.cost_optimizer else ""))
    print("peak memory   " + " ".join(f"{x:g}" for x in d["peak_memory"]) + "   (per rank, mem-f units)")
    if any(setting.cost_a2a):
        adv = sched.meta.get("advanced_ranks")
        print(f"all-to-all    {fmt(setting.cost_a2a)} per F/B/BW of a stage; {_pair_count(sched)} overlapped F&B pairs "
              + ("hide it behind each other's compute" if setting.a2a_overlap else "(not hidden: --no-overlap)")
              + (f"; forwards one backward earlier on rank(s) {', '.join(map(str, adv))}" if adv else ""))
    if "gap_to_lower_bound" in sched.meta:
        print(f"lower bound   {sched.meta['lower_bound']:g}   (gap {sched.meta['gap_to_lower_bound']:.4f})")
    if "exact" in sched.meta:
        e = sched.meta["exact"]
        print(f"exact (MILP)  {e['status']}; heuristic makespan {e['heuristic_makespan']:g}, nodes {e.get('nodes', 0)}")
    if "offload" in d:
        o = d["offload"]
        print("offload       " + f"K={fmt(o['time'] if isinstance(o['time'], list) else [o['time']])} "
              f"{'full' if o['overlap'] else 'half'} duplex; activations offloaded per rank "
              + " ".join(str(x) for x in o["offloaded"]) + "; W parts " + " ".join(str(x) for x in o["offloaded_w"]))
        print("without it    " + " ".join(f"{x:g}" for x in o["peak_memory_without_offload"])
              + "   (peak memory per rank)")
    if "weight_copies" in d:
        print("weights       " + " ".join(f"{x:g}" for x in d["weight_copies"]) +
              "   (per rank, in 1F1B stages: replicated stages hold a second copy)")
        last = max((s["end"] for s in d["gradient_syncs"]), default=0.0)
        print(f"replica sync  {len(d['gradient_syncs'])} all-reduces, the last ends at {last:g}")
    return 0


def _save_schedule(sched: Schedule, path: str):
    if path.endswith(".csv"):
        text = sched_io.to_csv(sched)
    elif path.endswith(".json"):
        text = sched_io.to_json(sched)
    else:
        raise UsageError(f"--save {path!r}: use a .json (megatron-zb) or .csv (torch compute-only) file")
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise UsageError(f"--save {path!r}: cannot write it ({e.strerror})") from None


def compare_rows(base: ScheduleRequest, p: int, m: int, names: Optional[List[str]] = None,
                 cost_optimizer: float = 0.0, post_validation: bool = False, for_name=None,
                 cost_postval: Optional[float] = None) -> List[dict]:
    """Build and simulate every schedule (``names``, default all) with ``base``'s costs, limit and
    offload; rows sorted by the time per training iteration the user gets: with Megatron's
    synchronous optimizer step, or post-validated; times within 0.1% count as equal, the least
    peak memory first. A schedule over the limit is a row that does not
    fit, one that cannot be built a row with its error. ``for_name(name)``: the request of one row
    where it is not ``base`` renamed (e.g. each row's own per-chunk costs of a layout)."""
    key = "iteration_time_post_validated" if post_validation else "iteration_time"
    rows = []
    for name in names or schedules.names():
        try:
            spec = schedules.get(name)
            req = (for_name(name) if for_name is not None else
                   base.replace(name=name, chunks=base.chunks if spec.chunks is None else None))
            built = build(req, p, m, enforce_limit=False)
            it = iteration_times(built.schedule, built.setting, cost_optimizer, cost_postval)
        except ScheduleError as e:
            rows.append({"schedule": name, "error": str(e)})
            continue
        res = built.result
        limit = base.memory_limit
        fits = limit is None or max(res.peak_memory) <= limit + 1e-9
        rows.append({**res.to_dict(), **it.to_dict(), "fits": fits, "ranked_by": key, **_split(built)})
    top = next((r for r in rows if r.get("schedule") == "1f1b" and "error" not in r), None)
    for r in rows:
        if "error" not in r and top:
            r["speedup_vs_1f1b"] = round(top[key] / r[key], 4) if r[key] else None
    ok = [r for r in rows if "error" not in r]
    ok = (by_memory_among_ties([r for r in ok if r["fits"]], lambda r: r[key], lambda r: max(r["peak_memory"]))
          + by_memory_among_ties([r for r in ok if not r["fits"]], lambda r: r[key], lambda r: max(r["peak_memory"])))
    return ok + [r for r in rows if "error" in r]


def without_layout(args):
    """The flags without --layout (compare's header line: the per-layer costs as given)."""
    ns = argparse.Namespace(**vars(args))
    ns.layout, ns.output_layer_cost, ns.embedding_cost = None, 0.0, 0.0
    ns.enable_vocab_parallel, ns.disable_backward_fusion, ns.vocab_cost_comm = False, False, 0.0
    return ns


def cmd_compare(args) -> int:
    varlen.check_varlen_args(args, "compare")
    if args.seq_lengths:
        return varlen.cmd_compare_varlen(args, _row_request(args))
    p, m = sizes(args)
    layout = getattr(args, "layout", None)
    req = request(args, name="1f1b") if layout is None else request(without_layout(args), name="1f1b")
    setting = req.setting(p, m)

    def for_name(name):  # with --layout: each row's chunks cost what they hold
        spec = schedules.get(name)
        return request(args, name=name, chunks=args.chunks if spec.chunks is None else None, p=p)
    rows = compare_rows(req, p, m, names=args.schedules, cost_optimizer=args.cost_optimizer,
                        post_validation=args.optimizer_post_validation, for_name=for_name if layout is not None else None,
                        cost_postval=args.cost_optimizer_post_validated)
    ok = [r for r in rows if "error" not in r]
    if setting.memory_limit is not None and not any(r["fits"] for r in ok):
        least = min(max(r["peak_memory"]) for r in ok)
        raise UsageError(f"no schedule fits --memory-limit {setting.memory_limit:g}; "
                         f"the least any needs is {least:g}")
    if args.json:
        print(json.dumps({"stages": setting.stages, "microbatches": setting.microbatches,
                          "cost_optimizer": args.cost_optimizer,
                          "optimizer_post_validation": args.optimizer_post_validation, "rows": rows}))
        return 0
    print(f"P={setting.stages} M={setting.microbatches} F={fmt(setting.cost_f)} B={fmt(setting.cost_b)} "
          f"W={fmt(setting.cost_w)} comm={setting.cost_comm:g}"
          + (f" per layer; layout {layout}, output layer {args.output_layer_cost:g} layers" if layout else "")
          + ((" spread over every rank (vocabulary parallelism, "
              + ("2 barriers" if args.disable_backward_fusion else "1 barrier") + ")")
             if getattr(args, "enable_vocab_parallel", False) else "")
          + (f" optimizer={args.cost_optimizer:g}" if args.cost_optimizer else "")
          + (f" memory-limit={setting.memory_limit:g}" if setting.memory_limit is not None else ""))
    print("ranked by the time per training iteration "
          + ("with optimizer post-validation" if args.optimizer_post_validation else
             "with Megatron's synchronous optimizer step (--optimizer-post-validation ranks by the other column)"))
    hdr = (f"{'schedule':<18} {'chunks':>6} {'makespan':>9} {'iter sync':>10} {'iter postval':>12} {'bubble':>8} "
           f"{'speed-up':>9} {'fits':>5}  peak memory per rank")
    print(hdr)
    print("-" * len(hdr))
    for r in ok:
        peaks = " ".join(f"{x:g}" for x in r["peak_memory"])
        sp = r.get("speedup_vs_1f1b")
        print(f"{r['schedule']:<18} {r['chunks']:>6} {r['makespan']:>9g} {r['iteration_time']:>10g} "
              f"{r['iteration_time_post_validated']:>12g} {r['bubble_rate']:>8.4f} "
              f"{(f'{sp:.3f}x' if sp else '-'):>9} {('yes' if r['fits'] else 'no'):>5}  {peaks}")
    for r in rows:
        if "error" in r:
            print(f"{r['schedule']:<18} n/a: {r['error']}")
    return 0


def cmd_plot(args) -> int:
    from .. import plot
    for path in args.out:
        if os.path.splitext(path)[1].lower() not in (".png", ".svg", ".json"):
            raise UsageError(f"--out {path!r}: use .png, .svg (picture) or .json (Chrome trace / Perfetto)")
        writable("--out", path)
    memory = _memory_traces(args.memory) if args.memory else None
    built = build_from_args(args)
    sched, setting = built.schedule, built.setting
    if memory is not None and len(memory) != setting.stages:
        raise UsageError(f"--memory {args.memory!r} has traces of {len(memory)} pipeline rank(s); the schedule has "
                         f"{setting.stages}")
    title = None
    if args.iterations > 1:
        step = (args.cost_optimizer_post_validated if args.optimizer_post_validation
                and args.cost_optimizer_post_validated is not None else args.cost_optimizer)
        res = back_to_back(sched, setting, args.iterations, step, args.optimizer_post_validation,
                           measured=args.cost_optimizer_post_validated is not None)
        it = iteration_times(sched, setting, args.cost_optimizer, args.cost_optimizer_post_validated)
        how, t = (("post-validated", it.iteration_time_post_validated) if args.optimizer_post_validation
                  else ("synchronous optimizer step", it.iteration_time))
        title = (f"{sched.name} (p={setting.stages}, m={sched.num_microbatches}): {args.iterations} iterations, "
                 f"{how}: {t:.4g} per iteration")
    else:
        res = built.result
    for path in args.out:
        try:
            plot.save(res, path, title=title, time_unit=args.time_unit, memory=memory)
        except OSError as e:
            raise UsageError(f"--out {path!r}: cannot write it ({e.strerror})") from None
        print(f"wrote {path}")
    return 0
