"""Megatron-style command-line flags for megatron-zb (``megatron.launch.flags`` validates them).

    from megatron_zb.megatron.launch.args import add_zero_bubble_args, chain_providers
    from megatron_zb.megatron.launch.flags import validate_zero_bubble_args

    provider = chain_providers(my_extra_args, add_zero_bubble_args)   # Megatron's extra_args_provider
    args = megatron.training.arguments.parse_args(extra_args_provider=provider)
    kwargs = validate_zero_bubble_args(args)        # None: no zero-bubble flag given
    ...                                              # Megatron's validate_args(args), set_global_variables(args)
    if kwargs: install(**kwargs)                     # megatron_zb.megatron.install (kwargs: ScheduleOptions)

Two families of flags, both accepted by ``add_zero_bubble_args``:

* **ours**: ``--zero-bubble-schedule NAME`` (any schedule of the core registry),
  ``--zero-bubble-memory-limit L`` (microbatches of activation, or ``<x>GB`` / ``<x>GiB``),
  ``--zero-bubble-search-effort full|quick``,
  ``--zero-bubble-timeout S``, ``--zero-bubble-profile-window START END``,
  ``--zero-bubble-profile-path FILE``, ``--zero-bubble-cost-f/-b/-w/-bw/-comm``, ``--zero-bubble-mem-w``,
  ``--zero-bubble-split-overhead-ms``, ``--zero-bubble-recompute-num-layers`` (recompute per model chunk),
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
import math
import re
from typing import Callable, Dict, Optional

from ...core import schedules as core_schedules
from ...core.ir import ScheduleError
from ...core.schedules.search.auto import EFFORTS as SEARCH_EFFORTS
from ..features.flags.balance import add_balance_args
from ..features.flags.recompute import add_recompute_args

__all__ = ["add_zero_bubble_args", "chain_providers", "has_flag", "zero_bubble_requested", "NOT_AVAILABLE_FLAGS", "WHAT_INSTEAD",
           "DEFAULT_TIMEOUT_S", "FORK_TIMERS_DEFAULT"]

DEFAULT_TIMEOUT_S = 300.0
FORK_TIMERS_DEFAULT = (100, 110)  # the fork's default profiling window, used when only one end is given


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
    from ...argtypes import number_list as _number_list
    parse_list = _number_list(flag)

    def parse(text):
        vals = parse_list(text)
        return vals[0] if len(vals) == 1 else vals
    return parse


def _split_overhead(text):
    """--zero-bubble-split-overhead-ms: milliseconds per layer, 0 <= x < 1000."""
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not (0.0 <= v < 1000.0):
        raise argparse.ArgumentTypeError(f"--zero-bubble-split-overhead-ms takes milliseconds per layer (0 to 1000), "
                                         f"got {text!r}")
    return v


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
    from ...argtypes import share_or_auto
    return share_or_auto(flag)


def parse_shares(text: str):
    """``--zero-bubble-optimizer-offload``: 'auto', one share 0..1 per pipeline rank (comma-separated),
    'trough', or 'trough:' followed by either ('trough' with each rank's own share): returns 'auto',
    a list, 'trough' or ('trough', 'auto' | list)."""
    t = str(text).strip().lower()
    if t.startswith("trough:"):
        return ("trough", parse_shares(t[len("trough:"):]))
    if t in ("auto", "trough"):
        return t
    try:
        out = [float(x) for x in t.split(",")]
    except ValueError:
        out = []
    if not out or not all(0.0 <= x <= 1.0 for x in out):
        raise ValueError(f"--zero-bubble-optimizer-offload takes 'auto', 'trough', 'trough:auto' or one share 0..1 per "
                         f"pipeline rank "
                         f"(comma-separated), got {text!r}")
    return out


def _optimizer_shares(text):
    try:
        return parse_shares(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _nonneg_float(flag):
    from ...argtypes import nonneg
    return nonneg(flag)


def _nonneg_int(flag):
    from ...argtypes import int_at_least
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

WHAT_INSTEAD = {
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

    Usable directly as Megatron's ``extra_args_provider``; returns the parser. Adding them to a
    parser that has them already (a chained provider and the drop-in route both) does nothing.
    """
    if has_flag(parser, "--zero-bubble-schedule"):
        return parser
    names = ", ".join(core_schedules.names())
    by_style = {style: ", ".join(n for n in core_schedules.names() if core_schedules.get(n).placement == style)
                for style in ("v", "looped", "bitpipe")}
    g = parser.add_argument_group("megatron-zb", "zero-bubble pipeline schedules (megatron-zb plugin)")
    g.add_argument("--zero-bubble-schedule", type=_schedule_name, default=None, metavar="NAME",
                   help=f"Run this megatron-zb pipeline schedule instead of Megatron's. One of: {names}. "
                        f"V schedules ({by_style['v']}) place 2 model chunks per rank in V order, "
                        f"{by_style['bitpipe']} 4 (two V's); {by_style['looped']} use Megatron's virtual pipeline "
                        "(--num-layers-per-virtual-pipeline-stage).")
    g.add_argument("--zero-bubble-memory-limit", type=_memory_limit, default=None, metavar="L",
                   help="Per-rank activation memory limit: a number of microbatches of one stage's "
                        "activation (1F1B needs the pipeline size), or a size with a GB/GiB suffix, converted "
                        "with Megatron's per-layer formula (see docs/training.md). zb-auto/v-auto search "
                        "under it; other schedules are refused if they need more.")
    g.add_argument("--zero-bubble-search-effort", choices=SEARCH_EFFORTS, default=None,
                   help="How hard zb-auto, zb-v, v-half, v-min and v-auto search, and how many ways the "
                        "vocabulary passes are placed: 'full' (default: every candidate family, the long local "
                        "search, eighteen placements) or 'quick' (a few times less start-up; the schedule "
                        "`megatron-zb plan` measured for a row marked ~, whose flags carry it).")
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
    g.add_argument("--zero-bubble-cost-bw", type=_cost("--zero-bubble-cost-bw"), default=None, metavar="T",
                   help="Relative time of one microbatch's fused backward (B and W in one pass) on a stage, where "
                        "splitting it costs more (default B + W). A B and its W that run back to back are then fused "
                        "where that delays no other pass.")
    g.add_argument("--zero-bubble-split-overhead-ms", type=_split_overhead, default=None, metavar="MS",
                   help="What splitting a backward into B and W adds per transformer layer, in ms, in the costs the "
                        "schedule is planned with (default 0; `megatron-zb plan` models 0.4, the GPU figures, and its "
                        "flags carry it). A B and its W that run back to back are then fused where that delays no "
                        "other pass.")
    g.add_argument("--zero-bubble-cost-comm", type=_cost("--zero-bubble-cost-comm"), default=None, metavar="T",
                   help="Relative time of one pipeline hop (default 0).")
    g.add_argument("--zero-bubble-cost-a2a", type=_cost("--zero-bubble-cost-a2a"), default=None, metavar="T",
                   help="MoE: relative time of one microbatch's expert-parallel all-to-all (dispatch + combine) in "
                        "an F, B or fused BW of a stage. With --overlap-moe-expert-parallel-comm the schedule core "
                        "pairs an F with a B wherever hiding it shortens the iteration (default with that flag: "
                        "half of F's cost); without it, charged serially (default 0).")
    g.add_argument("--zero-bubble-mem-w", type=float, default=None, metavar="RATIO",
                   help="What W still holds after B, as a fraction of what F keeps (default 0.5; with a GB "
                        "--zero-bubble-memory-limit from the model; above 1 with full recompute).")
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
    add_balance_args(g)  # variable-length batches (megatron.features.flags.balance)
    add_recompute_args(g)  # recompute per model chunk (megatron.features.flags.recompute)
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
    f.add_argument("--zero-bubble-optimizer-offload", type=_optimizer_shares, default=None,
                   metavar="S0,S1,...|auto|trough[:S0,S1,...|:auto]",
                   help="With --optimizer-cpu-offload: each pipeline rank's share of its optimizer states on the host "
                        "(one per rank, what `megatron-zb plan --optimizer-offload auto` prints; 'auto': from each "
                        "rank's own need under the GPU's memory) instead of Megatron's one "
                        "--optimizer-offload-fraction for all; 'trough': Megatron's share stays in host memory "
                        "between steps and its subgroups visit the GPU in each rank's memory trough (prefetched "
                        "after the rank's last passes, updated there, written back in the next warm-up) as the "
                        "core's trough plan says, the rest updated on the CPU; 'trough:S0,S1,...' / 'trough:auto': "
                        "the same with each rank's own share (what `megatron-zb plan --optimizer-offload trough` "
                        "prints) (docs/optimizer_offload.md)."),
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

    vp = parser.add_argument_group("megatron-zb: vocabulary parallelism (the VocabularyParallelism fork's flags)",
                                   "the output layer and loss spread over every pipeline rank (docs/vocab_parallel.md)")
    vp.add_argument("--enable-vocab-parallel", action="store_true", default=False,
                    help="Split the output layer (or the tied embedding's weight) along the vocabulary over all "
                         "pipeline ranks; its passes are placed by the schedule with all-reduce barriers beside the "
                         "compute. Alone it runs the fork's 1F1B; with --zero-bubble-schedule any family but bitpipe.")
    vp.add_argument("--disable-backward-fusion", action="store_true", default=False,
                    help="With --enable-vocab-parallel: the input gradient in its own pass after a second barrier "
                         "(the paper's Algorithm 1) instead of fused into the first (Algorithm 2).")
    vp.add_argument("--split-vocab-embedding", action="store_true", default=False,
                    help="With --enable-vocab-parallel: the input embedding split over the pipeline ranks too (each "
                         "looks up its rows, the sum reaches the first stage; the fork's split_vocab_embedding), so "
                         "the first stage's rank keeps no whole embedding (docs/vocab_parallel.md).")
    vp.add_argument("--use-interlaced-schedule", action="store_true", default=False,
                    help="The fork's interlaced baseline: not available in megatron-zb (its schedules place the "
                         "vocabulary passes themselves).")
    return parser


def has_flag(parser: argparse.ArgumentParser, flag: str) -> bool:
    """Whether ``parser`` already defines ``flag``."""
    return any(flag in a.option_strings for a in parser._actions)


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


def zero_bubble_requested(args) -> bool:
    """True if any flag selects a megatron-zb schedule."""
    return bool(getattr(args, "zero_bubble_schedule", None) or getattr(args, "enable_zero_bubble", False)
                or getattr(args, "zero_bubble_v_schedule", False))
