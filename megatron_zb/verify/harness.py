"""The verification harness: train a tiny real megatron-core GPT with a pipeline schedule and check it
against the non-pipelined single-process reference.

One launch of P x T CPU processes (gloo; see ``verify.launch``) runs, per case:

1. **Reference** (rank 0 only): PP=1, TP=1, full weights, megatron's
   ``forward_backward_no_pipelining``; ``iterations`` steps of plain SGD, recording the loss and
   every parameter's gradient (by global name) at every iteration.
2. **Pipelined run** (all ranks): megatron ``parallel_state`` for PP x TP, this rank's model
   chunks for the schedule's placement (``verify.tinygpt`` on ``megatron.placement``), identical initial weights (hashed
   from global parameter names) and identical data; the schedule is picked the way a Megatron
   user would get it: ``megatron_zb.megatron.install.install(schedule)`` and then megatron's own
   ``get_forward_backward_func()``. Gradients are gathered per global name (TP shards
   all-gathered, every copy of a tied weight included), then the same SGD step.

The parent compares per-iteration losses (absolute difference) and gradients (relative L2
difference per parameter, the worst over parameters, copies and iterations).

Pseudo-schedules that need no ``install()`` (useful to check this harness itself):

* ``megatron-1f1b``: megatron's ``forward_backward_pipelining_without_interleaving``.
* ``megatron-interleaved``: megatron's interleaved 1F1B (looped placement, ``chunks`` per rank,
  default 2). At PP=2 it sets ``overlap_p2p_comm=True, batch_p2p_comm=False`` unless told
  otherwise: megatron's default batched p2p silently corrupts gradients at PP=2 + VPP.
* ``sequential``: a deliberately naive pipelined executor for *any* placement (``placement=
  'single'|'looped'|'v'``): one microbatch at a time through every stage, forward then backward,
  real p2p between ranks. It checks model placement (e.g. V) independently of any schedule.

It never hangs: the launch has a timeout; a stuck rank is reported with its last status (the
pass it was in, as set through ``verify.launch.set_status``) and its Python stack.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["VerifyCase", "VerifyUsageError", "make_case", "run_verify", "run_verify_many", "compare",
           "PSEUDO_SCHEDULES", "DEFAULT_GRAD_RTOL", "DEFAULT_LOSS_ATOL", "SequentialForwardBackward"]

PSEUDO_SCHEDULES = ("megatron-1f1b", "megatron-interleaved", "sequential")
DEFAULT_GRAD_RTOL = 1e-5
DEFAULT_LOSS_ATOL = 1e-5
# optimizer cases, vs the non-pipelined reference: final parameters (L2 difference per parameter
# relative to max(its norm, init std x sqrt(size)); Adam turns last-bit gradient differences into
# small update differences), and for bf16/fp16
# (16-bit GEMMs accumulate in another order on another layout) looser defaults
DEFAULT_PARAM_RTOL = 1e-3
HALF_PARAM_RTOL = 0.1
HALF_LOSS_ATOL = 5e-3


class VerifyUsageError(ValueError):
    """Bad verify input (the CLI turns it into one line and exit code 2)."""


@dataclass
class VerifyCase:
    """Everything one verification needs; picklable, identical on every rank."""

    schedule: str
    pipeline_parallel_size: int
    tensor_parallel_size: int = 1
    num_microbatches: int = 4  # per data-parallel rank
    iterations: int = 3
    chunks: Optional[int] = None  # model chunks per rank (None: the schedule's default)
    placement: Optional[str] = None  # 'single' | 'looped' | 'v' (None: the schedule's)
    num_layers: Optional[int] = None  # default: a multiple of the stage count, >= 4
    layers_per_stage: Optional[List[int]] = None
    allow_padding_num_layers: bool = False
    hidden_size: int = 64
    num_attention_heads: int = 4
    vocab_size: int = 128
    seq_length: int = 32
    micro_batch_size: int = 2
    tie_embeddings: bool = True
    variable_seq_lengths: bool = False
    sequence_parallel: bool = False
    ddp: bool = True
    overlap_grad_reduce: bool = False
    gradient_accumulation_fusion: bool = False
    data_parallel_size: int = 1  # world = PP x TP x DP; the reference trains on all DP ranks' microbatches
    # megatron's DistributedOptimizer (ZeRO-1: gradients reduce-scattered, parameters all-gathered after
    # the step) instead of the harness's SGD; it only runs Adam, so both sides step with Adam (eps 1:
    # nearly linear in the gradient, so a wrong gradient still shows); the gradient shards are
    # gathered over data parallelism before the comparison
    use_distributed_optimizer: bool = False
    forward_only: bool = False
    lr: float = 0.1
    seed: int = 1234
    memory_limit: Optional[float] = None
    # activation offload (docs/offload.md), CPU test mode: ratio 0..1 or 'auto' (with memory_limit),
    # the transfer time K the schedule core plans with, one copy queue instead of two
    offload_ratio: Any = None
    offload_time: Any = 0.25  # or 'auto' (measured at the first iteration, --auto-offload-time)
    offload_half_duplex: bool = False
    schedule_options: Dict[str, Any] = field(default_factory=dict)  # passed to install()
    config_overrides: Dict[str, Any] = field(default_factory=dict)  # passed to TransformerConfig
    grad_rtol: float = DEFAULT_GRAD_RTOL
    loss_atol: float = DEFAULT_LOSS_ATOL
    label: Optional[str] = None
    # Megatron's optimizer instead of the plain SGD step (verify.optimizer_cases): 'adam' | 'sgd'
    optimizer: Optional[str] = None
    optimizer_lr: float = 1e-3
    clip_grad: float = 0.0
    bf16: bool = False
    fp16: bool = False
    # use_distributed_optimizer (above) selects Megatron's DistributedOptimizer for these cases too
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2.0 ** 12  # fp16's dynamic scaler starts here
    inject_nonfinite_at: Optional[int] = None  # iteration whose gradient gets an inf
    post_validation: bool = False  # also train with optimizer post-validation, compare bit for bit
    min_clean_steps: int = 0  # post-validation: synchronous steps until this many clean ones
    param_rtol: Optional[float] = None  # default DEFAULT_PARAM_RTOL (HALF_PARAM_RTOL for bf16/fp16)

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.tensor_parallel_size * self.data_parallel_size

    def model_config(self):
        from .tinygpt import TinyGPTConfig
        return TinyGPTConfig(num_layers=self.num_layers, hidden_size=self.hidden_size,
                             num_attention_heads=self.num_attention_heads, vocab_size=self.vocab_size,
                             seq_length=self.seq_length, micro_batch_size=self.micro_batch_size,
                             tie_embeddings=self.tie_embeddings, seed=self.seed,
                             variable_seq_lengths=self.variable_seq_lengths)

    def describe(self) -> str:
        bits = [self.schedule, f"PP={self.pipeline_parallel_size}", f"TP={self.tensor_parallel_size}",
                f"{self.placement} x{self.chunks}", f"M={self.num_microbatches}", f"L={self.num_layers}"]
        if self.data_parallel_size > 1:
            bits.insert(3, f"DP={self.data_parallel_size}")
        if self.use_distributed_optimizer:
            bits.append("distributed-optimizer")
        for k in ("sequence_parallel", "overlap_grad_reduce", "gradient_accumulation_fusion", "forward_only",
                  "variable_seq_lengths"):
            if getattr(self, k):
                bits.append(k)
        if self.offload_ratio is not None:
            bits.append(f"offload={self.offload_ratio} K={self.offload_time}"
                        + (" half-duplex" if self.offload_half_duplex else ""))
        if not self.ddp:
            bits.append("no-ddp")
        if not self.tie_embeddings:
            bits.append("untied")
        if self.config_overrides:
            bits.append(",".join(f"{k}={v}" for k, v in sorted(self.config_overrides.items())))
        if self.optimizer:
            bits.append(f"megatron-{self.optimizer}" + (" bf16" if self.bf16 else "") + (" fp16" if self.fp16 else "")
                        + (" dist-opt" if self.use_distributed_optimizer else "")
                        + (f" clip={self.clip_grad:g}" if self.clip_grad else "")
                        + (f" loss-scale={self.loss_scale:g}" if self.loss_scale is not None else "")
                        + (f" inf@{self.inject_nonfinite_at}" if self.inject_nonfinite_at is not None else "")
                        + (" post-validation" if self.post_validation else ""))
        return (self.label + ": " if self.label else "") + " ".join(bits)


def _schedule_placement(name: str, p: int, m: int, chunks: Optional[int]):
    """(style, chunks) of a core schedule, from the pure-Python schedule core."""
    from ..core import schedules as core_schedules
    from ..core.ir import ScheduleError, Setting
    try:
        spec = core_schedules.get(name)
        c = spec.resolve_chunks(chunks)
        sched = core_schedules.generate(name, Setting(stages=p, microbatches=m, chunks=c))
    except ScheduleError as e:
        raise VerifyUsageError(str(e)) from None
    pl = sched.placement
    style = pl.style
    if style not in ("single", "looped", "v", "bitpipe"):
        raise VerifyUsageError(f"schedule {name!r} uses a {style!r} placement, which the verifier cannot build")
    return style, pl.chunks


def make_case(schedule: str, pipeline_parallel_size: int, tensor_parallel_size: int = 1,
              num_microbatches: Optional[int] = None, iterations: int = 3, **options) -> VerifyCase:
    """Validate the input and fill in defaults. Raises ``VerifyUsageError`` on bad input."""
    names = {f.name for f in dataclasses.fields(VerifyCase)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise VerifyUsageError(f"unknown verify option(s): {', '.join(unknown)}")
    for nm, v in (("pipeline_parallel_size", pipeline_parallel_size), ("tensor_parallel_size", tensor_parallel_size),
                  ("iterations", iterations)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise VerifyUsageError(f"{nm} must be an integer >= 1, got {v!r}")
    p, t = pipeline_parallel_size, tensor_parallel_size
    if not isinstance(schedule, str) or not schedule:
        raise VerifyUsageError("a schedule name is required")
    chunks = options.pop("chunks", None)
    placement = options.pop("placement", None)
    m = num_microbatches if num_microbatches is not None else 2 * p
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise VerifyUsageError(f"num_microbatches must be an integer >= 1, got {m!r}")
    if schedule == "megatron-1f1b":
        if placement not in (None, "single") or chunks not in (None, 1):
            raise VerifyUsageError("megatron-1f1b uses one chunk per rank (single placement)")
        placement, chunks = "single", 1
        if p < 2:
            raise VerifyUsageError("megatron-1f1b needs --pipeline-parallel-size >= 2")
    elif schedule == "megatron-interleaved":
        if placement not in (None, "looped"):
            raise VerifyUsageError("megatron-interleaved uses the looped placement")
        placement, chunks = "looped", (2 if chunks is None else chunks)
        if p < 2 or chunks < 2:
            raise VerifyUsageError("megatron-interleaved needs --pipeline-parallel-size >= 2 and --chunks >= 2")
        if m % p:
            raise VerifyUsageError(f"megatron-interleaved needs num_microbatches divisible by the pipeline size "
                                   f"({m} % {p} != 0)")
    elif schedule == "sequential":
        placement = placement or "single"
        if placement not in ("single", "looped", "v"):
            raise VerifyUsageError(f"placement must be single, looped or v, got {placement!r}")
        if placement == "single":
            if chunks not in (None, 1):
                raise VerifyUsageError("the single placement has one chunk per rank")
            chunks = 1
        elif placement == "v":
            if chunks not in (None, 2):
                raise VerifyUsageError("the v placement has two chunks per rank")
            chunks = 2
        else:
            chunks = 2 if chunks is None else chunks
    else:
        if p < 2:  # install() hands PP=1 to Megatron's forward_backward_no_pipelining: nothing of ours runs
            raise VerifyUsageError(f"--pipeline-parallel-size 1 has no pipeline: schedule {schedule} would not run "
                                   "(Megatron's own no-pipelining function runs at PP=1); use -p 2 or more")
        style, c = _schedule_placement(schedule, p, m, chunks)
        if placement not in (None, style):
            raise VerifyUsageError(f"schedule {schedule!r} uses the {style!r} placement, not {placement!r}")
        placement, chunks = style, c
    if not isinstance(chunks, int) or chunks < 1:
        raise VerifyUsageError(f"chunks must be an integer >= 1, got {chunks!r}")
    stages = p * chunks
    num_layers = options.pop("num_layers", None)
    if num_layers is None:
        num_layers = stages * max(1, math.ceil(4 / stages))
    case = VerifyCase(schedule=schedule, pipeline_parallel_size=p, tensor_parallel_size=t, num_microbatches=m,
                      iterations=iterations, chunks=chunks, placement=placement, num_layers=num_layers, **options)
    from ..core.ir import ScheduleError
    from ..megatron import placement as _pl
    try:
        _pl.stage_layer_counts(case.num_layers, stages, layers_per_stage=case.layers_per_stage,
                              allow_padding_num_layers=case.allow_padding_num_layers)
    except ScheduleError as e:
        raise VerifyUsageError(str(e)) from None
    if case.hidden_size % case.num_attention_heads or case.num_attention_heads % t:
        raise VerifyUsageError("num_attention_heads must divide hidden_size and be divisible by the TP size")
    if case.vocab_size % t:
        raise VerifyUsageError("vocab_size must be divisible by the TP size")
    if case.sequence_parallel and t < 2:
        raise VerifyUsageError("sequence_parallel needs --tensor-parallel-size >= 2")
    if case.sequence_parallel and case.seq_length % t:
        raise VerifyUsageError("seq_length must be divisible by the TP size with sequence parallelism")
    if case.overlap_grad_reduce and not case.ddp:
        raise VerifyUsageError("overlap_grad_reduce needs ddp")
    if case.gradient_accumulation_fusion and not case.ddp:
        raise VerifyUsageError("gradient_accumulation_fusion needs ddp (it accumulates into main_grad)")
    if not isinstance(case.data_parallel_size, int) or isinstance(case.data_parallel_size, bool) \
            or case.data_parallel_size < 1:
        raise VerifyUsageError(f"data_parallel_size must be an integer >= 1, got {case.data_parallel_size!r}")
    if case.use_distributed_optimizer and not case.ddp:
        raise VerifyUsageError("use_distributed_optimizer needs ddp (megatron's DistributedOptimizer shards its buffers)")
    if case.use_distributed_optimizer and case.forward_only:
        raise VerifyUsageError("use_distributed_optimizer has no step to check with forward_only")
    if case.iterations < 1:
        raise VerifyUsageError("iterations must be >= 1")
    if case.offload_ratio is not None:
        r = case.offload_ratio
        if r != "auto" and not (isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r <= 1):
            raise VerifyUsageError(f"offload ratio must be a number in 0..1 or 'auto', got {r!r}")
        if r == "auto" and case.memory_limit is None:
            raise VerifyUsageError("--offload-ratio auto offloads as little as fits --memory-limit: give --memory-limit")
        if case.schedule in PSEUDO_SCHEDULES:
            raise VerifyUsageError(f"activation offload runs with megatron-zb schedules, not {case.schedule}")
        if case.offload_time != "auto" and not (isinstance(case.offload_time, (int, float)) and case.offload_time >= 0):
            raise VerifyUsageError(f"offload time must be a number >= 0 or 'auto', got {case.offload_time!r}")
    elif case.offload_half_duplex:
        raise VerifyUsageError("--offload-half-duplex needs --offload-ratio")
    _check_optimizer_options(case)
    return case


def _check_optimizer_options(case: VerifyCase) -> None:
    if case.post_validation and case.optimizer is None:
        case.optimizer = "adam"
    # --use-distributed-optimizer alone is the data-parallel Adam check (gradients compared); with
    # --optimizer it selects Megatron's DistributedOptimizer for the optimizer cases
    uses = ["--" + k.replace("_", "-") for k in ("bf16", "fp16", "clip_grad", "loss_scale") if getattr(case, k)]
    if case.inject_nonfinite_at is not None:
        uses.append("--inject-nonfinite-at")
    if case.optimizer is None:
        if uses:
            raise VerifyUsageError(f"{', '.join(uses)}: needs Megatron's optimizer: --optimizer adam|sgd "
                                   "(or --optimizer-post-validation)")
        return
    if case.optimizer not in ("adam", "sgd"):
        raise VerifyUsageError(f"optimizer must be adam or sgd, got {case.optimizer!r}")
    if case.schedule in PSEUDO_SCHEDULES and case.post_validation:
        raise VerifyUsageError("optimizer post-validation runs a megatron-zb schedule (through install()), "
                               f"not {case.schedule}")
    if case.pipeline_parallel_size < 2 and case.post_validation:
        raise VerifyUsageError("optimizer post-validation needs --pipeline-parallel-size >= 2")
    if not case.ddp:
        raise VerifyUsageError("Megatron's optimizer needs DDP-wrapped chunks (drop --no-ddp)")
    if case.forward_only:
        raise VerifyUsageError("--forward-only trains nothing: no optimizer")
    if case.bf16 and case.fp16:
        raise VerifyUsageError("--bf16 and --fp16 are exclusive")
    half = case.bf16 or case.fp16
    if case.param_rtol is None:
        case.param_rtol = HALF_PARAM_RTOL if half else DEFAULT_PARAM_RTOL
    if half and case.loss_atol == DEFAULT_LOSS_ATOL:
        case.loss_atol = HALF_LOSS_ATOL
    if case.clip_grad < 0 or not math.isfinite(case.clip_grad):
        raise VerifyUsageError(f"--clip-grad must be a number >= 0, got {case.clip_grad}")
    if case.inject_nonfinite_at is not None:
        if not 0 <= case.inject_nonfinite_at < case.iterations:
            raise VerifyUsageError(f"--inject-nonfinite-at must be an iteration 0..{case.iterations - 1}, "
                                   f"got {case.inject_nonfinite_at}")
        if not case.fp16 and case.loss_scale is None:
            if not (case.bf16 or case.use_distributed_optimizer):
                raise VerifyUsageError("Megatron's FP32Optimizer never checks gradients for inf/NaN (a NaN "
                                       "would enter the weights): inject a non-finite gradient with --fp16, "
                                       "or with --bf16 / --use-distributed-optimizer and a loss scale")
            case.loss_scale = 1.0  # a constant scaler of 1: Megatron then checks and skips, numerics unchanged


# --------------------------------------------------------------------------------------------
# public entry points (parent process)
# --------------------------------------------------------------------------------------------

def run_verify(schedule: str, pipeline_parallel_size: int, tensor_parallel_size: int = 1,
               num_microbatches: Optional[int] = None, iterations: int = 3, *, timeout: float = 300.0,
               mcore_path: Optional[str] = None, **options) -> dict:
    """Verify one schedule; returns the result dict (``passed``, ``max_rel_grad_diff``,
    ``max_abs_loss_diff``, ``schedule``, ``losses``, ``reference_losses``, ``timing``, ...).

    Raises ``VerifyUsageError`` on bad input. A crash or a hang in a rank gives ``passed: False``
    and ``error`` (the rank, its traceback or last status).
    """
    case = make_case(schedule, pipeline_parallel_size, tensor_parallel_size, num_microbatches, iterations, **options)
    return run_verify_many([case], timeout=timeout, mcore_path=mcore_path)[0]


def run_verify_many(cases: Sequence[VerifyCase], *, timeout: float = 600.0, mcore_path: Optional[str] = None,
                    raise_errors: bool = False) -> List[dict]:
    """Run several cases (same P x T) in one launch, paying process start and imports once."""
    from . import launch as L
    cases = list(cases)
    if not cases:
        return []
    ws = {c.world_size for c in cases}
    if len(ws) != 1:
        raise VerifyUsageError(f"cases in one launch need the same P x T x DP, got world sizes {sorted(ws)}")
    t0 = time.time()
    if any(c.schedule not in PSEUDO_SCHEDULES for c in cases) and not _install_importable():
        err = RuntimeError("megatron-zb schedules are run through megatron_zb.megatron.install, which is not "
                           "available in this checkout; the pseudo-schedules " + ", ".join(PSEUDO_SCHEDULES) +
                           " work without it")
        if raise_errors:
            raise err
        return [_error_result(c, err, 0.0) for c in cases]
    try:
        references = _optimizer_references(cases, timeout, mcore_path)
        per_case = L.run_cases(_rank_case, cases, ws.pop(), timeout=timeout, mcore_path=mcore_path)
    except L.LaunchError as e:
        if raise_errors:
            raise
        wall = time.time() - t0
        return [_error_result(c, e, wall) for c in cases]
    wall = time.time() - t0
    out = []
    for c, ranks in zip(cases, per_case):
        if c.optimizer is not None:
            ranks[0]["reference"] = references[_reference_key(c)]
        r = compare(c, ranks)
        r["timing"]["launch_wall_s"] = round(wall, 3)
        out.append(r)
    return out


def _optimizer_references(cases, timeout, mcore_path) -> Dict[tuple, dict]:
    """The non-pipelined references of the optimizer cases: one launch of world size 1."""
    from . import launch as L
    from .optimizer_cases import reference_case
    todo = {}
    for c in cases:
        if c.optimizer is not None:
            todo.setdefault(_reference_key(c), c)
    if not todo:
        return {}
    keys = list(todo)
    results = L.run_cases(reference_case, [todo[k] for k in keys], 1, timeout=timeout, mcore_path=mcore_path)
    return {k: r[0] for k, r in zip(keys, results)}


def _install_importable() -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec("megatron_zb.megatron.install") is not None
    except (ImportError, ValueError):
        return False


def _error_result(case: VerifyCase, err: Exception, wall: float) -> dict:
    return {"passed": False, "schedule": case.schedule, "error": str(err), "error_type": type(err).__name__,
            "losses": [], "reference_losses": [], "max_rel_grad_diff": None, "max_abs_loss_diff": None,
            "pipeline_parallel_size": case.pipeline_parallel_size,
            "tensor_parallel_size": case.tensor_parallel_size, "num_microbatches": case.num_microbatches,
            "iterations": case.iterations, "chunks": case.chunks, "placement": case.placement,
            "case": case.describe(), "timing": {"launch_wall_s": round(wall, 3)}}


# --------------------------------------------------------------------------------------------
# comparison (parent)
# --------------------------------------------------------------------------------------------

def _rel(a, b) -> float:
    import torch
    a = a.double()
    b = b.double()
    if a.shape != b.shape:
        return math.inf
    dn = float((a - b).norm())
    rn = float(b.norm())
    if dn == 0.0:
        return 0.0
    return dn / rn if rn > 0 else math.inf


def compare(case: VerifyCase, ranks: List[dict]) -> dict:
    """Compare the pipelined ranks' results with the reference (rank 0 carries it)."""
    if case.optimizer is not None:
        return _compare_optimizer(case, ranks)
    ref = ranks[0]["reference"]
    problems: List[str] = []
    loss_reports = [r for r in ranks if r.get("losses") is not None]
    if len(loss_reports) != case.data_parallel_size:
        problems.append(f"expected exactly {case.data_parallel_size} rank(s) to report losses (one per data-parallel "
                        f"replica), got {len(loss_reports)}")
    if len(loss_reports) == 1:
        losses = loss_reports[0]["losses"]
    else:  # data parallel: the per-token loss over every replica's microbatches
        losses = []
        for it in range(case.iterations):
            parts = [r["loss_parts"][it] for r in loss_reports if it < len(r.get("loss_parts") or [])]
            n = sum(x[1] for x in parts)
            losses.append(sum(x[0] for x in parts) / n if parts and n else None)
    for it, bad in _replica_mismatches(ranks, case):
        problems.append(f"iteration {it}: copies of {bad[:3]} differ after the step (replicas must stay bit-identical)")
    per_iter = []
    max_loss = 0.0
    max_grad = 0.0
    worst = None
    for it in range(case.iterations):
        row = {"iteration": it, "reference_loss": ref["losses"][it]}
        lo = losses[it] if it < len(losses) else None
        row["loss"] = lo
        if lo is None or ref["losses"][it] is None:
            problems.append(f"iteration {it}: missing loss")
            d = math.inf
        else:
            d = abs(lo - ref["losses"][it])
        row["abs_loss_diff"] = d
        max_loss = max(max_loss, d)
        if not case.forward_only:
            merged: Dict[str, list] = {}
            for r in ranks:
                for name, copies in r["grads"][it].items():
                    merged.setdefault(name, []).extend((r["rank"], t) for t in copies)
            rg = ref["grads"][it]
            missing = sorted(set(rg) - set(merged))
            extra = sorted(set(merged) - set(rg))
            if missing:
                problems.append(f"iteration {it}: no pipelined gradient for {missing[:5]}")
            if extra:
                problems.append(f"iteration {it}: unexpected pipelined parameters {extra[:5]}")
            it_max = 0.0
            for name, copies in merged.items():
                if name not in rg:
                    continue
                for rank, t in copies:
                    e = _rel(t, rg[name][0])
                    if e > it_max:
                        it_max = e
                    if e > max_grad or worst is None:
                        if e >= max_grad:
                            max_grad = e
                            worst = {"param": name, "rank": rank, "iteration": it, "rel_diff": e}
            row["max_rel_grad_diff"] = it_max
        per_iter.append(row)
    passed = not problems and max_loss <= case.loss_atol and (case.forward_only or max_grad <= case.grad_rtol)
    times = [r["times"] for r in ranks if r.get("times")]
    iter_ms = [max(ts[i] for ts in times) * 1e3 for i in range(len(times[0]))] if times else []
    res = {
        "passed": bool(passed),
        "schedule": case.schedule,
        "pipeline_parallel_size": case.pipeline_parallel_size,
        "tensor_parallel_size": case.tensor_parallel_size,
        "num_microbatches": case.num_microbatches,
        "iterations": case.iterations,
        "chunks": case.chunks,
        "placement": case.placement,
        "num_layers": case.num_layers,
        "losses": losses,
        "reference_losses": ref["losses"],
        "max_abs_loss_diff": _finite(max_loss),
        "max_rel_grad_diff": None if case.forward_only else _finite(max_grad),
        "worst_param": worst,
        "grad_rtol": case.grad_rtol,
        "loss_atol": case.loss_atol,
        "forward_only": case.forward_only,
        "per_iteration": [{k: _finite(v) if isinstance(v, float) else v for k, v in row.items()} for row in per_iter],
        "problems": problems,
        **_offload_report(ranks),
        "megatron_core": ranks[0].get("megatron_version"),
        "case": case.describe(),
        "timing": {
            "iteration_ms": [round(x, 3) for x in iter_ms],
            "median_iteration_ms": round(_median(iter_ms[1:] or iter_ms), 3) if iter_ms else None,
            "reference_iteration_ms": [round(x * 1e3, 3) for x in ref.get("times", [])],
            "reference_median_iteration_ms": round(_median([x * 1e3 for x in ref["times"]][1:] or
                                                           [x * 1e3 for x in ref["times"]]), 3)
            if ref.get("times") else None,
            "rank_wall_s": round(max(r.get("wall_s", 0.0) for r in ranks), 3),
        },
    }
    return res


def _replica_mismatches(ranks: List[dict], case: "VerifyCase") -> List[tuple]:
    """(iteration, names) where copies of a parameter (replicas, tied embeddings, data-parallel
    copies) differ in any bit after the step; only where the ranks collected parameters."""
    out = []
    for it in range(case.iterations):
        copies: Dict[str, list] = {}
        for r in ranks:
            params = r.get("params") or []
            for name, ts in (params[it] if it < len(params) else {}).items():
                copies.setdefault(name, []).extend(ts)
        bad = sorted(n for n, ts in copies.items() if any(not _equal(ts[0], t) for t in ts[1:]))
        if bad:
            out.append((it, bad))
    return out


def _equal(a, b) -> bool:
    import torch
    return a.shape == b.shape and bool(torch.equal(a, b))


def _offload_report(ranks: List[dict]) -> dict:
    """``offload``: per rank, the offload manager's counts of every iteration (absent without)."""
    if not any(r.get("offload") for r in ranks):
        return {}
    return {"offload": [{"rank": r["rank"], "pp_rank": r.get("pp_rank"), "tp_rank": r.get("tp_rank"),
                         "iterations": r.get("offload") or []} for r in ranks]}


def _compare_optimizer(case: VerifyCase, ranks: List[dict]) -> dict:
    from .optimizer_cases import compare_optimizer_case
    ref = ranks[0]["reference"]
    o = compare_optimizer_case(case, ranks, ref)
    problems = o.pop("problems_optimizer")
    passed = o.pop("passed_optimizer")
    times = [r["runs"]["post-validated" if case.post_validation else "synchronous"]["times"] for r in ranks]
    iter_ms = [max(ts[i] for ts in times) * 1e3 for i in range(len(times[0]))] if times and times[0] else []
    sync_times = [r["runs"]["synchronous"]["times"] for r in ranks]
    sync_ms = [max(ts[i] for ts in sync_times) * 1e3 for i in range(len(sync_times[0]))] if sync_times else []
    per_iter = []
    for it in range(case.iterations):
        lo = o["losses"][it] if it < len(o["losses"]) else None
        rl = o["reference_losses"][it]
        per_iter.append({"iteration": it, "loss": lo, "reference_loss": rl,
                         "abs_loss_diff": _finite(abs(lo - rl)) if lo is not None else None,
                         "skipped": not ref["steps"][it][0], "reference_grad_norm": ref["steps"][it][1]})
    res = {
        "passed": bool(passed), "schedule": case.schedule, "pipeline_parallel_size": case.pipeline_parallel_size,
        "tensor_parallel_size": case.tensor_parallel_size, "num_microbatches": case.num_microbatches,
        "iterations": case.iterations, "chunks": case.chunks, "placement": case.placement,
        "num_layers": case.num_layers, "grad_rtol": case.grad_rtol, "loss_atol": case.loss_atol,
        "param_rtol": case.param_rtol, "forward_only": False, "per_iteration": per_iter, "problems": problems,
        "megatron_core": ranks[0].get("megatron_version"), "case": case.describe(),
        "timing": {"iteration_ms": [round(x, 3) for x in iter_ms],
                   "median_iteration_ms": round(_median(iter_ms[1:] or iter_ms), 3) if iter_ms else None,
                   "synchronous_median_iteration_ms": round(_median(sync_ms[1:] or sync_ms), 3) if sync_ms else None,
                   "rank_wall_s": round(max(r.get("wall_s", 0.0) for r in ranks), 3)},
    }
    for k, v in o.items():
        res[k] = _finite(v) if isinstance(v, float) else v
    return res


def _finite(x):
    if x is None:
        return None
    return x if math.isfinite(x) else float("inf")


def _median(xs):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


# --------------------------------------------------------------------------------------------
# rank side
# --------------------------------------------------------------------------------------------

_REFERENCE_CACHE: Dict[tuple, dict] = {}


# config overrides that only change how the pipeline runs (not the math) stay off the reference
_PIPELINE_ONLY_KEYS = ("p2p", "pipeline", "overlap", "sequence_parallel", "tensor_model", "virtual", "deallocate",
                       "microbatch", "variable_seq", "fusion", "recompute", "offload", "defer", "wgrad",
                       "timers", "barrier", "moe_token_dispatcher")


def _reference_overrides(case: VerifyCase) -> dict:
    return {k: v for k, v in case.config_overrides.items() if not any(b in k for b in _PIPELINE_ONLY_KEYS)}


def _reference_key(case: VerifyCase) -> tuple:
    opt = (case.optimizer, case.optimizer_lr, case.clip_grad, case.bf16, case.fp16, case.use_distributed_optimizer,
           case.loss_scale, case.initial_loss_scale, case.inject_nonfinite_at)
    return (json.dumps(case.model_config().to_dict(), sort_keys=True), case.num_microbatches * case.data_parallel_size,
            case.iterations, case.lr, case.forward_only, case.use_distributed_optimizer,
            repr(sorted(_reference_overrides(case).items())), opt if case.optimizer else None)


def _reference_finalize(model, num_tokens=None, *args, **kwargs) -> None:
    """The reference's finalize: only the per-token-loss scaling (one process, one replica)."""
    if num_tokens is not None and int(num_tokens) > 0:
        for m in model:
            for p in m.parameters():
                if p.grad is not None:
                    p.grad.mul_(1.0 / num_tokens)


def _run_reference(case: VerifyCase) -> dict:
    """PP=1, TP=1, full model on this process; megatron's forward_backward_no_pipelining."""
    import torch
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from . import tinygpt as M
    from .launch import set_status
    cfg = case.model_config()
    ref = M.build_reference_model(cfg, **_reference_overrides(case))
    ref.config.finalize_model_grads_func = _reference_finalize
    losses, grads, params, times = [], [], [], []
    m = case.num_microbatches * case.data_parallel_size  # every data-parallel replica's microbatches
    for it in range(case.iterations):
        set_status(f"reference: iteration {it}")
        M.zero_grads_([ref])
        batches = M.make_batches(cfg, m, it)
        t0 = time.perf_counter()
        out = forward_backward_no_pipelining(
            forward_step_func=M.forward_step_func, data_iterator=iter(batches), model=ref,
            num_microbatches=m, seq_length=cfg.seq_length,
            micro_batch_size=cfg.micro_batch_size, decoder_seq_length=cfg.seq_length,
            forward_only=case.forward_only)
        times.append(time.perf_counter() - t0)
        losses.append(M.iteration_loss(out))
        if not case.forward_only:
            grads.append(M.collect_full_grads([ref]))
            if case.use_distributed_optimizer:
                if it == 0:
                    adam = torch.optim.AdamW(ref.parameters(), **_ADAM)
                adam.step()
            else:
                M.sgd_step_([ref], case.lr)
        else:
            grads.append({})
    del ref
    return {"losses": losses, "grads": grads, "times": times}


def _rank_case(case: VerifyCase) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ..megatron import placement as _pl
    from . import tinygpt as M
    from .launch import set_status

    t_start = time.perf_counter()
    rank = dist.get_rank()
    tag = case.describe()
    # DDP's per-bucket parameter lists (INFO once megatron.training configured logging) would fill
    # the rank logs that a failure or a timeout quotes
    logging.getLogger("megatron.core.distributed").setLevel(logging.WARNING)
    # 1. the reference, on rank 0 (cached per launch for identical model/data)
    if case.optimizer is not None:
        return _rank_optimizer_case(case, t_start)
    set_status(f"[{tag}] reference: setting up")
    M.init_parallel_state(1, 1, seed=case.seed)
    reference = None
    if rank == 0:
        key = _reference_key(case)
        if key not in _REFERENCE_CACHE:
            _REFERENCE_CACHE[key] = _run_reference(case)
        reference = _REFERENCE_CACHE[key]
    # 2. the pipelined run
    set_status(f"[{tag}] pipelined: initialising parallel state (other ranks may still run the reference)")
    placement = _pl.make_placement(case.placement, case.pipeline_parallel_size, case.chunks)
    M.init_parallel_state(case.tensor_parallel_size, case.pipeline_parallel_size, placement, seed=case.seed)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    cfg = case.model_config()
    handle = None
    try:
        overrides = dict(case.config_overrides)
        if case.schedule == "megatron-interleaved" and case.pipeline_parallel_size == 2:
            # megatron's batched p2p at PP=2 + VPP pairs the two same-peer sends ambiguously
            overrides.setdefault("overlap_p2p_comm", True)
            overrides.setdefault("batch_p2p_comm", False)
        if case.schedule not in PSEUDO_SCHEDULES:
            set_status(f"[{tag}] installing schedule {case.schedule}")
            handle = _install(case)
        set_status(f"[{tag}] building model chunks")
        chunks = M.build_model_chunks(cfg, placement, layers_per_stage=case.layers_per_stage,
                                      allow_padding_num_layers=case.allow_padding_num_layers,
                                      sequence_parallel=case.sequence_parallel,
                                      gradient_accumulation_fusion=case.gradient_accumulation_fusion, **overrides)
        config = chunks[0].config
        if case.ddp:
            chunks = M.wrap_ddp(chunks, overlap_grad_reduce=case.overlap_grad_reduce,
                                use_distributed_optimizer=case.use_distributed_optimizer)
        _pl.configure_grad_sync(config, chunks, placement=placement, ddp=case.ddp,
                              overlap_grad_reduce=case.overlap_grad_reduce)
        optimizer = _distributed_adam(chunks) if case.use_distributed_optimizer else None
        fb = _forward_backward_func(case, placement)
        infos = [_pl.unwrap(c).mzb_chunk_info for c in chunks]
        holds_last = pp_rank == placement.loss_rank  # replicated stages: the loss rank gets every path's losses
        dp_rank = parallel_state.get_data_parallel_rank()
        keep_params = placement.replicated
        losses, loss_parts, grads, params, times, offload = [], [], [], [], [], []
        m = case.num_microbatches
        for it in range(case.iterations):
            set_status(f"[{tag}] pipelined: iteration {it} forward-backward")
            M.zero_grads_(chunks)
            if optimizer is not None:
                optimizer.zero_grad()
            batches = M.make_batches(cfg, m * case.data_parallel_size, it)[dp_rank * m:(dp_rank + 1) * m]
            iters = M.batch_iterators(batches, len(chunks))
            dist.barrier()  # time the schedule, not the ranks' skew
            t0 = time.perf_counter()
            out = fb(forward_step_func=M.forward_step_func, data_iterator=iters, model=list(chunks),
                     num_microbatches=case.num_microbatches, seq_length=cfg.seq_length,
                     micro_batch_size=cfg.micro_batch_size, decoder_seq_length=cfg.seq_length,
                     forward_only=case.forward_only)
            times.append(time.perf_counter() - t0)
            stats = getattr(getattr(handle, "forward_backward", None), "offload_stats", None)
            if stats is not None:
                offload.append(dict(stats))
            if holds_last and tp_rank == 0:
                losses.append(M.iteration_loss(out))
                loss_parts.append(M.iteration_loss_parts(out))
            if not case.forward_only:
                set_status(f"[{tag}] pipelined: iteration {it} gathering gradients")
                if optimizer is not None:
                    _gather_grad_shards(chunks)
                grads.append(M.collect_full_grads(chunks))
                if optimizer is not None:
                    ok, _, _ = optimizer.step()
                    if not ok:
                        raise RuntimeError(f"megatron's optimizer step failed at iteration {it}")
                else:
                    M.sgd_step_(chunks, case.lr)
                params.append(M.collect_full_grads(chunks, params=True) if keep_params else {})
            else:
                grads.append({})
                params.append({})
    finally:
        if handle is not None:
            handle.uninstall()
    set_status(f"[{tag}] done")
    reports = holds_last and tp_rank == 0
    return {"rank": rank, "pp_rank": pp_rank, "tp_rank": tp_rank, "dp_rank": dp_rank, "reference": reference,
            "losses": losses if reports else None, "loss_parts": loss_parts if reports else None,
            "grads": grads, "params": params, "times": times,
            "wall_s": time.perf_counter() - t_start, "megatron_version": M.megatron_version(), "offload": offload,
            "stages": [i.stage for i in infos], "layers": [list(i.layers) for i in infos]}


# Adam for the distributed-optimizer cases (the reference runs torch's AdamW, megatron's Adam on a CPU)
_ADAM = dict(lr=0.01, betas=(0.9, 0.999), eps=1.0, weight_decay=0.0)


def _distributed_adam(chunks):
    """megatron's DistributedOptimizer (Adam, no weight decay or clipping) over the DDP chunks."""
    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    ocfg = OptimizerConfig(optimizer="adam", lr=_ADAM["lr"], min_lr=_ADAM["lr"], weight_decay=0.0,
                           adam_beta1=_ADAM["betas"][0], adam_beta2=_ADAM["betas"][1], adam_eps=_ADAM["eps"],
                           clip_grad=0.0, use_distributed_optimizer=True, bf16=False, fp16=False,
                           params_dtype=torch.float32)
    return get_megatron_optimizer(ocfg, list(chunks), use_gloo_process_groups=False)


def _gather_grad_shards(chunks) -> None:
    """After a reduce-scatter each data-parallel rank holds only its shard of every bucket reduced:
    zero the rest and sum over data parallelism, so every rank holds the whole reduced gradient
    (its own shard is unchanged, which is all the optimizer reads)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    group = parallel_state.get_data_parallel_group()
    d, n = dist.get_rank(group), dist.get_world_size(group)
    for c in chunks:
        for buf in list(getattr(c, "buffers", [])) + list(getattr(c, "expert_parallel_buffers", [])):
            for bucket in buf.buckets:
                g = bucket.grad_data
                size = g.numel() // n
                g[:d * size].zero_()
                g[(d + 1) * size:].zero_()
                dist.all_reduce(g, group=group)


def _install(case: VerifyCase, **extra):
    try:
        from ..megatron.install import install
    except ImportError as e:
        raise RuntimeError(f"schedule {case.schedule!r} needs megatron_zb.megatron.install, which is not "
                           f"available ({e}); the pseudo-schedules {', '.join(PSEUDO_SCHEDULES)} work without it")
    kw = dict(case.schedule_options)
    if case.offload_ratio is not None:
        kw.update(offload_ratio=case.offload_ratio, offload_time=case.offload_time,
                  offload_overlap=not case.offload_half_duplex, offload_cpu_test=True)
    kw.update(extra)
    return install(case.schedule, chunks=case.chunks, memory_limit=case.memory_limit, **kw)


def _rank_optimizer_case(case: VerifyCase, t_start: float) -> dict:
    """An optimizer case on this rank: the synchronous and (optionally) post-validated runs."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ..megatron import placement as _pl
    from . import tinygpt as M
    from .launch import set_status
    from .optimizer_cases import rank_runs
    logging.getLogger("megatron.core.distributed").setLevel(logging.WARNING)
    logging.getLogger("megatron.core.optimizer").setLevel(logging.WARNING)
    placement = _pl.make_placement(case.placement, case.pipeline_parallel_size, case.chunks)

    def install_fn(c, post_validation):
        if c.schedule in PSEUDO_SCHEDULES:
            return None
        return _install(c, **({"post_validation": True} if post_validation else {}))
    runs = rank_runs(case, placement, install_fn, _forward_backward_func)
    set_status(f"[{case.describe()}] done")
    return {"rank": dist.get_rank(), "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(), "reference": None, "runs": runs,
            "wall_s": time.perf_counter() - t_start, "megatron_version": M.megatron_version()}


def _forward_backward_func(case: VerifyCase, placement):
    from megatron.core.pipeline_parallel import schedules as S
    if case.schedule == "megatron-1f1b":
        return S.forward_backward_pipelining_without_interleaving
    if case.schedule == "megatron-interleaved":
        return S.forward_backward_pipelining_with_interleaving
    if case.schedule == "sequential":
        return SequentialForwardBackward(placement)
    import megatron.core.pipeline_parallel as mpp
    return mpp.get_forward_backward_func()


class SequentialForwardBackward:
    """A naive, obviously-correct pipelined forward-backward for any placement.

    Megatron's forward-backward signature. Microbatch by microbatch: the forward through stages
    0..S-1 (activations sent to the next stage's rank, or handed over locally), the loss, then
    the backward through S-1..0. Deadlock-free because every rank walks the same stage order.
    Used to check model placement (e.g. V) independently of any real schedule.
    """

    def __init__(self, placement):
        self.placement = placement

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches, seq_length=None,
                 micro_batch_size=None, decoder_seq_length=None, forward_only=False, collect_non_loss_data=False,
                 first_val_step=None, **_ignored):
        import contextlib

        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.utils import get_attr_wrapped_model, get_model_config
        from .launch import set_status

        chunks = model if isinstance(model, list) else [model]
        iters = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        config = get_model_config(chunks[0])
        pl = self.placement
        S = pl.num_stages
        pp_ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
        me = parallel_state.get_pipeline_model_parallel_rank()
        mine = {s: i for i, s in enumerate(pl.stages_of(me))}
        store = []
        total_tokens = torch.zeros([], dtype=torch.int)

        def send(t, to_stage, what):
            dst = pl.rank_of(to_stage)
            set_status(f"sequential: send {what} to stage {to_stage} on pp rank {dst}")
            shape = torch.tensor(list(t.shape), dtype=torch.int64)
            dist.send(shape, pp_ranks[dst])
            dist.send(t.detach().contiguous(), pp_ranks[dst])

        def recv(from_stage, what):
            src = pl.rank_of(from_stage)
            set_status(f"sequential: wait for {what} from stage {from_stage} on pp rank {src}")
            shape = torch.zeros(3, dtype=torch.int64)
            dist.recv(shape, pp_ranks[src])
            t = torch.empty(tuple(int(x) for x in shape), dtype=config.pipeline_dtype)
            dist.recv(t, pp_ranks[src])
            return t

        no_sync = config.no_sync_func
        if isinstance(no_sync, list):
            ctxs = [f() for f in no_sync]
        elif no_sync is not None:
            ctxs = [no_sync()]
        else:
            ctxs = []
        with contextlib.ExitStack() as stack:
            for c in ctxs:
                stack.enter_context(c)
            for mb in range(num_microbatches):
                inputs, outputs = {}, {}
                local = None
                for s in range(S):
                    owner = pl.rank_of(s)
                    if owner != me:
                        if s > 0 and pl.rank_of(s - 1) == me:
                            send(local, s, f"activation of mb {mb}")
                        continue
                    if s == 0:
                        x = None
                    elif pl.rank_of(s - 1) == me:
                        x = local.detach().requires_grad_(not forward_only)
                    else:
                        x = recv(s - 1, f"activation of mb {mb}").requires_grad_(not forward_only)
                    m = chunks[mine[s]]
                    set_status(f"sequential: F stage {s} mb {mb}")
                    get_attr_wrapped_model(m, "set_input_tensor")(x)
                    with (torch.no_grad() if forward_only else contextlib.nullcontext()):
                        out, loss_fn = forward_step_func(iters[mine[s]], m)
                        if s == S - 1:
                            sum_loss, ntok, report = loss_fn(out)
                            total_tokens += ntok.to(torch.int)
                            if not config.calculate_per_token_loss:
                                out = sum_loss / torch.clamp(ntok, min=1) / num_microbatches
                            else:
                                out = sum_loss
                            store.append(report)
                    inputs[s], outputs[s] = x, out
                    local = out
                if forward_only:
                    continue
                grad = None
                for s in reversed(range(S)):
                    owner = pl.rank_of(s)
                    if owner != me:
                        if s < S - 1 and pl.rank_of(s + 1) == me:
                            send(grad, s, f"input gradient of mb {mb}")
                        continue
                    if s < S - 1 and pl.rank_of(s + 1) != me:
                        grad = recv(s + 1, f"input gradient of mb {mb}")
                    set_status(f"sequential: B stage {s} mb {mb}")
                    if s == S - 1:
                        torch.autograd.backward(outputs[s])
                    else:
                        torch.autograd.backward(outputs[s], grad_tensors=grad)
                    grad = inputs[s].grad if inputs[s] is not None else None
        if not forward_only and config.finalize_model_grads_func is not None:
            set_status("sequential: finalize_model_grads")
            config.finalize_model_grads_func(chunks, total_tokens if config.calculate_per_token_loss else None)
        holds_last = pl.rank_of(S - 1) == me
        return store if holds_last else []
