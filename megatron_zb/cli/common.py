"""What the schedule commands share: the setting and offload flags, their one translation into a
``core.build.ScheduleRequest``, the size check, and the one call to ``core.build.build``.

Bad input raises ``UsageError`` (one line; ``cli.main`` prints it and exits 2)."""
from __future__ import annotations

import argparse
import os
from typing import Optional

from ..argtypes import nonneg, number_list, positive_int, share_or_auto
from ..core.ir import io as sched_io
from ..core import schedules
from ..core.build import AUTO, Built, OffloadRequest, OverMemoryLimit, ScheduleRequest, build
from ..core.ir import Schedule
from ..core.schedules.search.auto import EFFORTS
from ..core.schedules.search.exact import AUTOMATIC


class UsageError(Exception):
    pass


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        raise UsageError(f"{self.prog}: {message}")


def add_setting_args(ap: argparse.ArgumentParser, schedule_required: bool = True):
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
    ap.add_argument("--cost-bw", type=number_list("--cost-bw"), default=None,
                    help="time of a fused backward (B and W in one pass, as 1F1B runs it), where splitting it costs "
                         "(B + W above it: extra kernels, the W queue, inputs read twice); default B + W. A B and its "
                         "W run back to back are then fused where that delays no other pass")
    ap.add_argument("--cost-comm", type=nonneg("--cost-comm"), default=0.0,
                    help="time of one hop between ranks (default 0)")
    ap.add_argument("--cost-sync", type=nonneg("--cost-sync"), default=0.0,
                    help="replicated stages (bitpipe): time of the gradient all-reduce between the replicas "
                         "of a whole stage, overlapped with the remaining passes (default 0)")
    ap.add_argument("--cost-a2a", type=number_list("--cost-a2a"), default=[0.0],
                    help="MoE expert parallelism: one microbatch's all-to-all (dispatch + combine) in an F, B or "
                         "fused BW of a whole stage, serial with the pass's compute; inside an overlapped F&B pair "
                         "(dualpipe-v) each pass's all-to-all hides behind the other's compute (default 0)")
    ap.add_argument("--no-overlap", action="store_true",
                    help="with --cost-a2a: overlapped pairs do not hide their all-to-all (to compare)")
    ap.add_argument("--mem-f", type=number_list("--mem-f"), default=[1.0],
                    help="activation one F allocates on a stage (default 1)")
    ap.add_argument("--mem-w", type=number_list("--mem-w"), default=None,
                    help="part of it still needed by W (default 0.5 x mem-f)")
    ap.add_argument("--memory-limit", type=nonneg("--memory-limit"), default=None,
                    help="per-rank activation limit, in mem-f units")
    ap.add_argument("--search-effort", choices=EFFORTS, default="full",
                    help="how hard zb-auto, zb-v, v-half, v-min and v-auto search and how many ways vocabulary "
                         "passes are placed: full (default; training's default) or quick (plan's rows marked ~; "
                         "training's --zero-bubble-search-effort quick)")
    ap.add_argument("--cost-optimizer", type=nonneg("--cost-optimizer"), default=0.0,
                    help="time of one optimizer step, for the time per training iteration (default 0)")
    ap.add_argument("--cost-optimizer-post-validated", type=nonneg("--cost-optimizer-post-validated"), default=None,
                    metavar="T", help="time of the post-validated step (the eager step, its rollback copy, its "
                                      "validation; default 1.4 x --cost-optimizer, the GPU check's figure)")
    lay = ap.add_argument_group("model layout (the layers each model chunk holds)")
    lay.add_argument("--layout", "--pipeline-model-parallel-layout", dest="layout", default=None, metavar="LAYOUT",
                     help="Megatron's layout in pipeline order (E embedding, t transformer layer, m MTP layer, L loss, "
                          "| between chunks, *N repeats; a V's 2P chunks are ranks 0..P-1 then P-1..0). With it, "
                          "--cost-f/-b/-w and --mem-f/-w are one transformer layer's, and each chunk costs what it holds")
    lay.add_argument("--output-layer-cost", type=nonneg("--output-layer-cost"), default=0.0, metavar="X",
                     help="with --layout: the output layer and loss in transformer layers (F, B, W and memory; e.g. 2.24 "
                          "for Llama-3-8B's 128k vocabulary; default 0)")
    lay.add_argument("--embedding-cost", type=nonneg("--embedding-cost"), default=0.0, metavar="X",
                     help="with --layout: the embedding in transformer layers (default 0)")
    lay.add_argument("--enable-vocab-parallel", action="store_true",
                     help="with --layout: vocabulary parallelism: the output layer and loss (--output-layer-cost) "
                          "spread over every rank's vocabulary shard as passes the core places (VS, VT, VW), with "
                          "all-reduce barriers beside the compute (docs/vocab_parallel.md)")
    lay.add_argument("--disable-backward-fusion", action="store_true",
                     help="vocabulary parallelism with two barriers per microbatch instead of one (the ZB authors' flag)")
    lay.add_argument("--vocab-cost-comm", type=nonneg("--vocab-cost-comm"), default=0.0, metavar="T",
                     help="time of one vocabulary barrier's collective (default 0)")
    lay.add_argument("--split-vocab-embedding", action="store_true",
                     help="vocabulary parallelism with the input embedding split too: every rank's lookup (VI) and "
                          "weight gradient (VG) of --embedding-cost / P, their collectives at --vocab-cost-comm")
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


def add_post_validation_arg(ap: argparse.ArgumentParser, what: str):
    ap.add_argument("--optimizer-post-validation", action="store_true",
                    help=f"{what} with optimizer post-validation (training with "
                         "--enable-optimizer-post-validation); default: Megatron's synchronous optimizer step")


def add_exact_args(ap: argparse.ArgumentParser):
    ap.add_argument("--exact", action="store_true",
                    help="automatic schedules: also solve the exact MILP (HiGHS) and keep the shorter "
                         "schedule; meant for small settings (p <= 4, m <= 8)")
    ap.add_argument("--exact-nodes", type=positive_int("--exact-nodes"), default=20000,
                    help="branch-and-bound node limit of --exact (deterministic; default 20000)")
    ap.add_argument("--exact-seconds", type=nonneg("--exact-seconds"), default=None,
                    help="time limit of --exact in seconds (machine-dependent: results can differ "
                         "between machines; default none)")


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


def offload_request(args) -> Optional[OffloadRequest]:
    """The offload flags as a request, or None without --offload-ratio (other offload flags alone
    are an error)."""
    ratio = getattr(args, "offload_ratio", None)
    if ratio is None:
        given = [f for f, v in (("--offload-time", args.offload_time), ("--offload-half-duplex", args.offload_half_duplex),
                                ("--offload-chunk-num", args.offload_chunk_num)) if v not in (None, False)]
        if given:
            raise UsageError(f"{given[0]} needs --offload-ratio R (0..1) or --offload-ratio auto")
        return None
    if ratio == AUTO and args.memory_limit is None:
        raise UsageError("--offload-ratio auto offloads as little as fits --memory-limit: give --memory-limit L")
    time = args.offload_time if args.offload_time is not None else [1.0]
    return OffloadRequest(ratio=ratio, time=time if len(time) > 1 else time[0], overlap=not args.offload_half_duplex,
                          chunks=args.offload_chunk_num)


def request(args, name: Optional[str] = None, chunks: Optional[int] = None,
            p: Optional[int] = None) -> ScheduleRequest:
    """The schedule request the flags describe (``name``: instead of --schedule, e.g. compare's rows).
    With --layout, each chunk's costs from what it holds (``layout_costs``; ``p``: pipeline ranks)."""
    req = ScheduleRequest(name=name or getattr(args, "schedule", None), chunks=chunks if chunks is not None
                          else args.chunks, cost_f=args.cost_f, cost_b=args.cost_b, cost_w=args.cost_w,
                          cost_bw=getattr(args, "cost_bw", None),
                          cost_comm=args.cost_comm, cost_sync=args.cost_sync, cost_a2a=args.cost_a2a,
                          a2a_overlap=not args.no_overlap, mem_f=args.mem_f, mem_w=args.mem_w,
                          memory_limit=args.memory_limit, offload=offload_request(args),
                          exact=(args.exact_nodes, args.exact_seconds) if getattr(args, "exact", False) else None,
                          effort=getattr(args, "search_effort", "full"))
    if getattr(args, "layout", None) is not None:
        req = req.replace(**layout_costs(args, req, p if p is not None else args.stages))
    elif getattr(args, "output_layer_cost", 0.0) or getattr(args, "embedding_cost", 0.0) or \
            getattr(args, "enable_vocab_parallel", False):
        raise UsageError("--output-layer-cost / --embedding-cost / --enable-vocab-parallel describe what a --layout's "
                         "chunks hold: give --layout")
    elif getattr(args, "disable_backward_fusion", False) or getattr(args, "vocab_cost_comm", 0.0) or \
            getattr(args, "split_vocab_embedding", False):
        raise UsageError("--disable-backward-fusion / --vocab-cost-comm / --split-vocab-embedding need "
                         "--enable-vocab-parallel")
    return req


def layout_costs(args, req: ScheduleRequest, p: int) -> dict:
    """Per-chunk costs of --layout for ``req``'s schedule: each chunk holds n transformer layers (the
    flags' per-layer F/B/W/memory each), k MTP layers (one layer each) and maybe the embedding and
    the output layer + loss (``--embedding-cost`` / ``--output-layer-cost`` layers; the loss's chunk
    also runs each MTP layer's output layer again)."""
    from ..core.ir import ScheduleError
    from ..core.costs.layout import parse
    spec = schedules.get(req.name)
    try:
        lay = parse(args.layout)
        chunks = spec.resolve_chunks(req.chunks)
    except ScheduleError as e:
        raise UsageError(f"--layout: {e}") from None
    if lay.num_stages != p * chunks:
        raise ScheduleError(f"--layout {lay} has {lay.num_stages} chunks; {req.name} runs {p * chunks} "
                            f"({p} ranks x {chunks})")
    bw = getattr(args, "cost_bw", None)
    for flag, v in (("--cost-f", args.cost_f), ("--cost-b", args.cost_b), ("--cost-w", args.cost_w),
                    ("--mem-f", args.mem_f), ("--cost-a2a", args.cost_a2a)) + \
            ((("--mem-w", args.mem_w),) if args.mem_w is not None else ()) + ((("--cost-bw", bw),) if bw else ()):
        if len(v) != 1:
            raise UsageError(f"with --layout, {flag} is one transformer layer's: give one value, got {len(v)}")
    o, e, mtp = args.output_layer_cost, args.embedding_cost, lay.num_mtp_layers
    vocab = getattr(args, "enable_vocab_parallel", False)
    if vocab and o <= 0:
        raise UsageError("--enable-vocab-parallel spreads the output layer over the ranks: give --output-layer-cost X "
                         "(its cost in transformer layers)")
    inside = not (vocab and getattr(args, "split_vocab_embedding", False))  # split: the embedding in VI / VG
    units = [s.count("t") + s.count("m") + (e if "E" in s and inside else 0.0)
             + ((1 + mtp) * o if "L" in s and not vocab else 0.0) for s in lay.stages]
    mem_w = args.mem_w[0] if args.mem_w is not None else None
    out = {k: [u * getattr(args, k)[0] for u in units] for k in ("cost_f", "cost_b", "cost_w", "cost_a2a", "mem_f")}
    out["mem_w"] = None if mem_w is None else [u * mem_w for u in units]
    out["cost_bw"] = None if not bw else [u * bw[0] for u in units]
    out["chunks"] = req.chunks
    if vocab:  # each rank's shard: the output layer's (1 + MTP) x o layers over p ranks
        from ..core.ir.vocab import VocabSetting
        share = (1 + mtp) * o / p
        f, b, w, mf = (getattr(args, k)[0] * share for k in ("cost_f", "cost_b", "cost_w", "mem_f"))
        two = getattr(args, "disable_backward_fusion", False)
        split = {}
        if getattr(args, "split_vocab_embedding", False):  # the embedding's F / W over the ranks (VI, VG)
            split = dict(embedding=True, cost_i=args.cost_f[0] * e / p, cost_g=args.cost_w[0] * e / p,
                         cost_ci=args.vocab_cost_comm, cost_cg=args.vocab_cost_comm, mem_i=args.mem_f[0] * e)
        out["vocab"] = VocabSetting(barriers=2 if two else 1, cost_s=f if two else f + b, cost_t=b if two else 0.0,
                                    cost_w=w, cost_comm=args.vocab_cost_comm, mem_s=mf,
                                    mem_w=(mem_w if mem_w is not None else 0.5 * args.mem_f[0]) * share, **split)
    return out


def sizes(args, stages=None, microbatches=None, chunks=None):
    """P and M from the flags (or a loaded file), checked against the size the simulator takes."""
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
    return p, m


def build_from_args(args) -> Built:
    """The schedule --schedule or --load names, built and validated (memory limit included)."""
    base = _load(args) if getattr(args, "load", None) else None
    if getattr(args, "exact", False):
        if getattr(args, "offload_ratio", None) is not None:
            raise UsageError("--exact solves schedules without activation offload (the MILP has no host link); "
                             "leave out --offload-ratio or --exact")
        if base is not None or args.schedule not in AUTOMATIC:
            raise UsageError(f"--exact applies to the automatic schedules ({', '.join(AUTOMATIC)}), "
                             f"not {getattr(args, 'schedule', None) or '--load'}")
    if base is not None:
        p, m = sizes(args, base.num_ranks, base.num_microbatches, base.placement.chunks)
        req = request(args, name=base.name, chunks=base.placement.chunks, p=base.num_ranks)
    else:
        p, m = sizes(args)
        req = request(args)
    try:
        return build(req, p, m, base=base)
    except OverMemoryLimit as e:
        off = req.offload
        hint = ("`--offload-ratio auto` offloads as little as fits; " if off is None else
                "a smaller --offload-time lets more activations travel; " if off.ratio == AUTO else
                "--offload-ratio auto offloads as much as needed; ")
        raise UsageError(f"{e.schedule} peaks at {e.peak:g} activation units on rank {e.rank}"
                         + (" with offload" if off is not None else "") + f", over --memory-limit {e.limit:g}; "
                         + hint + f"`megatron-zb compare --memory-limit {e.limit:g}` lists the schedules that fit")


def writable(flag: str, path: str) -> str:
    """``path`` as an output file of ``flag``: its folder exists and it is not a folder itself."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a directory; give a file name in it")
    if not os.path.isdir(folder):
        what = "is a file, not a directory" if os.path.exists(folder) else "does not exist"
        raise UsageError(f"{flag} {path!r}: the folder {folder!r} {what}; create it or write elsewhere")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{flag} {path!r}: cannot write in {folder!r}")
    return path


def read_text(flag: str, path: str) -> str:
    """The text of an input file, or one line saying why it cannot be read."""
    if not os.path.exists(path):
        raise UsageError(f"{flag}: no such file {path!r}")
    if os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is a directory, not a file")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        raise UsageError(f"{flag} {path!r} is not a text file (expected JSON or CSV)") from None
    except OSError as e:
        raise UsageError(f"{flag} {path!r}: cannot read it ({e.strerror})") from None


def _load(args) -> Schedule:
    path = args.load
    text = read_text("--load", path)
    sched = sched_io.from_csv(text, os.path.basename(path)) if path.endswith(".csv") else sched_io.from_json(text)
    have = {"--stages": sched.num_ranks, "--microbatches": sched.num_microbatches, "--chunks": sched.placement.chunks}
    given = {"--stages": args.stages, "--microbatches": args.microbatches, "--chunks": args.chunks}
    wrong = [f"{k} {given[k]}" for k in have if given[k] is not None and given[k] != have[k]]
    if wrong:
        raise UsageError(f"--load {path} holds {sched.num_ranks} pipeline ranks, {sched.num_microbatches} "
                         f"microbatches and {sched.placement.chunks} chunk(s) per rank, not {', '.join(wrong)}; "
                         "leave those flags out (the file sets them) or give the file's values")
    return sched


def fmt(vals):
    return ",".join(f"{x:g}" for x in vals) if len(set(vals)) > 1 else f"{vals[0]:g}"
