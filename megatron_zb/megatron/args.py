"""Megatron-style command-line flags for megatron-zb, and their validation.

    from megatron_zb.megatron.args import add_zero_bubble_args, chain_providers, validate_zero_bubble_args

    provider = chain_providers(my_extra_args, add_zero_bubble_args)   # Megatron's extra_args_provider
    args = megatron.training.arguments.parse_args(extra_args_provider=provider)
    kwargs = validate_zero_bubble_args(args)        # None: no zero-bubble flag given
    ...                                              # Megatron's validate_args(args), set_global_variables(args)
    if kwargs: install(**kwargs)                     # megatron_zb.megatron.install

Two families of flags, both accepted by ``add_zero_bubble_args``:

* **ours**: ``--zero-bubble-schedule NAME`` (any schedule of the core registry),
  ``--zero-bubble-memory-limit L`` (microbatches of activation, or ``<x>GB`` / ``<x>GiB``),
  ``--zero-bubble-timeout S``, ``--zero-bubble-profile-window START END``,
  ``--zero-bubble-profile-path FILE``, ``--zero-bubble-cost-f/-b/-w/-comm``, ``--zero-bubble-mem-w``,
  ``--allow-padding-num-layers``;
* **the ZB authors' fork's**, with the same meaning, so an existing script runs unchanged:
  ``--enable-zero-bubble``, ``--zero-bubble-v-schedule``, ``--zero-bubble-v-schedule-mem-setup``,
  ``--zero-bubble-max-pending-backward``, ``--zero-bubble-pipeline-timers-start-iter/-end-iter``,
  ``--allow-padding-num-layers``, ``--enable-zb-runtime`` and ``--no-pre-communication-optimization``
  (accepted, nothing to do). The fork's flags for features megatron-zb does not have yet
  (exact-numeric-match, ...) parse, and validation then refuses them with a
  "not available yet in megatron-zb" message. The fork's activation-offload flags work
  (``--cpu-offload``, ``--offload-chunk-num``, ``--offload-time``, ``--auto-offload-time``,
  ``--offload-overlap-sr``), with ours: ``--zero-bubble-offload-ratio``,
  ``--zero-bubble-offload-half-duplex``, ``--zero-bubble-offload-cpu-test``.

``validate_zero_bubble_args`` checks the combination up front (before any process group exists)
and raises ``ZeroBubbleArgumentError`` with a message naming the flags; it returns the keyword
arguments for ``install()``. Called **before** Megatron's own ``validate_args`` (as megatron-zb's
entry point does) it also sets the Megatron layout arguments the schedule needs: two virtual
stages per rank for V schedules, the first/last stage layer counts for ``--allow-padding-num-layers``.
Called after Megatron validated (a patched Megatron-LM ``pretrain_gpt.py``), schedules that need a
different model layout are refused with a pointer to the entry point.

This module imports neither torch nor megatron.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
from typing import Any, Callable, Dict, Optional

from ..core import schedules as core_schedules
from ..core.ir import ScheduleError

__all__ = ["add_zero_bubble_args", "chain_providers", "validate_zero_bubble_args", "ZeroBubbleArgumentError",
           "zero_bubble_requested", "memory_limit_in_microbatches", "NOT_AVAILABLE_FLAGS", "placement_style",
           "preview_schedule", "install_from_args", "install_on_first_use"]

DEFAULT_TIMEOUT_S = 300.0
FORK_TIMERS_DEFAULT = (100, 110)  # the fork's default profiling window, used when only one end is given


class ZeroBubbleArgumentError(ValueError):
    """A megatron-zb flag or flag combination that cannot run; the message says which and why."""


# --------------------------------------------------------------------------------------------
# parsing
# --------------------------------------------------------------------------------------------

def _schedule_name(text: str) -> str:
    name = str(text).strip()
    try:
        core_schedules.get(name)
    except ScheduleError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def _positive_float(flag):
    def parse(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number > 0, got {text!r}") from None
        if not (v > 0 and math.isfinite(v)):
            raise argparse.ArgumentTypeError(f"{flag} must be a number > 0, got {text!r}")
        return v
    return parse


def _cost(flag):
    """A number, or a comma list (one per pipeline rank); the CLI's parser, unwrapped when single."""
    from ..argtypes import number_list as _number_list
    parse_list = _number_list(flag)

    def parse(text):
        vals = parse_list(text)
        return vals[0] if len(vals) == 1 else vals
    return parse


_LIMIT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(GB|GIB|G)?\s*$", re.IGNORECASE)


def _memory_limit(text):
    """'8' (microbatches of one stage's activation) or '20GB' / '20GiB' -> (value, unit)."""
    m = _LIMIT_RE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(
            f"--zero-bubble-memory-limit takes a number of microbatches (e.g. 8) or a size in GB (e.g. 20GB, "
            f"20GiB), got {text!r}")
    value = float(m.group(1))
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"--zero-bubble-memory-limit must be > 0, got {text!r}")
    unit = (m.group(2) or "").upper()
    if unit in ("GB", "G"):
        return (value, "GB")
    if unit == "GIB":
        return (value, "GiB")
    return (value, "microbatches")


def _pending_backward(text):
    t = str(text).strip()
    if t.lower() == "auto":
        return "auto"
    try:
        v = int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--zero-bubble-max-pending-backward takes an integer (microbatches of activation) or 'auto', "
            f"got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"--zero-bubble-max-pending-backward must be >= 1, got {text!r}")
    return v


def _share_or_auto(flag):
    from ..argtypes import share_or_auto
    return share_or_auto(flag)


def _nonneg_float(flag):
    from ..argtypes import nonneg
    return nonneg(flag)


def _nonneg_int(flag):
    from ..argtypes import int_at_least
    return int_at_least(flag, 0)


# The fork's flags for features megatron-zb does not have yet: parsed (so the user's script gets
# past argparse) and refused by validation. dest -> (flag, is_given(value)).
NOT_AVAILABLE_FLAGS: Dict[str, tuple] = {
    "enable_exactly_numeric_match": ("--enable-exactly-numeric-match", bool),
    "enable_1f1b_v": ("--enable-1f1b-v", bool),
    "interleave_group_size": ("--interleave-group-size", lambda v: v is not None and v > 0),
    "num_seq_splits": ("--num-seq-splits", lambda v: v is not None and v > 1),
    "recompute_lgd": ("--recompute-lgd", bool),
    "measure_activation_memory": ("--measure-activation-memory", bool),
    "profile_memory_iter": ("--profile-memory-iter", lambda v: v is not None and v >= 0),
    "zero_bubble_adaptive_memory_limit_percentile": ("--zero-bubble-adaptive-memory-limit-percentile",
                                                     lambda v: v is not None),
}

_WHAT_INSTEAD = {
    "enable_1f1b_v": "for a V-placement run with fused backward use --zero-bubble-schedule gpipe-v, "
                     "or zb-v for the zero-bubble V schedule",
    "enable_exactly_numeric_match": "megatron-zb's schedules already give the same gradients as 1F1B; "
                                    "`megatron-zb verify` checks it",
    "zero_bubble_adaptive_memory_limit_percentile": "give --zero-bubble-max-pending-backward N or "
                                                    "--zero-bubble-memory-limit (microbatches or GB)",
    "interleave_group_size": "use --zero-bubble-schedule interleaved-1f1b with "
                             "--num-layers-per-virtual-pipeline-stage",
}


def add_zero_bubble_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add megatron-zb's flags (and the ZB authors' fork's) to a Megatron argument parser.

    Usable directly as Megatron's ``extra_args_provider``; returns the parser.
    """
    names = ", ".join(core_schedules.names())
    g = parser.add_argument_group("megatron-zb", "zero-bubble pipeline schedules (megatron-zb plugin)")
    g.add_argument("--zero-bubble-schedule", type=_schedule_name, default=None, metavar="NAME",
                   help=f"Run this megatron-zb pipeline schedule instead of Megatron's. One of: {names}. "
                        "V schedules (zb-v, v-half, v-min, v-auto, dualpipe-v, gpipe-v) place 2 model chunks "
                        "per rank in V order; interleaved-1f1b/looped-bfs use Megatron's virtual pipeline "
                        "(--num-layers-per-virtual-pipeline-stage).")
    g.add_argument("--zero-bubble-memory-limit", type=_memory_limit, default=None, metavar="L",
                   help="Per-rank activation memory limit: a number of microbatches of one stage's "
                        "activation (1F1B needs the pipeline size), or a size with a GB/GiB suffix, converted "
                        "with Megatron's per-layer formula (see docs/training.md). zb-auto/v-auto search "
                        "under it; other schedules are refused if they need more.")
    g.add_argument("--zero-bubble-timeout", type=_positive_float("--zero-bubble-timeout"), default=None,
                   metavar="SECONDS",
                   help=f"How long a rank waits for a pipeline message before failing with its rank, the "
                        f"pass and the peer (default {DEFAULT_TIMEOUT_S:g}).")
    g.add_argument("--zero-bubble-profile-window", type=int, nargs=2, default=None, metavar=("START", "END"),
                   help="Time F, B, W and p2p per pass over training iterations START..END (counted from 1) "
                        "and write a profile JSON (`megatron-zb plan --profile` reads it); zb-auto and v-auto "
                        "re-plan from the measured costs afterwards.")
    g.add_argument("--zero-bubble-profile-path", type=str, default=None, metavar="FILE",
                   help="Where the profile JSON goes (default: zero_bubble_profile.json in --save, else the "
                        "working directory).")
    for kind, what in (("f", "F (forward)"), ("b", "B (input gradient)"), ("w", "W (weight gradient)")):
        g.add_argument(f"--zero-bubble-cost-{kind}", type=_cost(f"--zero-bubble-cost-{kind}"), default=None,
                       metavar="T",
                       help=f"Relative time of one microbatch's {what} on a stage, for the schedule generator "
                            f"(a comma list gives one value per rank; default 1).")
    g.add_argument("--zero-bubble-cost-comm", type=_cost("--zero-bubble-cost-comm"), default=None, metavar="T",
                   help="Relative time of one pipeline hop (default 0).")
    g.add_argument("--zero-bubble-mem-w", type=float, default=None, metavar="RATIO",
                   help="Fraction of a microbatch's activation still held after B until W (default 0.5).")
    g.add_argument("--zero-bubble-offload-ratio", type=_share_or_auto("--zero-bubble-offload-ratio"), default=None,
                   metavar="R|auto",
                   help="Activation offload (implies --cpu-offload): offload this share (0..1) of each rank's "
                        "activations, the longest-lived first; 'auto': as few as fit --zero-bubble-memory-limit "
                        "(zb-auto/v-auto may then take a schedule that needs more and offload it back under).")
    g.add_argument("--zero-bubble-offload-half-duplex", action="store_true", default=False,
                   help="One copy stream for offloads and reloads (the fork's default without "
                        "--offload-overlap-sr); megatron-zb's default is one stream each.")
    g.add_argument("--zero-bubble-offload-cpu-test", action="store_true", default=False,
                   help="Allow activation offload without CUDA: synchronous copies between CPU tensors, to check "
                        "correctness (not speed) on a CPU machine.")
    g.add_argument("--allow-padding-num-layers", action="store_true", default=False,
                   help="Allow a layer count that does not split evenly: the first and the last stage (which "
                        "also hold the embedding and the loss) get one layer less, i.e. --num-layers = k x "
                        "stages - 2 (the ZB authors' flag).")

    f = parser.add_argument_group("megatron-zb: ZB authors' fork flags",
                                  "accepted with the fork's meaning, so existing scripts run unchanged")
    f.add_argument("--enable-zero-bubble", action="store_true", default=False,
                   help="Use a zero-bubble schedule: zb-auto (the automatic scheduler under "
                        "--zero-bubble-max-pending-backward) if the core has it, else zb-h1; with "
                        "--zero-bubble-v-schedule a V schedule.")
    f.add_argument("--zero-bubble-v-schedule", action="store_true", default=False,
                   help="Use the V-shape zero-bubble schedule (2 chunks per rank; zb-v, or v-half / v-min "
                        "with --zero-bubble-v-schedule-mem-setup). Implies --enable-zero-bubble.")
    f.add_argument("--zero-bubble-v-schedule-mem-setup", choices=("zb", "half", "min"), default=None,
                   help="V schedule memory setup: zb -> zb-v (1F1B's memory), half -> v-half, min -> v-min "
                        "(default zb).")
    f.add_argument("--zero-bubble-max-pending-backward", type=_pending_backward, default=None, metavar="N|auto",
                   help="Memory limit of the non-V zero-bubble scheduler in microbatches of one stage's "
                        "activation (p ~ ZB-H1, 2p ~ ZB-H2). 'auto' (the fork's default): megatron-zb uses "
                        "the scheduler's default, p. Ignored by V schedules, as in the fork.")
    f.add_argument("--zero-bubble-pipeline-timers-start-iter", type=_nonneg_int("--zero-bubble-pipeline-timers-"
                   "start-iter"), default=None, metavar="ITER",
                   help="First iteration of the profiling window (as --zero-bubble-profile-window START).")
    f.add_argument("--zero-bubble-pipeline-timers-end-iter", type=_nonneg_int("--zero-bubble-pipeline-timers-"
                   "end-iter"), default=None, metavar="ITER",
                   help="Last iteration of the profiling window; zb-auto re-plans from the measurements "
                        "after it.")
    f.add_argument("--enable-zb-runtime", action="store_true", default=False,
                   help="Accepted for compatibility; megatron-zb always runs its own runtime.")
    f.add_argument("--no-pre-communication-optimization", action="store_false",
                   dest="pre_communication_optimization", default=True,
                   help="Accepted for compatibility; megatron-zb sends no pre-communication messages.")
    f.add_argument("--zero-bubble-post-validation-min-clean-steps", type=_nonneg_int(
                       "--zero-bubble-post-validation-min-clean-steps"), default=None, metavar="N",
                   help="With --enable-optimizer-post-validation: optimizer steps stay synchronous until N steps in a "
                        "row were neither clipped nor skipped, and again after each rollback (default 10, the "
                        "fork's rule; 0 post-validates from the first step).")
    f.add_argument("--enable-optimizer-post-validation", action="store_true", default=False,
                   help="Optimizer post-validation: each pipeline rank steps as soon as its own last pass is done; "
                        "the gradient norm and inf/NaN flags are reduced along the pipeline and the step is "
                        "rolled back and redone when they say Megatron's step would have clipped or skipped.")
    # not available yet: parsed here, refused by validate_zero_bubble_args
    f.add_argument("--enable-exactly-numeric-match", action="store_true", default=False,
                   help="Not available yet in megatron-zb.")
    f.add_argument("--enable-1f1b-v", action="store_true", default=False,
                   help="Not available yet in megatron-zb (use --zero-bubble-schedule gpipe-v or zb-v).")
    f.add_argument("--cpu-offload", action="store_true", default=False,
                   help="Activation offload (PipeOffload): move activations to pinned host memory after their F "
                        "and back before their B, on CUDA side streams, where the schedule leaves time "
                        "(docs/offload.md). All that can travel unless --zero-bubble-offload-ratio says less.")
    f.add_argument("--offload-chunk-num", type=int, default=None, metavar="N",
                   help="Offload only the first N model chunks of each rank (1..chunks; default all).")
    f.add_argument("--offload-time", type=_nonneg_float("--offload-time"), default=None, metavar="K",
                   help="One-way transfer of one microbatch's stage activation takes K x (F + B) of that stage; "
                        "the schedule places offloads and reloads with it (default 1).")
    f.add_argument("--auto-offload-time", action="store_true", default=False,
                   help="Measure K at start-up: this GPU's matmul speed and host-link bandwidth (the largest K "
                        "over all ranks is used).")
    f.add_argument("--offload-overlap-sr", action="store_true", default=False,
                   help="D2H and H2D copies on separate streams, so offloads and reloads overlap (megatron-zb's "
                        "default; see --zero-bubble-offload-half-duplex for one stream).")
    f.add_argument("--offload-continuous-buffers", action="store_true", default=False,
                   help="Accepted: megatron-zb always packs each offloaded activation into one reused host "
                        "buffer.")
    f.add_argument("--interleave-group-size", type=int, default=None, help="Not available yet in megatron-zb.")
    f.add_argument("--num-seq-splits", type=int, default=None, help="Not available yet in megatron-zb (> 1).")
    f.add_argument("--recompute-lgd", action="store_true", default=False, help="Not available yet in megatron-zb.")
    f.add_argument("--no-paired-barrier", action="store_true", default=False,
                   help="Accepted: megatron-zb has no paired PCIe barrier between neighbouring GPUs.")
    f.add_argument("--measure-activation-memory", action="store_true", default=False,
                   help="Not available yet in megatron-zb.")
    f.add_argument("--profile-memory-iter", type=int, default=None, help="Not available yet in megatron-zb.")
    f.add_argument("--zero-bubble-adaptive-memory-limit-percentile", type=int, default=None,
                   help="Not available yet in megatron-zb (no adaptive memory limit).")
    return parser


def chain_providers(*providers: Optional[Callable]) -> Callable[[argparse.ArgumentParser], argparse.ArgumentParser]:
    """One ``extra_args_provider`` that applies each of ``providers`` in order (None entries skipped).

    A provider that returns None is taken to have modified the parser in place.
    """
    chain = [p for p in providers if p is not None]

    def provider(parser):
        for p in chain:
            out = p(parser)
            if out is not None:
                parser = out
        return parser
    provider.providers = tuple(chain)
    return provider


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------

def zero_bubble_requested(args) -> bool:
    """True if any flag selects a megatron-zb schedule."""
    return bool(getattr(args, "zero_bubble_schedule", None) or getattr(args, "enable_zero_bubble", False)
                or getattr(args, "zero_bubble_v_schedule", False))


def placement_style(name: str) -> str:
    """'single', 'looped' or 'v' for a schedule of the core registry."""
    spec = core_schedules.get(name)
    if spec.chunks == 1:
        return "single"
    if spec.chunks is None:
        return "looped"
    from ..core.ir import Setting
    sched = core_schedules.generate(name, Setting(2, 4, chunks=spec.chunks))
    return sched.placement.style


def _resolve_schedule(args) -> Optional[str]:
    ours = getattr(args, "zero_bubble_schedule", None)
    v_flag = bool(getattr(args, "zero_bubble_v_schedule", False))
    enable = bool(getattr(args, "enable_zero_bubble", False))
    mem_setup = getattr(args, "zero_bubble_v_schedule_mem_setup", None)
    fork = None
    if v_flag:
        fork = {"zb": "zb-v", "half": "v-half", "min": "v-min"}[mem_setup or "zb"]
    elif enable:
        fork = "zb-auto" if "zb-auto" in core_schedules.names() else "zb-h1"
    if mem_setup is not None and not v_flag:
        raise ZeroBubbleArgumentError("--zero-bubble-v-schedule-mem-setup only applies with --zero-bubble-v-schedule")
    if fork is not None:
        try:
            core_schedules.get(fork)
        except ScheduleError as e:
            flags = "--zero-bubble-v-schedule" + (f" --zero-bubble-v-schedule-mem-setup {mem_setup}" if mem_setup
                                                    else "") if v_flag else "--enable-zero-bubble"
            raise ZeroBubbleArgumentError(f"{flags} selects schedule {fork!r}, which this megatron-zb does not have "
                                          f"yet: {e}") from None
    if ours is not None and fork is not None and ours != fork:
        raise ZeroBubbleArgumentError(
            f"--zero-bubble-schedule {ours} conflicts with the fork's flags, which select {fork}; give one of them")
    name = ours or fork
    if name is not None:
        try:
            core_schedules.get(name)
        except ScheduleError as e:
            raise ZeroBubbleArgumentError(str(e)) from None
    return name


def memory_limit_in_microbatches(gigabytes: float, args, *, gib: bool = False) -> float:
    """Convert a per-rank activation budget in GB into microbatches of one stage's activation.

    One microbatch's activation on a rank = (layers on the rank) x M_B, with Megatron's per-layer
    formula M_B = s b (34 h + 5 a s) / t bytes (sequence parallel; without it the 10 s b h
    LayerNorm/dropout part is not divided by t; the 5 a s attention-score term is dropped with
    Transformer Engine, whose fused attention does not store the scores). Embedding and loss
    buffers are not counted: leave some headroom.
    """
    from ..core.plan import ModelSpec
    p = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    spec = ModelSpec(num_layers=int(args.num_layers), hidden_size=int(args.hidden_size),
                     num_attention_heads=int(args.num_attention_heads), seq_length=int(args.seq_length),
                     micro_batch_size=int(getattr(args, "micro_batch_size", 1) or 1),
                     tensor_parallel_size=int(getattr(args, "tensor_model_parallel_size", 1) or 1),
                     sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
                     flash_attention=getattr(args, "transformer_impl", "local") == "transformer_engine")
    m_b, _ = spec.layer_activation_bytes()
    per_microbatch = m_b * spec.num_layers / p
    budget = gigabytes * (2 ** 30 if gib else 1e9)
    return budget / per_microbatch


def _given(args, dest, default=None):
    v = getattr(args, dest, default)
    return v is not None and v is not False


def validate_zero_bubble_args(args, *, before_megatron_validation: Optional[bool] = None) -> Optional[Dict[str, Any]]:
    """Check megatron-zb's flags against each other and against Megatron's; return ``install()`` kwargs.

    Returns None when no flag selects a megatron-zb schedule (Megatron's own schedules run), after
    still refusing the fork's flags for features that are not available yet.

    ``before_megatron_validation`` (default: detected — Megatron's ``validate_args`` sets
    ``args.virtual_pipeline_model_parallel_size``): when True, the Megatron layout arguments the
    schedule needs are set here (V schedules: ``num_virtual_stages_per_pipeline_rank = 2``;
    ``--allow-padding-num-layers`` with one chunk per rank: ``decoder_first/last_pipeline_num_layers``).
    Also sets ``args.zero_bubble_placement`` ('single' / 'looped' / 'v') and
    ``args.zero_bubble_resolved_schedule``.
    """
    err = ZeroBubbleArgumentError
    for dest, (flag, given) in NOT_AVAILABLE_FLAGS.items():
        if given(getattr(args, dest, None)):
            hint = _WHAT_INSTEAD.get(dest)
            raise err(f"{flag} is not available yet in megatron-zb" + (f" ({hint})" if hint else ""))

    name = _resolve_schedule(args)
    if name is None:
        for flag, dest in (("--enable-optimizer-post-validation", "enable_optimizer_post_validation"),
                           ("--zero-bubble-memory-limit", "zero_bubble_memory_limit"),
                           ("--zero-bubble-max-pending-backward", "zero_bubble_max_pending_backward"),
                           ("--zero-bubble-profile-window", "zero_bubble_profile_window"),
                           ("--zero-bubble-pipeline-timers-start-iter", "zero_bubble_pipeline_timers_start_iter"),
                           ("--zero-bubble-pipeline-timers-end-iter", "zero_bubble_pipeline_timers_end_iter"),
                           ("--cpu-offload", "cpu_offload"),
                           ("--zero-bubble-offload-ratio", "zero_bubble_offload_ratio")):
            if _given(args, dest):
                raise err(f"{flag} needs a megatron-zb schedule: add --zero-bubble-schedule NAME "
                          "(or the fork's --enable-zero-bubble / --zero-bubble-v-schedule)")
        _offload_kwargs(args, name=None, chunks=1, limit=None)  # stray offload flags get their message
        args.zero_bubble_resolved_schedule = None
        args.zero_bubble_placement = None
        if getattr(args, "allow_padding_num_layers", False):
            _apply_padding_single(args, before_megatron_validation, name=None)
        return None

    if before_megatron_validation is None:
        before_megatron_validation = not hasattr(args, "virtual_pipeline_model_parallel_size")
    spec = core_schedules.get(name)
    style = placement_style(name)
    p = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    if p < 2:
        raise err(f"schedule {name} needs pipeline parallelism: --pipeline-model-parallel-size is {p}, and "
                  "zero-bubble schedules remove pipeline bubbles, which need at least 2 stages (with PP=1 drop "
                  "the zero-bubble flags; Megatron's no-pipelining schedule is already bubble-free)")
    L = getattr(args, "num_layers", None)
    pad = bool(getattr(args, "allow_padding_num_layers", False))
    nlpvs = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
    nvspr = getattr(args, "num_virtual_stages_per_pipeline_rank", None)
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    first = getattr(args, "decoder_first_pipeline_num_layers", None)
    last = getattr(args, "decoder_last_pipeline_num_layers", None)

    # -- Megatron options our runtime cannot honour --------------------------------------------
    conflicts = [
        ("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm",
         "Megatron's combined-1F1B EP overlap is its own schedule"),
        ("defer_embedding_wgrad_compute", "--defer-embedding-wgrad-compute",
         "megatron-zb already defers weight gradients (W passes)"),
        ("num_microbatches_with_partial_activation_checkpoints",
         "--num-microbatches-with-partial-activation-checkpoints", "not supported by the megatron-zb runtime"),
        ("overlap_p2p_comm_warmup_flush", "--overlap-p2p-communication-warmup-flush",
         "it tunes Megatron's interleaved schedule; megatron-zb does its own pipeline communication"),
        ("microbatch_group_size_per_vp_stage", "--microbatch-group-size-per-virtual-pipeline-stage",
         "it tunes Megatron's interleaved schedule; the megatron-zb schedule fixes the order"),
    ]
    for dest, flag, why in conflicts:
        if _given(args, dest):
            raise err(f"{flag} cannot be combined with megatron-zb schedule {name}: {why}")
    if getattr(args, "cuda_graph_impl", None) == "full_iteration":
        raise err(f"--cuda-graph-impl full_iteration captures Megatron's own schedule; it cannot be combined with "
                  f"megatron-zb schedule {name}")

    # -- model layout ------------------------------------------------------------------------------
    if style in ("v", "bitpipe"):
        models = 4 if style == "bitpipe" else 2
        what = "in BitPipe order (two V pipelines)" if style == "bitpipe" else "in V order"
        if nlpvs is not None or nvspr not in (None, models) or \
                (not before_megatron_validation and vpp not in (None, models)):
            raise err(f"schedule {name} places {models} model chunks per rank {what} itself; drop "
                      "--num-layers-per-virtual-pipeline-stage / --num-virtual-stages-per-pipeline-rank")
        for dest, flag in (("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout"),
                           ("decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers"),
                           ("decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers"),
                           ("account_for_embedding_in_pipeline_split", "--account-for-embedding-in-pipeline-split"),
                           ("account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split")):
            if _given(args, dest):
                raise err(f"{flag} cannot be combined with V schedule {name}, which sets the layer layout itself "
                          "(use --allow-padding-num-layers for a layer count that does not split evenly)")
        if not before_megatron_validation:
            raise err(f"V schedule {name} needs megatron-zb's model layout (2 chunks per rank in V order, "
                      "embedding and loss on rank 0): run `python -m megatron_zb.megatron.pretrain_gpt` "
                      "(or scripts/pretrain_gpt_zb.sh) instead of a patched pretrain_gpt.py")
        if L is not None:
            S = 2 * p
            if L % S:
                if not pad:
                    raise err(f"V schedule {name} needs an even number of layers per pipeline stage: --num-layers "
                              f"{L} is not divisible by 2 x --pipeline-model-parallel-size = {S}; use a multiple "
                              f"of {S}, or --allow-padding-num-layers with --num-layers = k x {S} - 2")
                if (L + 2) % S or (L + 2) // S < 2:
                    raise err(f"--allow-padding-num-layers with V schedule {name} needs --num-layers = k x {S} - 2 "
                              f"(k >= 2, first and last stage one layer less), got {L}")
        args.num_virtual_stages_per_pipeline_rank = models
        chunks = 2
        if style == "bitpipe" and not getattr(args, "zero_bubble_deterministic_init", False):
            # the two replicas of every stage must start identical: draw every weight from its global name
            args.zero_bubble_deterministic_init = True
    elif style == "looped":
        if layout is not None:
            raise err(f"--pipeline-model-parallel-layout cannot be combined with megatron-zb schedule {name}")
        if before_megatron_validation:
            if nvspr is not None:
                chunks = int(nvspr)
            elif nlpvs is not None and L is not None:
                per_rank = L // p
                chunks = per_rank // int(nlpvs) if per_rank % int(nlpvs) == 0 else 0
                if not chunks:
                    raise err(f"--num-layers-per-virtual-pipeline-stage {nlpvs} does not divide the {per_rank} "
                              "layers per pipeline rank")
            else:
                chunks = 0
        else:
            chunks = int(vpp or 1)
        if chunks < 2:
            raise err(f"schedule {name} runs several model chunks per rank (Megatron's virtual pipeline): add "
                      "--num-layers-per-virtual-pipeline-stage N or --num-virtual-stages-per-pipeline-rank V "
                      "(V >= 2)")
        if pad:
            raise err(f"--allow-padding-num-layers is not supported with {name} (looped placement); it works with "
                      "one chunk per rank and with V schedules")
        if p == 2 and getattr(args, "overlap_p2p_comm", True) is False:
            raise err("--no-overlap-p2p-communication: Megatron refuses a virtual pipeline at PP=2 without p2p "
                      "overlap; megatron-zb does its own pipeline communication, so drop the flag")
    else:  # single
        if nlpvs is not None or nvspr is not None or (vpp not in (None, 1)) or layout is not None:
            raise err(f"schedule {name} runs one model chunk per rank; drop --num-layers-per-virtual-pipeline-stage "
                      "/ --num-virtual-stages-per-pipeline-rank / --pipeline-model-parallel-layout (or pick "
                      "interleaved-1f1b, or a V schedule such as zb-v)")
        chunks = 1
        if L is not None and L % p and not pad and first is None and last is None \
                and not getattr(args, "account_for_embedding_in_pipeline_split", False) \
                and not getattr(args, "account_for_loss_in_pipeline_split", False):
            raise err(f"--num-layers {L} cannot be split evenly over {p} pipeline stages: use a multiple of {p}, "
                      f"or --allow-padding-num-layers with --num-layers = k x {p} - 2 (first and last stage one "
                      "layer less)")
        _apply_padding_single(args, before_megatron_validation, name=name)

    if style == "v" and p == 2 and getattr(args, "overlap_p2p_comm", True) is False:
        raise err("--no-overlap-p2p-communication: Megatron refuses a virtual pipeline at PP=2 without p2p overlap; "
                  "megatron-zb does its own pipeline communication, so drop the flag")

    # -- memory limit ------------------------------------------------------------------------------
    limit = None
    ours = getattr(args, "zero_bubble_memory_limit", None)
    pending = getattr(args, "zero_bubble_max_pending_backward", None)
    if ours is not None:
        value, unit = ours
        if unit == "microbatches":
            limit = value
        else:
            for need in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
                if getattr(args, need, None) is None:
                    raise err(f"--zero-bubble-memory-limit in {unit} needs --{need.replace('_', '-')}")
            limit = memory_limit_in_microbatches(value, args, gib=(unit == "GiB"))
            if limit < 1:
                raise err(f"--zero-bubble-memory-limit {value:g}{unit} holds {limit:.2f} microbatches of one stage's "
                          "activation; a pipeline needs at least 1")
    if pending is not None and pending != "auto" and style != "v":
        if limit is not None and abs(limit - pending) > 1e-9:
            raise err(f"--zero-bubble-memory-limit and --zero-bubble-max-pending-backward {pending} disagree; "
                      "give one")
        limit = float(pending)

    # -- profiling window --------------------------------------------------------------------------
    window = getattr(args, "zero_bubble_profile_window", None)
    ts = getattr(args, "zero_bubble_pipeline_timers_start_iter", None)
    te = getattr(args, "zero_bubble_pipeline_timers_end_iter", None)
    if ts is not None or te is not None:
        if window is not None:
            raise err("give either --zero-bubble-profile-window or the fork's --zero-bubble-pipeline-timers-*-iter")
        span = FORK_TIMERS_DEFAULT[1] - FORK_TIMERS_DEFAULT[0]
        start = ts if ts is not None else max(1, te - span)
        end = te if te is not None else start + span
        window = (start, end)
    if window is not None:
        start, end = int(window[0]), int(window[1])
        if start < 1 or end < start:
            raise err(f"profiling window {start}..{end}: need 1 <= START <= END (iterations counted from 1)")
        window = (start, end)

    kwargs: Dict[str, Any] = {"schedule": name, "chunks": chunks, "memory_limit": limit,
                              "timeout_s": float(getattr(args, "zero_bubble_timeout", None) or DEFAULT_TIMEOUT_S)}
    for opt in ("cost_f", "cost_b", "cost_w", "cost_comm", "mem_w"):
        v = getattr(args, f"zero_bubble_{opt}", None)
        if v is not None:
            kwargs[opt] = v
    if window is not None:
        kwargs["profile_window"] = window
        path = getattr(args, "zero_bubble_profile_path", None)
        if path is None:
            import os
            path = os.path.join(getattr(args, "save", None) or ".", "zero_bubble_profile.json")
        kwargs["profile_path"] = path
    elif getattr(args, "zero_bubble_profile_path", None):
        raise err("--zero-bubble-profile-path needs a profiling window (--zero-bubble-profile-window START END)")

    if getattr(args, "enable_optimizer_post_validation", False):
        for dest, flag in (("overlap_param_gather", "--overlap-param-gather"),
                           ("overlap_param_gather_with_optimizer_step", "--overlap-param-gather-with-optimizer-step"),
                           ("optimizer_cpu_offload", "--optimizer-cpu-offload"),
                           ("use_precision_aware_optimizer", "--use-precision-aware-optimizer"),
                           ("use_megatron_fsdp", "--use-megatron-fsdp")):
            if _given(args, dest):
                raise err(f"--enable-optimizer-post-validation cannot be combined with {flag}: the rollback needs "
                          "the optimizer step (and its parameter all-gather) whole on this rank")
        kwargs["post_validation"] = True
    elif _given(args, "zero_bubble_post_validation_min_clean_steps"):
        raise err("--zero-bubble-post-validation-min-clean-steps needs --enable-optimizer-post-validation")
    kwargs.update(_offload_kwargs(args, name=name, chunks=chunks, limit=limit))

    args.zero_bubble_resolved_schedule = name
    args.zero_bubble_placement = style
    args.zero_bubble_split_backward = bool(spec.split_backward)
    return kwargs


_OFFLOAD_DETAIL_FLAGS = (("--offload-time", "offload_time"), ("--auto-offload-time", "auto_offload_time"),
                         ("--offload-chunk-num", "offload_chunk_num"), ("--offload-overlap-sr", "offload_overlap_sr"),
                         ("--offload-continuous-buffers", "offload_continuous_buffers"),
                         ("--zero-bubble-offload-half-duplex", "zero_bubble_offload_half_duplex"),
                         ("--zero-bubble-offload-cpu-test", "zero_bubble_offload_cpu_test"))


def _offload_kwargs(args, *, name: Optional[str], chunks: int, limit: Optional[float]) -> Dict[str, Any]:
    """install() keyword arguments for activation offload (none when it is off); one clear error
    for a combination that cannot work."""
    err = ZeroBubbleArgumentError
    ratio = getattr(args, "zero_bubble_offload_ratio", None)
    on = bool(getattr(args, "cpu_offload", False)) or ratio is not None
    chunk_num = getattr(args, "offload_chunk_num", None)
    if not on:
        for flag, dest in _OFFLOAD_DETAIL_FLAGS:
            v = getattr(args, dest, None)
            if dest == "offload_chunk_num" and v == 0:
                continue  # the fork's default: nothing to do
            if v is not None and v is not False:
                raise err(f"{flag} needs activation offload: add --cpu-offload (or --zero-bubble-offload-ratio R)")
        return {}
    if name is None:
        return {}
    if getattr(args, "offload_time", None) is not None and getattr(args, "auto_offload_time", False):
        raise err("give either --offload-time K or --auto-offload-time (which measures K at start-up), not both")
    if getattr(args, "offload_overlap_sr", False) and getattr(args, "zero_bubble_offload_half_duplex", False):
        raise err("--offload-overlap-sr (separate copy streams) and --zero-bubble-offload-half-duplex (one stream) "
                  "contradict each other; give one")
    if chunk_num is not None and not (1 <= chunk_num <= max(1, chunks or 1)):
        raise err(f"--offload-chunk-num {chunk_num}: schedule {name} runs {chunks or 1} model chunk(s) per rank, so "
                  f"give 1..{chunks or 1} (or drop it to offload every chunk)")
    if ratio == "auto" and limit is None:
        raise err("--zero-bubble-offload-ratio auto offloads as little as fits the memory limit: add "
                  "--zero-bubble-memory-limit L")
    time = "auto" if getattr(args, "auto_offload_time", False) else getattr(args, "offload_time", None)
    return {"offload_ratio": 1.0 if ratio is None else ratio, "offload_time": 1.0 if time is None else time,
            "offload_overlap": not getattr(args, "zero_bubble_offload_half_duplex", False),
            "offload_chunks": chunk_num, "offload_cpu_test": bool(getattr(args, "zero_bubble_offload_cpu_test", False))}


def _apply_padding_single(args, before_megatron_validation, name):
    """--allow-padding-num-layers with one chunk per rank: Megatron's first/last stage layer counts."""
    if not getattr(args, "allow_padding_num_layers", False):
        return
    L = getattr(args, "num_layers", None)
    p = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    if L is None or p < 2 or L % p == 0:
        return  # nothing to pad
    err = ZeroBubbleArgumentError
    if getattr(args, "decoder_first_pipeline_num_layers", None) is not None or \
            getattr(args, "decoder_last_pipeline_num_layers", None) is not None:
        raise err("--allow-padding-num-layers sets the first and last stage's layer counts itself; drop "
                  "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers")
    if (L + 2) % p or (L + 2) // p < 2:
        raise err(f"--allow-padding-num-layers needs --num-layers = k x --pipeline-model-parallel-size - 2 "
                  f"(k >= 2; first and last stage one layer less), got {L} layers on {p} stages")
    if before_megatron_validation is False or (before_megatron_validation is None
                                               and hasattr(args, "virtual_pipeline_model_parallel_size")):
        raise err("--allow-padding-num-layers changes the model layout: it needs megatron-zb's entry point "
                  "(`python -m megatron_zb.megatron.pretrain_gpt`), or give Megatron's "
                  "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers yourself")
    k = (L + 2) // p
    args.decoder_first_pipeline_num_layers = k - 1
    args.decoder_last_pipeline_num_layers = k - 1


def preview_schedule(install_kwargs: Dict[str, Any], pipeline_size: int, num_microbatches: int):
    """Generate, validate and simulate the schedule ``install_kwargs`` describe (pure Python).

    Returns ``(result, baseline)``: the simulator's ``SimResult`` for the schedule and for 1F1B
    under the same costs (None if 1F1B cannot be simulated). Raises ``ZeroBubbleArgumentError``
    when the schedule cannot run (e.g. a memory limit below what it needs), so the entry point
    fails before training starts rather than at the first iteration.
    """
    from ..core.ir import Setting
    from ..core.simulate import simulate
    from ..core.validate import validate

    name = install_kwargs["schedule"]
    kw = dict(cost_f=install_kwargs.get("cost_f", 1.0), cost_b=install_kwargs.get("cost_b", 1.0),
              cost_w=install_kwargs.get("cost_w", 1.0), cost_comm=install_kwargs.get("cost_comm", 0.0))
    if install_kwargs.get("mem_w") is not None:
        kw["mem_w"] = [install_kwargs["mem_w"]]
    try:
        setting = Setting(int(pipeline_size), int(num_microbatches), chunks=install_kwargs.get("chunks"),
                          memory_limit=install_kwargs.get("memory_limit"), **kw)
        ratio = install_kwargs.get("offload_ratio")
        if ratio is not None:  # activation offload; an 'auto' K is measured at start-up: preview with 1
            from ..core.offload import OffloadOptions, generate_with_offload
            k = install_kwargs.get("offload_time", 1.0)
            opts = OffloadOptions(ratio=None if ratio == "auto" else float(ratio), time=1.0 if k == "auto" else float(k),
                                  overlap=install_kwargs.get("offload_overlap", True), chunks=install_kwargs.get("offload_chunks"),
                                  memory_limit=install_kwargs.get("memory_limit") if ratio == "auto" else None)
            sched = generate_with_offload(name, setting, opts)
            if k == "auto":  # the measured K decides what fits: do not refuse on the guess
                setting = dataclasses.replace(setting, memory_limit=None)
        else:
            sched = core_schedules.generate(name, setting)
        validate(sched, setting)
        result = simulate(sched, setting)
    except ScheduleError as e:
        raise ZeroBubbleArgumentError(f"schedule {name} with pipeline size {pipeline_size} and {num_microbatches} "
                                      f"microbatches: {e}") from None
    baseline = None
    try:
        base_setting = Setting(int(pipeline_size), int(num_microbatches), chunks=1, **kw)
        baseline = simulate(core_schedules.generate("1f1b", base_setting), base_setting)
    except ScheduleError:
        pass
    return result, baseline


# --------------------------------------------------------------------------------------------
# for a user's own Megatron-LM pretrain script (patches/megatron-lm-pretrain_gpt.patch)
# --------------------------------------------------------------------------------------------

def install_from_args(args):
    """Validate megatron-zb's flags on Megatron's parsed-and-validated ``args`` and install the schedule.

    For a Megatron-LM ``pretrain_gpt.py`` (0.18+) right after ``parse_and_validate_args``: returns the
    ``InstallHandle`` (None without zero-bubble flags). The model layout stays Megatron's, so V
    schedules and ``--allow-padding-num-layers`` are refused here with a pointer to megatron-zb's
    entry point. The schedule is generated once now (with Megatron's microbatch count), so an
    impossible memory limit fails before training.
    """
    kwargs = validate_zero_bubble_args(args, before_megatron_validation=False)
    if kwargs is None:
        return None
    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        preview_schedule(kwargs, int(args.pipeline_model_parallel_size), int(get_num_microbatches()))
    except (ImportError, AssertionError, AttributeError):
        pass  # no microbatch calculator yet: the schedule is checked at the first iteration
    from .install import install
    kwargs = dict(kwargs)
    return install(kwargs.pop("schedule"), **kwargs)


def install_on_first_use():
    """Install the schedule the flags select when Megatron's training loop first asks for one.

    For Megatron-LM scripts whose ``pretrain()`` parses the arguments itself (megatron-core <= 0.17:
    ``pretrain(..., extra_args_provider=chain_providers(..., add_zero_bubble_args))``): call this
    before ``pretrain()``. It wraps ``megatron.training.training.get_forward_backward_func``; the
    first call reads Megatron's global args, validates megatron-zb's flags and installs the schedule
    (or leaves Megatron's schedules when no zero-bubble flag was given). Returns a function that
    undoes the wrapping.
    """
    import megatron.training.training as T
    original = T.get_forward_backward_func
    state = {"handle": None, "done": False}

    def get_forward_backward_func(*a, **k):
        if not state["done"]:
            from megatron.training import get_args
            state["done"] = True
            state["handle"] = install_from_args(get_args())  # rebinds T.get_forward_backward_func
        current = T.get_forward_backward_func
        if current is get_forward_backward_func:
            return original(*a, **k)
        return current(*a, **k)
    get_forward_backward_func.__wrapped__ = original
    T.get_forward_backward_func = get_forward_backward_func

    def undo():
        if state["handle"] is not None:
            state["handle"].uninstall()
        if T.get_forward_backward_func is get_forward_backward_func:
            T.get_forward_backward_func = original
    return undo
