"""What ``install()`` takes (``ScheduleOptions``), turned into the schedule core's request, and the
start-up preview of what training will run. No torch import (the flags' checks run before it).

``ScheduleOptions.request()`` is the one translation of the options into a
``core.build.ScheduleRequest``; the core validates it (offload ratio and time, chunks) and
``core.build.build`` turns it into the schedule, here for the preview and in
``megatron.execution.forward_backward`` for training.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ...core import schedules as core_schedules
from ...core.build import OffloadRequest, ScheduleRequest, build
from ...core.ir import ScheduleError
from ..errors import ZeroBubbleArgumentError, ZeroBubbleConfigError

__all__ = ["ScheduleOptions", "check_ep_overlap", "preview"]


# the all-to-all the schedule core plans with under ep_overlap when no cost is given: a share of F
# (DeepSeek-like MoE layers spend 30-50% of a pass in dispatch + combine)
EP_OVERLAP_A2A_SHARE = 0.5


def check_ep_overlap(built) -> None:
    """Megatron's --overlap-moe-expert-parallel-comm runs the schedule's overlapped F&B pairs as one
    pass: refuse a built schedule (``core.build.Built``) that has none. dualpipe-v has them in its
    order; the core forms them in the others wherever hiding the all-to-all shortens the iteration."""
    if not built.lowered().meta.get("overlap_pairs"):
        s = built.setting
        raise ZeroBubbleConfigError(
            f"--overlap-moe-expert-parallel-comm: schedule {built.schedule.name} at pipeline size {s.stages} with "
            f"{s.microbatches} microbatches has no overlapped F&B pair to hide the all-to-all behind (the core pairs "
            "an F with a B only where that shortens the iteration): choose dualpipe-v, zb-v, v-auto or "
            "interleaved-1f1b, give a larger --zero-bubble-memory-limit, or drop the flag")


@dataclasses.dataclass
class ScheduleOptions:
    schedule: str
    chunks: Optional[int] = None
    memory_limit: Optional[float] = None  # per rank, in microbatches of one stage's activation
    # how hard the searched schedules look and how many ways vocabulary passes are placed
    # (``core.schedules.search.auto.EFFORTS``): 'full', or 'quick' (a plan row's ``search_effort``)
    effort: str = "full"
    cost_f: Any = 1.0
    cost_b: Any = 1.0
    cost_w: Any = 1.0
    cost_bw: Any = None  # the fused backward, where the split costs more (None: B + W)
    cost_comm: float = 0.0
    cost_sync: float = 0.0  # replicated stages (bitpipe): the replica gradient all-reduce of a stage
    # MoE: one microbatch's expert all-to-all in an F, B or BW of a stage (default with ep_overlap:
    # EP_OVERLAP_A2A_SHARE of F's cost); with ep_overlap the core pairs F&B passes that hide it
    cost_a2a: Any = None
    # activation of one microbatch's pass (one value, one per rank or one per model chunk) and what W
    # keeps of it after B (a share of mem_f, or values like mem_f's: one per rank or chunk)
    mem_f: Any = 1.0
    mem_w: Any = None
    timeout_s: float = 300.0
    # Megatron's EP all-to-all overlap (--overlap-moe-expert-parallel-comm; also on when the model
    # config has it): every training pass through megatron-core's schedule plans, the schedule's
    # overlapped F&B pairs as one pass (megatron.ep_overlap); schedules with pairs only
    ep_overlap: bool = False
    # profiler (runtime.observe.profiler): time passes over iterations [start, end] (counted from 1, calls
    # with forward_only=False) and write the profile JSON to profile_path at the window's end
    profile_window: Optional[tuple] = None
    profile_path: Optional[str] = None
    # runtime.observe.memory: measure each rank's activation memory at every pass boundary of every training
    # iteration (always inside a profile window); ``memory`` of the forward-backward object holds the
    # last iteration's peak, measured and as the simulator predicts it from the measured mem-f / mem-w
    measure_memory: bool = False
    # activation offload (docs/offload.md): offload_ratio R (0..1), or 'auto' (as little as fits
    # memory_limit); offload_time K, or 'auto' (measured at the first iteration: matmul speed and
    # host-link bandwidth); full-duplex copies unless offload_overlap is False; only the first
    # offload_chunks chunks of each rank; offload_cpu_test allows the synchronous CPU test mode
    # without CUDA
    offload_ratio: Any = None
    offload_time: Any = 1.0
    offload_overlap: bool = True
    offload_chunks: Optional[int] = None
    offload_cpu_test: bool = False
    offload_min_elements: int = 1024
    # optimizer post-validation (runtime.features.postval; the optimizer side: megatron.optimizer): wrap
    # Megatron's optimizer with handle.post_validated_optimizer(...)
    post_validation: bool = False
    # vocabulary parallelism (core.ir.vocab, runtime.features.vocab, megatron.vocab_parallel): 1 or 2 barriers,
    # None off; ``vocab_costs``: the VS/VT/VW costs and memory (core.ir.vocab.VocabSetting's fields)
    vocab_parallel: Optional[int] = None
    vocab_embedding: bool = False  # the input embedding split over the ranks too (--split-vocab-embedding)
    vocab_costs: Optional[dict] = None
    # variable-length batches (megatron.balanced): every iteration's global batch balanced over the
    # data-parallel replicas and microbatches, with its per-microbatch schedule; the share of F and B
    # at --seq-length spent in attention (None: from the model config)
    balance_microbatches: bool = False
    balance_attention_share: Optional[float] = None
    # the balanced microbatches in Megatron's packed-sequence format (THD: the model's attention must
    # take packed_seq_params, e.g. TE's; padded rows otherwise)
    balance_pack: bool = False

    @property
    def spec(self) -> core_schedules.ScheduleSpec:
        return core_schedules.get(self.schedule)

    def request(self) -> ScheduleRequest:
        """The schedule core's request for these options (raises ScheduleError on bad values)."""
        offload = None
        if self.offload_ratio is not None:
            offload = OffloadRequest(ratio=self.offload_ratio, time=self.offload_time,
                                     overlap=bool(self.offload_overlap), chunks=self.offload_chunks)
        a2a = self.cost_a2a
        if a2a is None:
            f = self.cost_f if isinstance(self.cost_f, (list, tuple)) else [self.cost_f]
            a2a = [EP_OVERLAP_A2A_SHARE * float(x) for x in f] if self.ep_overlap else 0.0
        mem_f = list(self.mem_f) if isinstance(self.mem_f, (list, tuple)) else [self.mem_f]
        mem_w = self.mem_w
        if mem_w is not None and not isinstance(mem_w, (list, tuple)):
            mem_w = [float(mem_w) * x for x in mem_f]  # a share of each stage's mem_f
        vocab = None
        if self.vocab_parallel is not None:
            from ...core.ir.vocab import VocabSetting
            costs = dict(cost_s=0.25, cost_t=0.25, cost_w=0.25, mem_s=0.25, mem_w=0.1)  # of a stage's F = 1
            if self.vocab_embedding:
                costs.update(cost_i=0.02, cost_g=0.02, cost_ci=0.02, cost_cg=0.02, mem_i=0.02)
            costs.update(self.vocab_costs or {})
            costs["embedding"] = bool(self.vocab_embedding)
            for k in ("cost_i", "cost_g", "cost_ci", "cost_cg", "mem_i") if not self.vocab_embedding else ():
                costs.pop(k, None)
            vocab = VocabSetting(barriers=int(self.vocab_parallel), **costs)
        return ScheduleRequest(self.schedule, chunks=self.chunks if self.spec.chunks is None else None, vocab=vocab,
                               cost_f=self.cost_f, cost_b=self.cost_b, cost_w=self.cost_w, cost_comm=self.cost_comm,
                               cost_bw=self.cost_bw,
                               cost_sync=self.cost_sync, mem_f=mem_f, mem_w=None if mem_w is None else list(mem_w),
                               memory_limit=self.memory_limit, offload=offload, cost_a2a=a2a,
                               a2a_overlap=bool(self.ep_overlap), effort=self.effort)

    def check(self, cuda: bool) -> None:
        """Refuse what cannot run, before anything is patched (``cuda``: a CUDA device is here)."""
        try:
            req = self.request()
        except ScheduleError as e:
            raise ZeroBubbleConfigError(str(e)) from None
        if self.vocab_embedding and self.vocab_parallel is None:
            raise ZeroBubbleConfigError("--split-vocab-embedding is a setting of vocabulary parallelism: add "
                                        "--enable-vocab-parallel")
        if self.vocab_parallel is not None:
            for on, what in ((self.post_validation, "optimizer post-validation"),
                             (self.spec.placement == "bitpipe", f"{self.schedule}'s replicated stages"),
                             (self.ep_overlap, "--overlap-moe-expert-parallel-comm")):
                if on:
                    raise ZeroBubbleConfigError(f"vocabulary parallelism (--enable-vocab-parallel) cannot be combined "
                                                f"with {what} yet")
        if req.offload is None:
            return
        if req.offload.ratio == "auto" and self.memory_limit is None:
            raise ZeroBubbleConfigError("offload_ratio='auto' offloads as little as fits memory_limit: give "
                                        "memory_limit")
        if not cuda and not self.offload_cpu_test:
            raise ZeroBubbleConfigError(
                "activation offload moves activations from the GPU to host memory, and this machine has no CUDA "
                "device; without a GPU it only runs in its CPU test mode (offload_cpu_test=True, "
                "--zero-bubble-offload-cpu-test), which checks correctness, not speed")


def preview(options: ScheduleOptions, pipeline_size: int, num_microbatches: int):
    """Build, validate and simulate the schedule ``options`` describe, as training will (pure Python).

    Returns ``(built, baseline)``: the ``core.build.Built`` schedule and the simulator's result for
    1F1B under the same costs (None if 1F1B cannot be built). With the offload time measured at
    start-up (``offload_time='auto'``) the offloaded schedule cannot be built before it is known:
    ``built`` is then the schedule without offload and ``built.request.offload`` is None (the entry
    point says so; training builds the offloaded one once K is measured). Raises
    ``ZeroBubbleArgumentError`` when the schedule cannot run (e.g. a memory limit below what it
    needs), so the entry point fails before training starts rather than at the first iteration.
    """
    p, m = int(pipeline_size), int(num_microbatches)
    try:
        req = options.request()
        if req.offload is not None and req.offload.time_measured:
            req = req.replace(offload=None, memory_limit=None if req.offload.ratio == "auto" else req.memory_limit)
        built = build(req, p, m)
    except ScheduleError as e:
        raise ZeroBubbleArgumentError(f"schedule {options.schedule} with pipeline size {pipeline_size} and "
                                      f"{num_microbatches} microbatches: {e}") from None
    if options.ep_overlap:
        try:
            check_ep_overlap(built)
        except ZeroBubbleConfigError as e:
            raise ZeroBubbleArgumentError(str(e)) from None
    baseline = None
    try:  # per-chunk values as each rank's whole stage
        st, pl = built.setting, built.schedule.placement
        whole = {k: st.rank_values(k, pl) for k in ("cost_f", "cost_b", "cost_w", "cost_a2a", "mem_f", "mem_w")}
        baseline = build(ScheduleRequest("1f1b", cost_comm=req.cost_comm, a2a_overlap=False, vocab=req.vocab, **whole),
                         p, m).result
    except ScheduleError:
        pass
    return built, baseline
