"""What `megatron-zb plan` is asked: ``PlanRequest`` (the model, the parallelism, the GPU memory
budget, the hardware, the schedules and layouts, the iteration, the levers and how hard to search)
and its levers, one small frozen dataclass each. Pure Python; a request pickles (plan's rows run in
worker processes). ``plan(request)`` checks it (``check``) before any row is built.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

from ..costs.model import ModelSpec
from ..ir import ScheduleError
from ..optimizer.rows import OptimizerOffload

__all__ = ["PlanRequest", "OffloadLever", "VocabLever", "MoeLever", "OptimizerOffload", "GPU_PEAK_TFLOPS",
           "EP_BANDWIDTH_GBPS", "SEARCHES", "CHUNK_CHOICES"]

GPU_PEAK_TFLOPS = {"h100": 989.0, "h200": 989.0, "a100": 312.0, "b200": 2250.0, "mi300x": 1307.0}

#: all-to-all bandwidth per GPU of expert parallelism, GB/s, where none is given: one 400 Gb/s
#: InfiniBand NIC per GPU (experts spread over nodes), as DeepSeek-V3 trains
EP_BANDWIDTH_GBPS = 50.0

SEARCHES = ("quick", "full")

#: the model chunks per rank (Megatron's ``--num-virtual-stages-per-pipeline-rank``) each row of an
#: interleaved schedule tries where the request names none: the counts Megatron's users run, and the
#: ones its baseline (``core.plan.baseline``) is taken over. More chunks shorten the warm-up and on
#: the looped placement hold fewer activations on the first rank; 4 needs 4P layers
CHUNK_CHOICES = (2, 4)


@dataclass(frozen=True)
class OffloadLever:
    """Activation offload (``core.passes.offload``): ``ratio`` R (0..1) offloads that share of every
    schedule's activations; 'auto' as little as brings each schedule under the memory budget. The
    transfer time is ``time`` K (x (F + B)), or derived per rank from ``host_link_gbps`` (one-way
    GB/s): K = activation bytes / bandwidth / (F + B); neither: K = 1. ``overlap`` False: D2H and
    H2D share one queue."""

    ratio: Union[float, str]
    time: Optional[float] = None
    host_link_gbps: Optional[float] = None
    overlap: bool = True


@dataclass(frozen=True)
class VocabLever:
    """Vocabulary parallelism (``core.ir.vocab``): ``parallel`` 'off' (rows without it), 'on' (with
    it, ``barriers`` barriers per microbatch, its collectives at ``gbps`` GB/s, the input embedding
    split too where ``embedding``) or 'both' (a row of each for every schedule)."""

    parallel: str = "off"
    barriers: int = 1
    gbps: float = EP_BANDWIDTH_GBPS
    embedding: bool = False


@dataclass(frozen=True)
class MoeLever:
    """MoE with expert parallelism: each F and B also moves its layers' all-to-all
    (``ModelSpec.layer_a2a_bytes``) at ``ep_gbps`` GB/s (with a profile: its ``cost_a2a``, if any),
    hidden inside the overlapped F&B pairs a schedule forms unless ``overlap`` is False."""

    ep_gbps: float = EP_BANDWIDTH_GBPS
    overlap: bool = True


@dataclass(frozen=True)
class PlanRequest:
    """One plan: rank every schedule of ``schedules`` (None: every one) for ``model`` on
    ``pipeline_parallel_size`` ranks, ``microbatches`` per iteration, ``gpu_memory_gb`` GiB per GPU.

    Hardware: F/B/W seconds from the model's FLOPs at ``tflops`` x ``efficiency``, or from
    ``profile`` (a profile JSON's dict). Schedules and layouts: ``pad_ends`` (the first and last
    stage one layer less), ``interleave_chunks`` (model chunks per rank of the schedules that take
    it; None: each such row tries ``CHUNK_CHOICES``, or the count ``layout`` has), ``layout``
    (Megatron's ``--pipeline-model-parallel-layout`` for every row; None: the even split and, with
    ``layout_search``, the balanced one). The iteration: ``cost_optimizer`` seconds
    per optimizer step, ranked with optimizer ``post_validation`` or Megatron's synchronous step.
    Levers: ``offload`` (None: none), ``vocab``, ``moe``, ``optimizer_offload``
    (``core.optimizer.rows``; None: the step is ``cost_optimizer`` alone), ``exact`` = (node limit,
    seconds or None): the automatic schedules also get the exact MILP (not with offload). The
    search: ``search`` 'quick' or 'full', ``refine`` (the quick rows that may lead searched again in
    full, the suggested row's memory limit brought to its peak), ``tighten`` (every searched row's
    limit brought to its peak). ``core.plan.plan`` says what each does to the rows."""

    model: ModelSpec
    pipeline_parallel_size: int
    microbatches: int
    gpu_memory_gb: float
    # the hardware
    tflops: float = GPU_PEAK_TFLOPS["h100"]
    efficiency: float = 0.5
    profile: Optional[dict] = None
    # the schedules and their layouts
    schedules: Optional[Sequence[str]] = None
    pad_ends: bool = False
    interleave_chunks: Optional[int] = None
    layout: Optional[str] = None
    layout_search: bool = True
    # the iteration
    cost_optimizer: float = 0.0
    post_validation: bool = False
    # the levers
    offload: Optional[OffloadLever] = None
    vocab: VocabLever = VocabLever()
    moe: MoeLever = MoeLever()
    optimizer_offload: Optional[OptimizerOffload] = None
    exact: Optional[Tuple[int, Optional[float]]] = None
    # the search
    search: str = "quick"
    refine: bool = True
    tighten: bool = False

    @property
    def budget_bytes(self) -> float:
        return self.gpu_memory_gb * 1024 ** 3

    @property
    def flops_per_s(self) -> float:
        return self.tflops * 1e12 * self.efficiency

    @property
    def ranked_by(self) -> str:
        """The row's key plan ranks by: the time per iteration with or without post-validation."""
        return "iteration_time_post_validated_s" if self.post_validation else "iteration_time_s"

    def replace(self, **changes) -> "PlanRequest":
        return dataclasses.replace(self, **changes)

    def check(self) -> None:
        """The request's values, each refused with the flag it comes from (the exact mode with
        offload and the worker count are ``plan``'s first checks)."""
        from ..costs.layout import parse
        spec, p = self.model, self.pipeline_parallel_size
        spec.validate()
        if p < 2:
            raise ScheduleError("--pipeline-parallel-size must be >= 2: pipeline schedules need several stages")
        if spec.num_layers + (2 if self.pad_ends else 0) < p:
            raise ScheduleError(f"--num-layers {spec.num_layers} cannot fill --pipeline-parallel-size {p} stages: "
                                "every stage holds at least one layer (use fewer pipeline stages or more layers)")
        for name, v in (("--efficiency", self.efficiency), ("--peak-tflops", self.tflops),
                        ("--gpu-memory-gb", self.gpu_memory_gb), ("--ep-bandwidth-gbps", self.moe.ep_gbps)):
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ScheduleError(f"{name} must be a positive number, got {v!r}")
        if self.microbatches < 1:
            raise ScheduleError("--num-microbatches must be >= 1")
        if self.layout is not None:
            parse(self.layout, p)
        v = self.interleave_chunks
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 2):
            raise ScheduleError(f"--num-virtual-stages-per-pipeline-rank must be an integer >= 2, got {v!r}")
        if self.search not in SEARCHES:
            raise ScheduleError(f"search is one of {', '.join(SEARCHES)}, got {self.search!r}")
        if self.vocab.parallel not in ("off", "on", "both"):
            raise ScheduleError(f"vocab_parallel is 'off', 'on' or 'both', got {self.vocab.parallel!r}")
        if self.optimizer_offload is not None:
            self.optimizer_offload.check()
