"""`megatron-zb` command line: simulate, compare, plot (schedule core, no torch) and verify.

Bad input gets one line on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import List, Optional

from .core import io as sched_io
from .core import schedules
from .core.ir import Schedule, ScheduleError, Setting
from .core.simulate import SimResult, simulate
from .core.validate import validate


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        raise UsageError(f"{self.prog}: {message}")


def _number_list(name):
    def parse(text: str):
        vals = []
        for part in str(text).split(","):
            try:
                x = float(part)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{name} must be a number or a comma list of numbers, "
                                                 f"got {text!r}") from None
            if not (x >= 0 and x != float("inf")):
                raise argparse.ArgumentTypeError(f"{name} must be non-negative, got {text!r}")
            vals.append(x)
        return vals
    return parse


def _nonneg(name):
    def parse(text):
        vals = _number_list(name)(text)
        if len(vals) != 1:
            raise argparse.ArgumentTypeError(f"{name} takes one number, got {text!r}")
        return vals[0]
    return parse


def int_at_least(name, lo):
    """argparse type: an integer >= lo, else one clear line naming the flag."""
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= {lo}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= {lo}, got {v}")
        return v
    return parse


def _positive_int(name):
    return int_at_least(name, 1)


def _add_setting_args(ap: argparse.ArgumentParser, schedule_required: bool = True):
    if schedule_required:
        g = ap.add_mutually_exclusive_group(required=True)
        g.add_argument("--schedule", help="schedule name: " + ", ".join(schedules.names()))
        g.add_argument("--load", metavar="FILE", help="a schedule file (.json ours, .csv torch compute-only)")
    ap.add_argument("--stages", "-p", type=_positive_int("--stages"), help="pipeline ranks P")
    ap.add_argument("--microbatches", "-m", type=_positive_int("--microbatches"), help="microbatches M")
    ap.add_argument("--chunks", "-v", type=_positive_int("--chunks"), default=None,
                    help="model chunks per rank (interleaved; V schedules use 2)")
    ap.add_argument("--cost-f", type=_number_list("--cost-f"), default=[1.0],
                    help="F time of a whole stage; a comma list gives one per stage (default 1)")
    ap.add_argument("--cost-b", type=_number_list("--cost-b"), default=[1.0], help="B time (default 1)")
    ap.add_argument("--cost-w", type=_number_list("--cost-w"), default=[1.0], help="W time (default 1)")
    ap.add_argument("--cost-comm", type=_nonneg("--cost-comm"), default=0.0,
                    help="time of one hop between ranks (default 0)")
    ap.add_argument("--mem-f", type=_number_list("--mem-f"), default=[1.0],
                    help="activation one F allocates on a stage (default 1)")
    ap.add_argument("--mem-w", type=_number_list("--mem-w"), default=None,
                    help="part of it still needed by W (default 0.5 x mem-f)")
    ap.add_argument("--memory-limit", type=_nonneg("--memory-limit"), default=None,
                    help="per-rank activation limit, in mem-f units")


def _setting(args, stages=None, microbatches=None, chunks=None) -> Setting:
    p = stages if stages is not None else args.stages
    m = microbatches if microbatches is not None else args.microbatches
    if p is None or m is None:
        raise UsageError("--stages and --microbatches are required")
    return Setting(p, m, chunks=chunks if chunks is not None else args.chunks,
                   cost_f=args.cost_f, cost_b=args.cost_b, cost_w=args.cost_w,
                   cost_comm=args.cost_comm, mem_f=args.mem_f, mem_w=args.mem_w,
                   memory_limit=args.memory_limit)


def _build(args):
    """(schedule, setting) from --schedule or --load, validated (memory limit included)."""
    if getattr(args, "load", None):
        path = args.load
        if not os.path.exists(path):
            raise UsageError(f"--load: no such file {path!r}")
        text = open(path).read()
        sched = sched_io.from_csv(text, os.path.basename(path)) if path.endswith(".csv") \
            else sched_io.from_json(text)
        setting = _setting(args, stages=sched.num_ranks, microbatches=sched.num_microbatches,
                           chunks=sched.placement.chunks)
    else:
        setting = _setting(args)
        sched = schedules.generate(args.schedule, setting)
    if getattr(args, "exact", False):
        sched = _exact(args, sched, setting)
    limit = setting.memory_limit
    validate(sched, setting, memory_limit=float("inf"))
    if limit is not None:
        res = simulate(sched, setting)
        peak = max(res.peak_memory)
        if peak > limit + 1e-9:
            r = res.peak_memory.index(peak)
            raise UsageError(f"{sched.name} peaks at {peak:g} activation units on rank {r}, over "
                             f"--memory-limit {limit:g}; `megatron-zb compare --memory-limit {limit:g}` "
                             "lists the schedules that fit")
    return sched, setting


def _exact(args, sched: Schedule, setting: Setting) -> Schedule:
    """--exact: the MILP (HiGHS) under the automatic scheduler's memory limit, seeded with its
    makespan; the shorter schedule of the two."""
    from .core.schedules import exact
    if getattr(args, "load", None) or args.schedule not in exact.AUTOMATIC:
        raise UsageError(f"--exact applies to the automatic schedules ({', '.join(exact.AUTOMATIC)}), "
                         f"not {getattr(args, 'schedule', None) or '--load'}")
    return exact.refine(sched, setting, node_limit=args.exact_nodes, time_limit=args.exact_seconds)


def _result_dict(sched: Schedule, setting: Setting, res: SimResult) -> dict:
    d = res.to_dict()
    for k in ("lower_bound", "gap_to_lower_bound", "exact"):
        if k in sched.meta:
            d[k] = sched.meta[k]
    d.update({"placement": sched.placement.style, "cost_f": setting.cost_f, "cost_b": setting.cost_b,
              "cost_w": setting.cost_w, "cost_comm": setting.cost_comm, "mem_f": setting.mem_f,
              "mem_w": setting.mem_w, "memory_limit": setting.memory_limit})
    return d


def cmd_simulate(args) -> int:
    sched, setting = _build(args)
    res = simulate(sched, setting)
    if args.save:
        _save_schedule(sched, args.save)
    if args.json:
        print(json.dumps(_result_dict(sched, setting, res)))
        return 0
    d = res.to_dict()
    print(f"schedule      {sched.name} (placement {sched.placement.style}, {d['chunks']} chunk(s)/rank)")
    print(f"stages        {setting.stages}   microbatches {sched.num_microbatches}")
    print(f"makespan      {d['makespan']:g}")
    print(f"bubble rate   {d['bubble_rate']:.4f}")
    print("peak memory   " + " ".join(f"{x:g}" for x in d["peak_memory"]) + "   (per rank, mem-f units)")
    if "gap_to_lower_bound" in sched.meta:
        print(f"lower bound   {sched.meta['lower_bound']:g}   (gap {sched.meta['gap_to_lower_bound']:.4f})")
    if "exact" in sched.meta:
        e = sched.meta["exact"]
        print(f"exact (MILP)  {e['status']}; heuristic makespan {e['heuristic_makespan']:g}, nodes {e.get('nodes', 0)}")
    return 0


def _save_schedule(sched: Schedule, path: str):
    if path.endswith(".csv"):
        text = sched_io.to_csv(sched)
    elif path.endswith(".json"):
        text = sched_io.to_json(sched)
    else:
        raise UsageError(f"--save {path!r}: use a .json (megatron-zb) or .csv (torch compute-only) file")
    with open(path, "w") as f:
        f.write(text)


def compare_rows(setting: Setting, names: Optional[List[str]] = None) -> List[dict]:
    """Simulate every schedule that applies to ``setting``; rows sorted by makespan."""
    rows = []
    for name in names or schedules.names():
        spec = schedules.get(name)
        try:
            chunks = spec.resolve_chunks(setting.chunks if spec.chunks is None else None)
            st = Setting(**{**setting.to_dict(), "chunks": chunks})
            sched = schedules.generate(name, st)
            res = simulate(sched, st)
        except ScheduleError as e:
            rows.append({"schedule": name, "error": str(e)})
            continue
        fits = st.memory_limit is None or max(res.peak_memory) <= st.memory_limit + 1e-9
        rows.append({**res.to_dict(), "fits": fits})
    base = next((r for r in rows if r.get("schedule") == "1f1b" and "error" not in r), None)
    for r in rows:
        if "error" not in r and base:
            r["speedup_vs_1f1b"] = round(base["makespan"] / r["makespan"], 4) if r["makespan"] else None
    ok = sorted((r for r in rows if "error" not in r), key=lambda r: (not r["fits"], r["makespan"]))
    return ok + [r for r in rows if "error" in r]


def cmd_compare(args) -> int:
    setting = _setting(args)
    rows = compare_rows(setting)
    ok = [r for r in rows if "error" not in r]
    if setting.memory_limit is not None and not any(r["fits"] for r in ok):
        least = min(max(r["peak_memory"]) for r in ok)
        raise UsageError(f"no schedule fits --memory-limit {setting.memory_limit:g}; "
                         f"the least any needs is {least:g}")
    if args.json:
        print(json.dumps({"stages": setting.stages, "microbatches": setting.microbatches, "rows": rows}))
        return 0
    print(f"P={setting.stages} M={setting.microbatches} F={_fmt(setting.cost_f)} B={_fmt(setting.cost_b)} "
          f"W={_fmt(setting.cost_w)} comm={setting.cost_comm:g}"
          + (f" memory-limit={setting.memory_limit:g}" if setting.memory_limit is not None else ""))
    hdr = f"{'schedule':<18} {'chunks':>6} {'makespan':>10} {'bubble':>8} {'speed-up':>9} {'fits':>5}  peak memory per rank"
    print(hdr)
    print("-" * len(hdr))
    for r in ok:
        peaks = " ".join(f"{x:g}" for x in r["peak_memory"])
        sp = r.get("speedup_vs_1f1b")
        print(f"{r['schedule']:<18} {r['chunks']:>6} {r['makespan']:>10g} {r['bubble_rate']:>8.4f} "
              f"{(f'{sp:.3f}x' if sp else '-'):>9} {('yes' if r['fits'] else 'no'):>5}  {peaks}")
    for r in rows:
        if "error" in r:
            print(f"{r['schedule']:<18} n/a: {r['error']}")
    return 0


def _fmt(vals):
    return ",".join(f"{x:g}" for x in vals) if len(set(vals)) > 1 else f"{vals[0]:g}"


def cmd_plot(args) -> int:
    from . import plot
    sched, setting = _build(args)
    res = simulate(sched, setting)
    for path in args.out:
        ext = os.path.splitext(path)[1].lower()
        if ext not in (".png", ".svg", ".json"):
            raise UsageError(f"--out {path!r}: use .png, .svg (picture) or .json (Chrome trace / Perfetto)")
        plot.save(res, path)
        print(f"wrote {path}")
    return 0


def cmd_plan(args) -> int:
    from .core import plan as P
    spec = P.ModelSpec(num_layers=args.num_layers, hidden_size=args.hidden_size,
                       num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                       micro_batch_size=args.micro_batch_size, vocab_size=args.vocab_size,
                       ffn_hidden_size=args.ffn_hidden_size, tensor_parallel_size=args.tensor_parallel_size,
                       sequence_parallel=args.sequence_parallel, data_parallel_size=args.data_parallel_size,
                       distributed_optimizer=args.use_distributed_optimizer,
                       flash_attention=not args.no_flash_attention)
    tflops = args.peak_tflops if args.peak_tflops is not None else P.GPU_PEAK_TFLOPS[args.gpu]
    profile = P.load_profile(args.profile) if args.profile else None
    rows = P.plan(spec, args.pipeline_parallel_size, args.num_microbatches, args.gpu_memory_gb, tflops=tflops,
                  efficiency=args.efficiency, profile=profile, pad_ends=args.allow_padding_num_layers,
                  exact=(args.exact_nodes, args.exact_seconds) if args.exact else None)
    if args.json:
        print(json.dumps({"model": dataclasses.asdict(spec), "pipeline_parallel_size": args.pipeline_parallel_size,
                          "num_microbatches": args.num_microbatches, "gpu_memory_gb": args.gpu_memory_gb,
                          "costs_from": "profile" if profile else f"FLOPs at {tflops:g} TFLOPS x {args.efficiency:g}",
                          "rows": rows}))
        return 0
    gib = 1024 ** 3
    print(f"P={args.pipeline_parallel_size} M={args.num_microbatches} layers={spec.num_layers} h={spec.hidden_size} "
          f"s={spec.seq_length} b={spec.micro_batch_size} TP={spec.tensor_parallel_size} budget "
          f"{args.gpu_memory_gb:g} GiB/GPU; costs from "
          + ("the profile" if profile else f"FLOPs at {tflops:g} TFLOPS x {args.efficiency:g}"))
    hdr = f"{'rank':>4} {'schedule':<17} {'bubble':>7} {'vs 1F1B':>8} {'max GiB':>8} {'act GiB/rank':<28} fits  flags"
    print(hdr)
    print("-" * len(hdr))
    for i, r in enumerate((r for r in rows if "error" not in r), 1):
        act = " ".join(f"{x / gib:.1f}" for x in r["activation_bytes"])
        tp = r.get("throughput_vs_1f1b")
        print(f"{i:>4} {r['schedule']:<17} {r['bubble_rate']:>7.3f} {(f'{tp:.3f}x' if tp else '-'):>8} "
              f"{max(r['peak_bytes']) / gib:>8.1f} {act:<28} {'yes' if r['fits'] else 'NO ':<4}  {r['flags']}")
    for r in rows:
        if "error" in r:
            print(f"   - {r['schedule']:<17} n/a: {r['error']}")
    return 0


def cmd_verify(argv) -> int:
    from . import verify
    return verify.main_verify(argv)


def _add_exact_args(ap: argparse.ArgumentParser):
    ap.add_argument("--exact", action="store_true",
                    help="automatic schedules: also solve the exact MILP (HiGHS) and keep the shorter "
                         "schedule; meant for small settings (p <= 4, m <= 8)")
    ap.add_argument("--exact-nodes", type=_positive_int("--exact-nodes"), default=20000,
                    help="branch-and-bound node limit of --exact (deterministic; default 20000)")
    ap.add_argument("--exact-seconds", type=_nonneg("--exact-seconds"), default=None,
                    help="time limit of --exact in seconds (machine-dependent: results can differ "
                         "between machines; default none)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="megatron-zb", description="Zero-bubble pipeline schedules for megatron-core")
    sub = ap.add_subparsers(dest="cmd", parser_class=_Parser)
    s = sub.add_parser("simulate", help="time, bubble and memory of one schedule")
    _add_setting_args(s)
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--save", metavar="FILE", help="also write the schedule (.json or torch .csv)")
    _add_exact_args(s)
    s.set_defaults(func=cmd_simulate)
    c = sub.add_parser("compare", help="every schedule for one setting in one table")
    _add_setting_args(c, schedule_required=False)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_compare)
    pl = sub.add_parser("plot", help="timeline picture (.png/.svg) or Chrome trace (.json)")
    _add_setting_args(pl)
    pl.add_argument("--out", nargs="+", required=True, metavar="FILE")
    pl.set_defaults(func=cmd_plot)
    pn = sub.add_parser("plan", help="rank schedules for a GPT model and a GPU memory budget")
    pn.add_argument("--num-layers", type=_positive_int("--num-layers"), required=True)
    pn.add_argument("--hidden-size", type=_positive_int("--hidden-size"), required=True)
    pn.add_argument("--num-attention-heads", type=_positive_int("--num-attention-heads"), required=True)
    pn.add_argument("--seq-length", type=_positive_int("--seq-length"), required=True)
    pn.add_argument("--micro-batch-size", type=_positive_int("--micro-batch-size"), default=1)
    pn.add_argument("--vocab-size", type=_positive_int("--vocab-size"), default=32000)
    pn.add_argument("--ffn-hidden-size", type=_positive_int("--ffn-hidden-size"), default=None)
    pn.add_argument("--tensor-parallel-size", type=_positive_int("--tensor-parallel-size"), default=1)
    pn.add_argument("--sequence-parallel", action="store_true")
    pn.add_argument("--data-parallel-size", type=_positive_int("--data-parallel-size"), default=1)
    pn.add_argument("--use-distributed-optimizer", action="store_true")
    pn.add_argument("--no-flash-attention", action="store_true",
                    help="count the 5as attention-score activations (no flash attention)")
    pn.add_argument("--pipeline-parallel-size", type=_positive_int("--pipeline-parallel-size"), required=True)
    pn.add_argument("--num-microbatches", type=_positive_int("--num-microbatches"), required=True)
    pn.add_argument("--gpu-memory-gb", type=_nonneg("--gpu-memory-gb"), default=80.0)
    pn.add_argument("--gpu", choices=["h100", "h200", "a100", "b200", "mi300x"], default="h100")
    pn.add_argument("--peak-tflops", type=_nonneg("--peak-tflops"), default=None, help="overrides --gpu")
    pn.add_argument("--efficiency", type=_nonneg("--efficiency"), default=0.5, help="fraction of peak reached")
    pn.add_argument("--profile", metavar="JSON", help="measured costs (a megatron-zb profile JSON)")
    pn.add_argument("--allow-padding-num-layers", action="store_true",
                    help="first and last stage take one layer less (embedding and loss cost)")
    pn.add_argument("--json", action="store_true")
    _add_exact_args(pn)
    pn.set_defaults(func=cmd_plan)
    sub.add_parser("verify", help="train a tiny megatron GPT with a schedule vs the reference "
                   "(see `megatron-zb verify --help`)", add_help=False)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "verify":
        return cmd_verify(argv[1:])
    ap = build_parser()
    try:
        args = ap.parse_args(argv)
        if not getattr(args, "func", None):
            ap.print_help()
            return 2
        return args.func(args)
    except (UsageError, ScheduleError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if not msg.startswith("megatron-zb"):
            msg = f"megatron-zb: error: {msg}"
        print(msg, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
