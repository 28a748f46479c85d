"""`simulate` / `compare` / `plan` with ``--seq-lengths FILE``: variable-length batches over
data-parallel replicas (``core.varlen.batch``): Megatron's sequential microbatches against the balancer
with per-microbatch schedules, per global batch of the file, the mean over the batches."""
from __future__ import annotations

import argparse
import math
import time
from typing import Dict, List, Optional, Sequence

from ..argtypes import positive_int
from ..core import schedules
from ..core.build import ScheduleRequest
from ..core.ir import ScheduleError
from ..core.varlen.mb_schedule import cost_table
from ..core.costs.microbatch_costs import LengthModel
from ..core.varlen.seqlens import parse_seq_lengths
from ..core.sim.simulate import peak_memory
from ..core.varlen.batch import BatchPlan, Templates, VarlenConfig, plan_batch
from .common import UsageError, read_text

__all__ = ["add_varlen_args", "check_varlen_args", "batches_of", "config_of", "varlen_row", "DEFAULT_SCHEDULES",
           "UNITS"]

#: compare's rows with --seq-lengths unless --schedules says otherwise: schedules built in
#: milliseconds for any microbatch count, and zb-v for the V family (its search runs once, at
#: Megatron's microbatch count; balanced replicas with other counts get list schedules)
DEFAULT_SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-v")
UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6}


def _share(flag, pair: bool = False):
    """A share 0..1 (``pair``: or two, 'F,B')."""
    def parse(text):
        try:
            v = [float(x) for x in str(text).split(",")]
        except ValueError:
            v = []
        if len(v) not in ((1, 2) if pair else (1,)) or not all(0.0 <= x <= 1.0 for x in v):
            what = "a share between 0 and 1" + (", or two (F,B)" if pair else "")
            raise argparse.ArgumentTypeError(f"{flag} must be {what}, got {text!r}")
        return (v if len(v) == 2 else [v[0], v[0]]) if pair else v[0]
    return parse


def add_varlen_args(ap: argparse.ArgumentParser, simulate: bool = False, model_flags: bool = True) -> None:
    """The --seq-lengths flags; ``model_flags`` False (plan): the model's own --seq-length,
    --micro-batch-size and --data-parallel-size serve, costs are seconds."""
    g = ap.add_argument_group("variable-length batches (docs/varlen.md)")
    g.add_argument("--seq-lengths", metavar="FILE", default=None,
                   help="sequence lengths, one per line, a blank line between global batches: each batch is spread "
                        "over --data-parallel-size replicas, as Megatron does (sequential) and balanced")
    if model_flags:
        g.add_argument("--data-parallel-size", type=positive_int("--data-parallel-size"), default=1, metavar="D",
                       help="with --seq-lengths: data-parallel replicas the global batch is spread over (default 1)")
        g.add_argument("--seq-length", type=positive_int("--seq-length"), default=None, metavar="S",
                       help="with --seq-lengths: the --cost-*/--mem-* values are one microbatch of one sequence of S "
                            "tokens (default: the file's longest sequence)")
        g.add_argument("--micro-batch-size", type=positive_int("--micro-batch-size"), default=1, metavar="B",
                       help="with --seq-lengths: sequences per microbatch in Megatron's order (and per padded balanced "
                            "microbatch; default 1)")
    g.add_argument("--attention-share", type=_share("--attention-share", pair=True), default=None, metavar="A[,A_B]",
                   help="with --seq-lengths: share of F and B at --seq-length spent in attention, which grows with the "
                        "square of a sequence's length; two values: F's and B's (default 0" + ("; plan: from the model" if not model_flags else "")
                        + ")")
    g.add_argument("--pass-overhead", type=_share("--pass-overhead"), default=0.0, metavar="O",
                   help="with --seq-lengths: share of a pass at --seq-length that does not shrink with fewer tokens "
                        "(launches, small kernels; default 0)")
    g.add_argument("--pack-sequences", action="store_true",
                   help="with --seq-lengths: Megatron's packed-sequence format (THD: a microbatch's sequences one after "
                        "another, attention within each) instead of rows padded to the longest; balanced microbatches "
                        "then hold up to --max-tokens tokens")
    g.add_argument("--max-tokens", type=positive_int("--max-tokens"), default=None, metavar="T",
                   help="with --pack-sequences: tokens a balanced microbatch holds at most (default micro-batch size x "
                        "--seq-length)")
    if simulate:
        g.add_argument("--balance-microbatches", action="store_true",
                       help="with --seq-lengths: the balancer and per-microbatch schedules (training's "
                            "--zero-bubble-balance-microbatches); default Megatron's sequential microbatches")
    if model_flags:
        g.add_argument("--time-unit", choices=sorted(UNITS), default="ms", dest="varlen_time_unit",
                       help="with --seq-lengths: unit of the --cost-* values, for iteration_time_s (default ms)")


def check_varlen_args(args, command: str) -> None:
    """Flags that need --seq-lengths, and the ones it cannot be combined with (one line each)."""
    if not getattr(args, "seq_lengths", None):
        given = [f for f, v in (("--data-parallel-size", command != "plan" and getattr(args, "data_parallel_size", 1) != 1),
                                ("--attention-share", getattr(args, "attention_share", None) is not None),
                                ("--pass-overhead", bool(getattr(args, "pass_overhead", 0.0))),
                                ("--pack-sequences", getattr(args, "pack_sequences", False)),
                                ("--max-tokens", getattr(args, "max_tokens", None) is not None),
                                ("--balance-microbatches", getattr(args, "balance_microbatches", False)),
                                ("--micro-batch-size", command != "plan" and getattr(args, "micro_batch_size", 1) != 1),
                                ("--seq-length", command != "plan" and getattr(args, "seq_length", None) is not None))
                 if v]
        if given:
            raise UsageError(f"{given[0]} describes variable-length batches: give --seq-lengths FILE")
        return
    bad = [f for f, v in (("--load", getattr(args, "load", None)), ("--offload-ratio", getattr(args, "offload_ratio", None)),
                          ("--enable-vocab-parallel", getattr(args, "enable_vocab_parallel", False)),
                          ("--exact", getattr(args, "exact", False)), ("--save", getattr(args, "save", None)),
                          ("--optimizer-post-validation", getattr(args, "optimizer_post_validation", False)))
           if v]
    if bad:
        raise UsageError(f"--seq-lengths cannot be combined with {bad[0]} yet (variable-length batches are simulated "
                         "with Megatron's synchronous optimizer step, without offload or vocabulary parallelism)")
    if command != "plan" and getattr(args, "microbatches", None) is not None:
        raise UsageError("--microbatches comes from --seq-lengths (a batch's sequences per replica / --micro-batch-size): "
                         "leave it out")
    if getattr(args, "max_tokens", None) is not None and not args.pack_sequences:
        raise UsageError("--max-tokens is the token budget of packed microbatches: give --pack-sequences")


def batches_of(args) -> List[List[int]]:
    try:
        return parse_seq_lengths(read_text("--seq-lengths", args.seq_lengths), f"--seq-lengths {args.seq_lengths}")
    except ScheduleError as e:
        raise UsageError(str(e)) from None


def config_of(args, batches: List[List[int]], seq_length: Optional[int] = None,
              attention: Optional[float] = None) -> VarlenConfig:
    s = seq_length or getattr(args, "seq_length", None) or max(max(b) for b in batches)
    a = args.attention_share if args.attention_share is not None else [attention or 0.0] * 2
    if max(a) + args.pass_overhead > 1.0:
        raise UsageError(f"--attention-share {max(a):g} and --pass-overhead {args.pass_overhead:g} add up to more than "
                         "the whole pass")
    model = LengthModel(s, {"F": a[0], "B": a[1]}, {k: args.pass_overhead for k in ("F", "B", "W")})
    return VarlenConfig(args.data_parallel_size, model, micro_batch_size=getattr(args, "micro_batch_size", 1),
                        packed=args.pack_sequences, max_tokens=args.max_tokens)


def _busy(plan: BatchPlan) -> float:
    """Compute time of every rank of every replica."""
    total = 0.0
    for rp in plan.replicas:
        kinds = sorted({a.kind for o in rp.schedule.orders for a in o})
        table = cost_table(rp.setting, rp.schedule.placement, kinds)
        total += sum(table[a.kind][a.stage][a.mb] for o in rp.schedule.orders for a in o)
    return total


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def plan_batches(req: ScheduleRequest, p: int, config: VarlenConfig, batches: List[List[int]], balanced: bool,
                 templates: Optional[Templates] = None, cost_optimizer: float = 0.0) -> List[BatchPlan]:
    group = config.replicas * config.micro_batch_size
    templates = templates or Templates(req, p, max(1, len(batches[0]) // group))
    return [plan_batch(b, req, p, config, balanced, templates, cost_optimizer) for b in batches]


def varlen_row(req: ScheduleRequest, p: int, config: VarlenConfig, batches: List[List[int]], balanced: bool,
               unit_s: float, templates: Optional[Templates] = None, cost_optimizer: float = 0.0) -> Dict:
    """One schedule (``req.name``), balanced or Megatron's sequential microbatches, over every batch:
    a compare row."""
    t0 = time.perf_counter()
    plans = plan_batches(req, p, config, batches, balanced, templates, cost_optimizer)
    wall = time.perf_counter() - t0
    its = [pl.iteration_time for pl in plans]
    peaks = [0.0] * p
    for pl in plans:
        for rp in pl.replicas:
            for r, o in enumerate(rp.schedule.orders):
                peaks[r] = max(peaks[r], peak_memory([a for a in o if a.is_compute], r, rp.setting))
    idle = _mean([1.0 - _busy(pl) / (p * config.replicas * pl.iteration_time) if pl.iteration_time else 0.0
                  for pl in plans])
    mean = _mean(its)
    return {"schedule": req.name, "balanced": balanced, "iteration_time": round(mean, 6),
            "iteration_time_s": mean * unit_s, "idle_rate": round(max(0.0, idle), 6),
            "chunks": plans[0].replicas[0].schedule.placement.chunks if plans[0].replicas[0].schedule else None,
            "peak_memory": [round(x, 6) for x in peaks],
            "plan_seconds_per_batch": round(wall / len(plans), 6),
            "batches": [{"iteration_time": round(pl.iteration_time, 6),
                         "replica_ends": [round(r.end, 6) for r in pl.replicas],
                         "microbatches_per_replica": [r.num_microbatches for r in pl.replicas]} for pl in plans]}


def compare_varlen(args, p: int, request_of, names: Sequence[str], unit_s: float) -> List[Dict]:
    """compare's rows: every schedule of ``names`` unbalanced and balanced, sorted by time."""
    batches = batches_of(args)
    config = config_of(args, batches)
    rows, errors = [], []
    for name in names:
        try:
            req = request_of(name)
            group = config.replicas * config.micro_batch_size
            templates = Templates(req, p, max(1, len(batches[0]) // group))
        except ScheduleError as e:
            errors += [{"schedule": name, "balanced": b, "error": str(e)} for b in (False, True)]
            continue
        for balanced in (False, True):
            try:
                rows.append(varlen_row(req, p, config, batches, balanced, unit_s, templates, args.cost_optimizer))
            except ScheduleError as e:
                errors.append({"schedule": name, "balanced": balanced, "error": str(e)})
    base = next((r for r in rows if r["schedule"] == "1f1b" and not r["balanced"]), None)
    unbal = {r["schedule"]: r for r in rows if not r["balanced"]}
    for r in rows:
        if base is not None and r["iteration_time"]:
            r["speedup_vs_megatron_1f1b"] = round(base["iteration_time"] / r["iteration_time"], 4)
        if r["balanced"] and r["schedule"] in unbal and r["iteration_time"]:
            r["speedup_vs_unbalanced"] = round(unbal[r["schedule"]]["iteration_time"] / r["iteration_time"], 4)
    rows.sort(key=lambda r: (r["iteration_time"], max(r["peak_memory"]), r["schedule"], r["balanced"]))
    return rows + errors


def describe(config: VarlenConfig, batches: List[List[int]], p: int) -> str:
    n = [len(b) for b in batches]
    lens = [s for b in batches for s in b]
    m = config.model
    return (f"P={p} D={config.replicas}: {len(batches)} global batch(es) of {min(n)}-{max(n)} sequences, lengths "
            f"{min(lens)}-{max(lens)} (median {sorted(lens)[len(lens) // 2]}); costs are one microbatch of one "
            f"{m.seq_length}-token sequence, attention {m.attention.get('F', 0.0):g} of F, {m.attention.get('B', 0.0):g} "
            f"of B, fixed "
            f"{m.overhead.get('F', 0.0):g}; {'packed' if config.packed else 'padded'} microbatches, "
            f"micro-batch size {config.micro_batch_size}")


def finite(x: float) -> Optional[float]:
    return x if isinstance(x, float) and math.isfinite(x) else None


def names_for(args) -> List[str]:
    names = getattr(args, "schedules", None) or list(DEFAULT_SCHEDULES)
    for n in names:
        schedules.get(n)
    return names


def _p(args) -> int:
    if args.stages is None:
        raise UsageError("--stages is required")
    return args.stages


def cmd_simulate_varlen(args, request_of) -> int:
    """`simulate --seq-lengths`: one schedule over the file's batches, sequential or balanced."""
    import json
    p = _p(args)
    batches = batches_of(args)
    config = config_of(args, batches)
    unit = UNITS[args.varlen_time_unit]
    req = request_of(args.schedule)
    row = varlen_row(req, p, config, batches, args.balance_microbatches, unit, cost_optimizer=args.cost_optimizer)
    out = {"schedule": args.schedule, "stages": p, "data_parallel_size": config.replicas,
           "balanced": row["balanced"], "microbatches": None, "makespan": row["iteration_time"] - args.cost_optimizer,
           "iteration_time": row["iteration_time"], "iteration_time_s": row["iteration_time_s"],
           "iteration_time_post_validated": None, "bubble_rate": row["idle_rate"], "idle_rate": row["idle_rate"],
           "peak_memory": row["peak_memory"], "plan_seconds_per_batch": row["plan_seconds_per_batch"],
           "batches": row["batches"], "note": "per global batch; iteration_time is the mean (synchronous optimizer "
           "step; post-validation is not modelled for variable-length batches)"}
    if args.json:
        print(json.dumps(out))
        return 0
    print(describe(config, batches, p))
    print(f"schedule      {args.schedule}, " + ("balanced, per-microbatch schedules" if row["balanced"] else
                                               "Megatron's sequential microbatches"))
    for k, b in enumerate(row["batches"]):
        print(f"batch {k:<4}    {b['iteration_time']:g}   replicas end at "
              + " ".join(f"{x:g}" for x in b["replica_ends"]) + "   microbatches "
              + " ".join(str(x) for x in b["microbatches_per_replica"]))
    print(f"iteration     {row['iteration_time']:g} (mean; {row['iteration_time_s']:.6g} s)")
    print(f"idle          {row['idle_rate']:.4f} of every rank's time (pipeline bubbles and replicas waiting)")
    print("peak memory   " + " ".join(f"{x:g}" for x in row["peak_memory"])
          + "   (per rank, units of the reference microbatch's activation)")
    print(f"planning      {row['plan_seconds_per_batch'] * 1e3:.1f} ms per batch (every replica)")
    return 0


def cmd_compare_varlen(args, request_of) -> int:
    """`compare --seq-lengths`: every schedule (--schedules) sequential and balanced."""
    import json
    p = _p(args)
    batches = batches_of(args)
    config = config_of(args, batches)
    unit = UNITS[args.varlen_time_unit]
    rows = compare_varlen(args, p, request_of, names_for(args), unit)
    if args.json:
        print(json.dumps({"stages": p, "data_parallel_size": config.replicas, "batches": len(batches),
                          "seq_length": config.model.seq_length, "time_unit": args.varlen_time_unit, "rows": rows}))
        return 0
    print(describe(config, batches, p))
    print("ranked by the mean time per training iteration (synchronous optimizer step; the slowest replica)")
    hdr = (f"{'schedule':<18} {'balanced':>8} {'iteration':>11} {'seconds':>9} {'vs Megatron 1F1B':>16} "
           f"{'vs unbalanced':>13} {'idle':>7} {'plan ms':>8}  peak memory per rank")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if "error" in r:
            continue
        sp, su = r.get("speedup_vs_megatron_1f1b"), r.get("speedup_vs_unbalanced")
        print(f"{r['schedule']:<18} {('yes' if r['balanced'] else 'no'):>8} {r['iteration_time']:>11.6g} "
              f"{r['iteration_time_s']:>9.4g} {(f'{sp:.3f}x' if sp else '-'):>16} {(f'{su:.3f}x' if su else '-'):>13} "
              f"{r['idle_rate']:>7.4f} {r['plan_seconds_per_batch'] * 1e3:>8.1f}  "
              + " ".join(f"{x:.3g}" for x in r["peak_memory"]))
    for r in rows:
        if "error" in r:
            print(f"{r['schedule']:<18} {('yes' if r['balanced'] else 'no'):>8} n/a: {r['error']}")
    return 0
