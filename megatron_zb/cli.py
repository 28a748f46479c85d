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

from .argtypes import nonneg, number_list, positive_int, share_or_auto
from .core import io as sched_io
from .core import schedules
from .core.ir import Schedule, ScheduleError, Setting
from .core.iteration import IterationResult, iteration_times
from .core.simulate import SimResult, simulate
from .core.validate import validate


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        raise UsageError(f"{self.prog}: {message}")


def _add_setting_args(ap: argparse.ArgumentParser, schedule_required: bool = True):
    if schedule_required:
        g = ap.add_mutually_exclusive_group(required=True)
        g.add_argument("--schedule", help="schedule name: " + ", ".join(schedules.names()))
        g.add_argument("--load", metavar="FILE", help="a schedule file (.json ours, .csv torch compute-only)")
    ap.add_argument("--stages", "-p", type=positive_int("--stages"), help="pipeline ranks P")
    ap.add_argument("--microbatches", "-m", type=positive_int("--microbatches"), help="microbatches M")
    ap.add_argument("--chunks", "-v", type=positive_int("--chunks"), default=None,
                    help="model chunks per rank (interleaved; V schedules use 2)")
    ap.add_argument("--cost-f", type=number_list("--cost-f"), default=[1.0],
                    help="F time of a whole stage; a comma list gives one per stage (default 1)")
    ap.add_argument("--cost-b", type=number_list("--cost-b"), default=[1.0], help="B time (default 1)")
    ap.add_argument("--cost-w", type=number_list("--cost-w"), default=[1.0], help="W time (default 1)")
    ap.add_argument("--cost-comm", type=nonneg("--cost-comm"), default=0.0,
                    help="time of one hop between ranks (default 0)")
    ap.add_argument("--cost-sync", type=nonneg("--cost-sync"), default=0.0,
                    help="replicated stages (bitpipe): time of the gradient all-reduce between the replicas "
                         "of a whole stage, overlapped with the remaining passes (default 0)")
    ap.add_argument("--mem-f", type=number_list("--mem-f"), default=[1.0],
                    help="activation one F allocates on a stage (default 1)")
    ap.add_argument("--mem-w", type=number_list("--mem-w"), default=None,
                    help="part of it still needed by W (default 0.5 x mem-f)")
    ap.add_argument("--memory-limit", type=nonneg("--memory-limit"), default=None,
                    help="per-rank activation limit, in mem-f units")
    ap.add_argument("--cost-optimizer", type=nonneg("--cost-optimizer"), default=0.0,
                    help="time of one optimizer step, for the time per training iteration (default 0)")
    _add_offload_args(ap)


def _add_offload_args(ap: argparse.ArgumentParser):
    g = ap.add_argument_group("activation offload (docs/offload.md)")
    g.add_argument("--offload-ratio", type=share_or_auto("--offload-ratio"), default=None, metavar="R|auto",
                   help="offload this share (0..1) of each rank's activations to host memory, the "
                        "longest-lived first; 'auto': as few as needed to fit --memory-limit (zb-auto and "
                        "v-auto may then pick a schedule that needs more and offload it back under)")
    g.add_argument("--offload-time", type=number_list("--offload-time"), default=None, metavar="K",
                   help="one-way transfer of one microbatch's stage activation takes K x (F + B) of that "
                        "stage (the ZB authors' --offload-time; a comma list gives one per stage; default 1)")
    g.add_argument("--offload-half-duplex", action="store_true",
                   help="D2H and H2D share one queue (one copy stream) instead of one queue each")
    g.add_argument("--offload-chunk-num", type=positive_int("--offload-chunk-num"), default=None, metavar="N",
                   help="offload only the first N model chunks of each rank (the ZB authors' flag)")


def _offload_options(args, setting: Setting):
    """OffloadOptions from the flags, or None without --offload-ratio (other offload flags alone
    are an error)."""
    from .core.offload import OffloadOptions
    ratio = getattr(args, "offload_ratio", None)
    if ratio is None:
        given = [f for f, v in (("--offload-time", args.offload_time), ("--offload-half-duplex", args.offload_half_duplex),
                                ("--offload-chunk-num", args.offload_chunk_num)) if v not in (None, False)]
        if given:
            raise UsageError(f"{given[0]} needs --offload-ratio R (0..1) or --offload-ratio auto")
        return None
    if ratio == "auto" and setting.memory_limit is None:
        raise UsageError("--offload-ratio auto offloads as little as fits --memory-limit: give --memory-limit L")
    time = args.offload_time if args.offload_time is not None else [1.0]
    return OffloadOptions(ratio=None if ratio == "auto" else ratio, time=time if len(time) > 1 else time[0],
                          overlap=not args.offload_half_duplex,
                          memory_limit=setting.memory_limit if ratio == "auto" else None,
                          chunks=args.offload_chunk_num)


def _add_post_validation_arg(ap: argparse.ArgumentParser, what: str):
    ap.add_argument("--optimizer-post-validation", action="store_true",
                    help=f"{what} with optimizer post-validation (training with "
                         "--enable-optimizer-post-validation); default: Megatron's synchronous optimizer step")


# Largest pipeline the commands take: stages x microbatches x chunks per rank. The simulator needs
# a few seconds at this size (1f1b, P=256, M=256 on a 2-core box); far beyond it, minutes.
MAX_STAGE_MICROBATCHES = 65536


def check_size(p: int, m: int, chunks: int = 1, flags=("--stages", "--microbatches")) -> None:
    """Refuse at once a pipeline too big to simulate in seconds."""
    n = p * m * max(1, chunks)
    if n > MAX_STAGE_MICROBATCHES:
        v = f" x {chunks} chunks" if chunks > 1 else ""
        raise UsageError(f"{flags[0]} {p} x {flags[1]} {m}{v} = {n} stage-microbatches is more than the "
                         f"simulator handles in a few seconds (at most {MAX_STAGE_MICROBATCHES}, e.g. 256 stages "
                         "x 256 microbatches); use fewer")


def _setting(args, stages=None, microbatches=None, chunks=None) -> Setting:
    p = stages if stages is not None else args.stages
    m = microbatches if microbatches is not None else args.microbatches
    if p is None or m is None:
        raise UsageError("--stages and --microbatches are required")
    v = chunks or args.chunks
    if v is None:  # the schedule's own chunk count (V schedules: 2); compare covers them all
        name = getattr(args, "schedule", None)
        spec = schedules.get(name) if name in schedules.names() else None
        v = (spec.chunks if spec is not None else None) or (1 if name else 2)
    check_size(p, m, v)
    return Setting(p, m, chunks=chunks if chunks is not None else args.chunks,
                   cost_f=args.cost_f, cost_b=args.cost_b, cost_w=args.cost_w,
                   cost_comm=args.cost_comm, mem_f=args.mem_f, mem_w=args.mem_w,
                   memory_limit=args.memory_limit, cost_sync=args.cost_sync)


def _build(args):
    """(schedule, setting) from --schedule or --load, validated (memory limit included)."""
    if getattr(args, "load", None):
        path = args.load
        if not os.path.exists(path):
            raise UsageError(f"--load: no such file {path!r}")
        text = open(path).read()
        sched = sched_io.from_csv(text, os.path.basename(path)) if path.endswith(".csv") \
            else sched_io.from_json(text)
        _check_loaded(args, path, sched)
        setting = _setting(args, stages=sched.num_ranks, microbatches=sched.num_microbatches,
                           chunks=sched.placement.chunks)
        off = _offload_options(args, setting)
        if off is not None:
            from .core.offload import add_offload
            sched = add_offload(sched, setting, off)
    else:
        setting = _setting(args)
        off = _offload_options(args, setting)
        if off is not None:
            from .core.offload import generate_with_offload
            sched = generate_with_offload(args.schedule, setting, off)
        else:
            sched = schedules.generate(args.schedule, setting)
    if getattr(args, "exact", False):
        if getattr(args, "offload_ratio", None) is not None:
            raise UsageError("--exact solves schedules without activation offload (the MILP has no host link); "
                             "leave out --offload-ratio or --exact")
        sched = _exact(args, sched, setting)
    limit = setting.memory_limit
    validate(sched, setting, memory_limit=float("inf"))
    if limit is not None:
        res = simulate(sched, setting)
        peak = max(res.peak_memory)
        if peak > limit + 1e-9:
            r = res.peak_memory.index(peak)
            hint = ("`--offload-ratio auto` offloads as little as fits; " if off is None else
                    "a smaller --offload-time lets more activations travel; " if off.ratio is None else
                    "--offload-ratio auto offloads as much as needed; ")
            raise UsageError(f"{sched.name} peaks at {peak:g} activation units on rank {r}"
                             + (" with offload" if off is not None else "") + f", over --memory-limit {limit:g}; "
                             + hint + f"`megatron-zb compare --memory-limit {limit:g}` lists the schedules that fit")
    return sched, setting


def _exact(args, sched: Schedule, setting: Setting) -> Schedule:
    """--exact: the MILP (HiGHS) under the automatic scheduler's memory limit, seeded with its
    makespan; the shorter schedule of the two."""
    from .core.schedules import exact
    if getattr(args, "load", None) or args.schedule not in exact.AUTOMATIC:
        raise UsageError(f"--exact applies to the automatic schedules ({', '.join(exact.AUTOMATIC)}), "
                         f"not {getattr(args, 'schedule', None) or '--load'}")
    return exact.refine(sched, setting, node_limit=args.exact_nodes, time_limit=args.exact_seconds)


def _check_loaded(args, path: str, sched: Schedule) -> None:
    """--stages/--microbatches/--chunks given with --load must be the file's own."""
    have = {"--stages": sched.num_ranks, "--microbatches": sched.num_microbatches,
            "--chunks": sched.placement.chunks}
    given = {"--stages": args.stages, "--microbatches": args.microbatches, "--chunks": args.chunks}
    wrong = [f"{k} {given[k]}" for k in have if given[k] is not None and given[k] != have[k]]
    if wrong:
        raise UsageError(f"--load {path} holds {sched.num_ranks} pipeline ranks, {sched.num_microbatches} "
                         f"microbatches and {sched.placement.chunks} chunk(s) per rank, not {', '.join(wrong)}; "
                         "leave those flags out (the file sets them) or give the file's values")


def _result_dict(sched: Schedule, setting: Setting, res: SimResult, it: IterationResult) -> dict:
    d = res.to_dict()
    d.update(it.to_dict())
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
    it = iteration_times(sched, setting, args.cost_optimizer)
    if args.save:
        _save_schedule(sched, args.save)
    if args.json:
        print(json.dumps(_result_dict(sched, setting, res, it)))
        return 0
    d = res.to_dict()
    print(f"schedule      {sched.name} (placement {sched.placement.style}, {d['chunks']} chunk(s)/rank)")
    print(f"stages        {setting.stages}   microbatches {sched.num_microbatches}")
    print(f"makespan      {d['makespan']:g}")
    print(f"bubble rate   {d['bubble_rate']:.4f}")
    print(f"iteration     {it.iteration_time:g} with Megatron's synchronous optimizer step, "
          f"{it.iteration_time_post_validated:g} with optimizer post-validation"
          + (f" (optimizer step {args.cost_optimizer:g})" if args.cost_optimizer else ""))
    print("peak memory   " + " ".join(f"{x:g}" for x in d["peak_memory"]) + "   (per rank, mem-f units)")
    if "gap_to_lower_bound" in sched.meta:
        print(f"lower bound   {sched.meta['lower_bound']:g}   (gap {sched.meta['gap_to_lower_bound']:.4f})")
    if "exact" in sched.meta:
        e = sched.meta["exact"]
        print(f"exact (MILP)  {e['status']}; heuristic makespan {e['heuristic_makespan']:g}, nodes {e.get('nodes', 0)}")
    if "offload" in d:
        o = d["offload"]
        print("offload       " + f"K={_fmt(o['time'] if isinstance(o['time'], list) else [o['time']])} "
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
    with open(path, "w") as f:
        f.write(text)


def compare_rows(setting: Setting, names: Optional[List[str]] = None, cost_optimizer: float = 0.0,
                 post_validation: bool = False, offload=None) -> List[dict]:
    """Simulate every schedule that applies to ``setting``; rows sorted by the time per training
    iteration the user gets: with Megatron's synchronous optimizer step, or post-validated.
    ``offload`` (core.offload.OffloadOptions) offloads every schedule's activations."""
    key = "iteration_time_post_validated" if post_validation else "iteration_time"
    rows = []
    for name in names or schedules.names():
        spec = schedules.get(name)
        try:
            chunks = spec.resolve_chunks(setting.chunks if spec.chunks is None else None)
            st = Setting(**{**setting.to_dict(), "chunks": chunks})
            if offload is not None:
                from .core.offload import generate_with_offload
                sched = generate_with_offload(name, st, offload)
            else:
                sched = schedules.generate(name, st)
            res = simulate(sched, st)
            it = iteration_times(sched, st, cost_optimizer)
        except ScheduleError as e:
            rows.append({"schedule": name, "error": str(e)})
            continue
        fits = st.memory_limit is None or max(res.peak_memory) <= st.memory_limit + 1e-9
        rows.append({**res.to_dict(), **it.to_dict(), "fits": fits, "ranked_by": key})
    base = next((r for r in rows if r.get("schedule") == "1f1b" and "error" not in r), None)
    for r in rows:
        if "error" not in r and base:
            r["speedup_vs_1f1b"] = round(base[key] / r[key], 4) if r[key] else None
    ok = sorted((r for r in rows if "error" not in r), key=lambda r: (not r["fits"], r[key], r["makespan"]))
    return ok + [r for r in rows if "error" in r]


def cmd_compare(args) -> int:
    setting = _setting(args)
    rows = compare_rows(setting, cost_optimizer=args.cost_optimizer, post_validation=args.optimizer_post_validation,
                        offload=_offload_options(args, setting))
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
    print(f"P={setting.stages} M={setting.microbatches} F={_fmt(setting.cost_f)} B={_fmt(setting.cost_b)} "
          f"W={_fmt(setting.cost_w)} comm={setting.cost_comm:g}"
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


def _fmt(vals):
    return ",".join(f"{x:g}" for x in vals) if len(set(vals)) > 1 else f"{vals[0]:g}"


def cmd_plot(args) -> int:
    from . import plot
    from .core.iteration import back_to_back
    sched, setting = _build(args)
    title = None
    if args.iterations > 1:
        res = back_to_back(sched, setting, args.iterations, args.cost_optimizer, args.optimizer_post_validation)
        it = iteration_times(sched, setting, args.cost_optimizer)
        how, t = (("post-validated", it.iteration_time_post_validated) if args.optimizer_post_validation
                  else ("synchronous optimizer step", it.iteration_time))
        title = (f"{sched.name} (p={setting.stages}, m={sched.num_microbatches}): {args.iterations} iterations, "
                 f"{how}: {t:.4g} per iteration")
    else:
        res = simulate(sched, setting)
    for path in args.out:
        ext = os.path.splitext(path)[1].lower()
        if ext not in (".png", ".svg", ".json"):
            raise UsageError(f"--out {path!r}: use .png, .svg (picture) or .json (Chrome trace / Perfetto)")
        plot.save(res, path, title=title, time_unit=args.time_unit)
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
    if args.offload_ratio is None and (args.offload_time is not None or args.host_link_gbps is not None):
        raise UsageError("--offload-time / --host-link-gbps need --offload-ratio R (0..1) or auto")
    if args.offload_time is not None and args.host_link_gbps is not None:
        raise UsageError("give --offload-time K or --host-link-gbps B, not both")
    check_size(args.pipeline_parallel_size, args.num_microbatches, 2,
               flags=("--pipeline-parallel-size", "--num-microbatches"))
    rows = P.plan(spec, args.pipeline_parallel_size, args.num_microbatches, args.gpu_memory_gb, tflops=tflops,
                  efficiency=args.efficiency, profile=profile, pad_ends=args.allow_padding_num_layers,
                  cost_optimizer=args.cost_optimizer, post_validation=args.optimizer_post_validation,
                  offload_ratio=args.offload_ratio, offload_time=args.offload_time,
                  host_link_gbps=args.host_link_gbps, offload_overlap=not args.offload_half_duplex,
                  exact=(args.exact_nodes, args.exact_seconds) if args.exact else None,
                  jobs=args.jobs if args.jobs is not None else min(8, _usable_cpus()))
    advice = _post_validation_advice(rows, args.optimizer_post_validation)
    if args.json:
        print(json.dumps({"model": dataclasses.asdict(spec), "pipeline_parallel_size": args.pipeline_parallel_size,
                          "num_microbatches": args.num_microbatches, "gpu_memory_gb": args.gpu_memory_gb,
                          "costs_from": "profile" if profile else f"FLOPs at {tflops:g} TFLOPS x {args.efficiency:g}",
                          "cost_optimizer_s": args.cost_optimizer,
                          "optimizer_post_validation": args.optimizer_post_validation,
                          "post_validation_advice": advice, "rows": rows}))
        return 0
    _print_plan(args, spec, rows, profile, tflops, advice)
    return 0


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS has one, e.g. not macOS)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


PLAN_COLUMNS = """columns:
  #              ranking: schedules that fit first, then by time per iteration (sync, or
                 postval with --optimizer-post-validation)
  iteration ms   simulated time of one training iteration in milliseconds, from one iteration's
                 start to the next: "sync" with Megatron's synchronous optimizer step (every rank
                 waits at its global norm/inf all-reduce), "postval" with optimizer post-validation
                 (--enable-optimizer-post-validation); --cost-optimizer adds the step, data
                 loading is not included
  bubble         idle share of the pipeline ranks over that time
  vs 1f1b        iteration speed relative to 1F1B with the same costs (1.10x = 10% faster)
  act GiB min/max  peak activation memory of a pipeline rank, smallest and largest over the ranks
  peak GiB       activations + model states (weights, gradients, optimizer) of the fullest
                 pipeline rank, and which rank that is
  fits           peak GiB <= --gpu-memory-gb
Below the table: the flags of the fastest schedule that fits, ready to paste into a Megatron
command, then those of the others that fit (--zero-bubble-memory-limit counts microbatches: one
is the activation memory of one microbatch on the fullest rank, given in GiB below them)."""


def _print_plan(args, spec, rows, profile, tflops, advice) -> None:
    gib = 1024 ** 3
    p, m = args.pipeline_parallel_size, args.num_microbatches
    extras = [f"TP={spec.tensor_parallel_size}" + (" (sequence parallel)" if spec.sequence_parallel else ""),
              f"DP={spec.data_parallel_size}" + (" (distributed optimizer)" if spec.distributed_optimizer else "")]
    print(f"plan: {p} pipeline ranks, {m} microbatches; {spec.num_layers} layers, hidden {spec.hidden_size}, "
          f"sequence {spec.seq_length}, micro-batch {spec.micro_batch_size}, " + ", ".join(extras))
    print(f"      {args.gpu_memory_gb:g} GiB per GPU; F/B/W times "
          + (f"from the profile {args.profile}" if profile else
             f"from FLOPs at {tflops:g} TFLOPS x {args.efficiency:g} efficiency")
          + "; activations by Megatron's per-layer formula, model states 18 bytes/parameter")
    print("      ranked by the time per training iteration "
          + ("with optimizer post-validation" if args.optimizer_post_validation
             else "with Megatron's synchronous optimizer step")
          + (f" (optimizer step {1e3 * args.cost_optimizer:g} ms)" if args.cost_optimizer else ""))
    ok = [r for r in rows if "error" not in r]
    hdr1 = (f"{'#':>3}  {'schedule':<17} {'iteration ms':^19} {'bubble':>7} {'vs 1f1b':>8}  {'act GiB':^13}  "
            f"{'peak GiB':^14}  fits")
    hdr2 = (f"{'':>3}  {'':<17} {'sync':>9} {'postval':>9} {'':>7} {'':>8}  {'min':>6} {'max':>6}  {'max':>6} "
            f"{'on rank':>7}")
    print(hdr1)
    print(hdr2)
    print("-" * len(hdr2))
    for i, r in enumerate(ok, 1):
        act = [x / gib for x in r["activation_bytes"]]
        peak = [x / gib for x in r["peak_bytes"]]
        worst = max(range(len(peak)), key=peak.__getitem__)
        tp = r.get("throughput_vs_1f1b")
        print(f"{i:>3}  {r['schedule']:<17} {1e3 * r['iteration_time_s']:>9.1f} "
              f"{1e3 * r['iteration_time_post_validated_s']:>9.1f} {100 * r['bubble_rate']:>6.1f}% "
              f"{(f'{tp:.3f}x' if tp else '-'):>8}  {min(act):>6.1f} {max(act):>6.1f}  {peak[worst]:>6.1f} "
              f"{worst:>7}  {'yes' if r['fits'] else 'NO'}")
    for r in rows:
        if "error" in r:
            print(f"{'-':>3}  {r['schedule']:<17} n/a: {r['error']}")
    fitting = [r for r in ok if r["fits"]]
    print()
    if not fitting:
        print(f"no schedule fits {args.gpu_memory_gb:g} GiB per GPU: more pipeline or tensor parallelism, "
              "--use-distributed-optimizer or fewer microbatches in flight would help")
        return
    best, rest = fitting[0], fitting[1:]
    pv = " --enable-optimizer-post-validation" if args.optimizer_post_validation else ""
    print(f"suggested flags ({best['schedule']}, the fastest that fits), ready to paste into your Megatron command:")
    print(f"  {best['flags']}{pv}")
    if rest:
        print("the other schedules that fit:")
        width = max(len(r["schedule"]) for r in rest)
        for r in rest:
            print(f"  {r['schedule']:<{width}}  {r['flags']}{pv}")
    for r in fitting:
        lim = r.get("memory_limit_microbatches")
        if lim:
            unit = r["activation_unit_bytes"] / gib
            print(f"{r['schedule']}: --zero-bubble-memory-limit counts microbatches: {lim:g} x {unit:.2f} GiB "
                  f"(one microbatch's activations on the fullest rank) = {lim * unit:.1f} GiB")
    if advice:
        print(advice)


def _plot_iterations(text):
    v = positive_int("--iterations")(text)
    if v > 3:
        raise argparse.ArgumentTypeError(f"--iterations draws 1 to 3 iterations, got {v}")
    return v


def _post_validation_advice(rows: List[dict], post_validation: bool) -> Optional[str]:
    """A line recommending optimizer post-validation when it makes the best fitting schedule
    faster (by more than 0.5%), naming the schedule that wins each way."""
    fit = [r for r in rows if "error" not in r and r["fits"]]
    if not fit:
        return None
    by_sync = min(fit, key=lambda r: (r["iteration_time_s"], r["makespan_s"]))
    by_post = min(fit, key=lambda r: (r["iteration_time_post_validated_s"], r["makespan_s"]))
    t_sync, t_post = by_sync["iteration_time_s"], by_post["iteration_time_post_validated_s"]
    if t_post <= 0 or t_sync / t_post < 1.005:
        return None
    if post_validation:
        return (f"optimizer post-validation pays here: {by_post['schedule']} {t_post:.4g} s per iteration; "
                f"without it the best is {by_sync['schedule']} at {t_sync:.4g} s")
    return (f"recommended: --enable-optimizer-post-validation with {by_post['schedule']}: {t_post:.4g} s per "
            f"iteration vs {t_sync:.4g} s for the best synchronous choice {by_sync['schedule']} "
            f"({t_sync / t_post:.3f}x); --optimizer-post-validation ranks by it")


def cmd_verify(argv) -> int:
    from . import verify
    return verify.main_verify(argv)


def _add_exact_args(ap: argparse.ArgumentParser):
    ap.add_argument("--exact", action="store_true",
                    help="automatic schedules: also solve the exact MILP (HiGHS) and keep the shorter "
                         "schedule; meant for small settings (p <= 4, m <= 8)")
    ap.add_argument("--exact-nodes", type=positive_int("--exact-nodes"), default=20000,
                    help="branch-and-bound node limit of --exact (deterministic; default 20000)")
    ap.add_argument("--exact-seconds", type=nonneg("--exact-seconds"), default=None,
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
    _add_post_validation_arg(c, "rank by the time per iteration")
    c.set_defaults(func=cmd_compare)
    pl = sub.add_parser("plot", help="timeline picture (.png/.svg) or Chrome trace (.json)")
    _add_setting_args(pl)
    pl.add_argument("--out", nargs="+", required=True, metavar="FILE")
    pl.add_argument("--time-unit", choices=["ms", "s", "us"], default="ms",
                    help="unit of the --cost-* values (default ms): the picture's axis and the trace's "
                         "microsecond timestamps follow it")
    pl.add_argument("--iterations", type=_plot_iterations, default=1,
                    help="draw 1 to 3 training iterations back to back (the optimizer barrier shows)")
    _add_post_validation_arg(pl, "draw the iterations")
    pl.set_defaults(func=cmd_plot)
    pn = sub.add_parser("plan", help="rank schedules for a GPT model and a GPU memory budget",
                        description="Rank every schedule for one GPT model, pipeline size and GPU memory "
                        "budget: simulated time per iteration, bubble, speed-up over 1F1B, memory per "
                        "pipeline rank and whether it fits; then the Megatron flags to use. F/B/W times come "
                        "from the ZB paper's per-layer FLOPs at a GPU's peak x --efficiency, or from a profile "
                        "written while training (--profile); activation memory from Megatron's per-layer "
                        "formula, model states at 18 bytes per parameter.",
                        epilog=PLAN_COLUMNS, formatter_class=argparse.RawDescriptionHelpFormatter)
    pn.add_argument("--num-layers", type=positive_int("--num-layers"), required=True,
                    help="transformer layers of the model (Megatron's --num-layers)")
    pn.add_argument("--hidden-size", type=positive_int("--hidden-size"), required=True, help="hidden size h")
    pn.add_argument("--num-attention-heads", type=positive_int("--num-attention-heads"), required=True,
                    help="attention heads a (must divide --hidden-size)")
    pn.add_argument("--seq-length", type=positive_int("--seq-length"), required=True, help="sequence length s")
    pn.add_argument("--micro-batch-size", type=positive_int("--micro-batch-size"), default=1,
                    help="sequences per microbatch b (default 1)")
    pn.add_argument("--vocab-size", type=positive_int("--vocab-size"), default=32000,
                    help="vocabulary size: the output layer's cost and logits memory on the loss stage "
                         "(default 32000)")
    pn.add_argument("--ffn-hidden-size", type=positive_int("--ffn-hidden-size"), default=None,
                    help="MLP hidden size (default 4 x --hidden-size)")
    pn.add_argument("--tensor-parallel-size", type=positive_int("--tensor-parallel-size"), default=1,
                    help="tensor-parallel size t: divides costs and most memory (default 1)")
    pn.add_argument("--sequence-parallel", action="store_true",
                    help="sequence parallelism: the LayerNorm/dropout activations are divided by t too")
    pn.add_argument("--data-parallel-size", type=positive_int("--data-parallel-size"), default=1,
                    help="data-parallel size: only matters with --use-distributed-optimizer (default 1)")
    pn.add_argument("--use-distributed-optimizer", action="store_true",
                    help="optimizer states sharded over the data-parallel ranks (12 of the 18 bytes/parameter)")
    pn.add_argument("--no-flash-attention", action="store_true",
                    help="count the 5as attention-score activations (no flash attention)")
    pn.add_argument("--pipeline-parallel-size", type=positive_int("--pipeline-parallel-size"), required=True,
                    help="pipeline ranks P (>= 2)")
    pn.add_argument("--num-microbatches", type=positive_int("--num-microbatches"), required=True,
                    help="microbatches per iteration M (global batch / (micro-batch x data-parallel size))")
    pn.add_argument("--gpu-memory-gb", type=nonneg("--gpu-memory-gb"), default=80.0,
                    help="memory budget per GPU in GiB (default 80); zb-auto and v-auto search under it")
    pn.add_argument("--gpu", choices=["h100", "h200", "a100", "b200", "mi300x"], default="h100",
                    help="GPU whose dense bf16 peak sets the FLOP-based times (default h100: 989 TFLOPS)")
    pn.add_argument("--peak-tflops", type=nonneg("--peak-tflops"), default=None,
                    help="peak TFLOPS to use instead of --gpu's")
    pn.add_argument("--efficiency", type=nonneg("--efficiency"), default=0.5,
                    help="fraction of the peak a pass reaches (default 0.5)")
    pn.add_argument("--profile", metavar="JSON",
                    help="take F/B/W (and message) times, in seconds, from a profile JSON written while training "
                         "(--zero-bubble-profile-window) instead of FLOPs")
    pn.add_argument("--allow-padding-num-layers", action="store_true",
                    help="first and last stage take one layer less (they hold the embedding and the loss)")
    pn.add_argument("--cost-optimizer", type=nonneg("--cost-optimizer"), default=0.0,
                    help="seconds of one optimizer step, added to the time per iteration (default 0)")
    _add_post_validation_arg(pn, "rank by the time per iteration")
    og = pn.add_argument_group("activation offload (docs/offload.md)")
    og.add_argument("--offload-ratio", type=share_or_auto("--offload-ratio"), default=None, metavar="R|auto",
                    help="offload this share of each schedule's activations; 'auto': as little as fits the budget")
    og.add_argument("--offload-time", type=nonneg("--offload-time"), default=None, metavar="K",
                    help="one-way transfer of a stage activation takes K x (F + B) (default 1, or from --host-link-gbps)")
    og.add_argument("--host-link-gbps", type=nonneg("--host-link-gbps"), default=None, metavar="GB/s",
                    help="one-way host link bandwidth per GPU; K follows from the activation bytes and F + B")
    og.add_argument("--offload-half-duplex", action="store_true",
                    help="D2H and H2D share one queue (one copy stream)")
    pn.add_argument("--json", action="store_true",
                    help="print one JSON object instead (per-rank lists in bytes and seconds)")
    pn.add_argument("--jobs", type=positive_int("--jobs"), default=None, metavar="N",
                    help="generate the schedules in N processes at once (default: the CPUs this process may "
                         "use, at most 8; 1: in this process). The rows are the same whatever N")
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
