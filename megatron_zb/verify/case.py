"""A verification case: its options (``VerifyCase``), their checks and defaults (``make_case``),
and what the reference shares between cases (the key and the model options it ignores)."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .model.feature_checks import balance_problem, check_ep_overlap, check_recompute

__all__ = ["VerifyCase", "VerifyUsageError", "make_case", "schedule_placement", "reference_overrides",
           "reference_key", "PSEUDO_SCHEDULES", "DEFAULT_GRAD_RTOL", "DEFAULT_LOSS_ATOL", "DEFAULT_PARAM_RTOL",
           "HALF_PARAM_RTOL", "HALF_LOSS_ATOL"]

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
    # Megatron's optimizer instead of the plain SGD step (verify.model.optimizer_cases): 'adam' | 'sgd'
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
    # Megatron's --optimizer-cpu-offload: a fraction 0..1 of every rank's states on the host
    # (--optimizer-offload-fraction F) or 'auto' (each rank its own share, docs/optimizer_offload.md)
    optimizer_offload: Any = None
    optimizer_trough: bool = False  # --zero-bubble-optimizer-offload trough: the host states visit the GPU's troughs
    param_rtol: Optional[float] = None  # default DEFAULT_PARAM_RTOL (HALF_PARAM_RTOL for bf16/fp16)
    # Megatron's model features, by Megatron's flag names: MoE (megatron's SequentialMLP of local experts),
    # expert parallelism over the data-parallel ranks, activation recompute, multi-token prediction.
    # The reference trains the same model (experts, router, aux loss, MTP) non-pipelined, on one process,
    # without expert parallelism or recompute (they change how it runs, not the math).
    num_experts: Optional[int] = None
    expert_model_parallel_size: int = 1
    moe_router_topk: int = 2
    moe_router_pre_softmax: bool = False  # softmax before the top-k (Megatron wants it with top-1)
    moe_token_dispatcher_type: str = "alltoall"
    moe_aux_loss_coeff: float = 0.0
    moe_ffn_hidden_size: Optional[int] = None
    moe_shared_expert_intermediate_size: Optional[int] = None  # shared experts (every token, beside the routed)
    recompute_granularity: Optional[str] = None  # 'full' | 'selective'
    recompute_method: Optional[str] = None  # 'uniform' | 'block' (full recompute)
    recompute_num_layers: Optional[int] = None
    recompute_counts: Optional[List[int]] = None  # --zero-bubble-recompute-num-layers (per rank or chunk; made per chunk)
    mtp_num_layers: Optional[int] = None
    # Megatron's --overlap-moe-expert-parallel-comm: every pass through megatron-core's schedule plans,
    # overlapped F&B pairs as one pass (megatron.ep_overlap); not a TransformerConfig flag here, since
    # megatron's config accepts it only with bf16/fp16 and the check runs in fp32
    ep_overlap: bool = False
    # vocabulary parallelism (--enable-vocab-parallel; 2 with --disable-backward-fusion): the output
    # layer as every pipeline rank's shard; the reference keeps its whole output layer
    vocab_parallel: Optional[int] = None
    vocab_embedding: bool = False  # --split-vocab-embedding: the input embedding split over the ranks too
    balance_microbatches: bool = False  # skewed lengths balanced over replicas and microbatches (feature_checks)
    pack_sequences: bool = False  # balanced microbatches in Megatron's packed-sequence format (THD)
    attention_backend: str = "auto"  # Megatron's --attention-backend: flash/fused = torch's SDPA core attention
    device: str = "cpu"  # "cuda": every rank and the reference on a GPU, which ranks may share (verify.processes.cuda_gloo)
    profile_dir: Optional[str] = None  # torch profiler's Chrome trace of the last pipelined iteration, per rank

    def model_overrides(self) -> Dict[str, Any]:
        """TransformerConfig keywords of the model's math (the reference's too)."""
        kw: Dict[str, Any] = {}
        if self.mtp_num_layers:  # with rotary positions (DeepSeek-V3's; no position-embedding copy)
            kw["mtp_num_layers"] = self.mtp_num_layers
        if self.num_experts:
            # no linear biases, as MoE models are trained (megatron's expert MLP adds its bias in place
            # on a view when neither TP nor EP splits it, which autograd refuses)
            kw.update(num_moe_experts=self.num_experts, moe_router_topk=self.moe_router_topk,
                      moe_aux_loss_coeff=self.moe_aux_loss_coeff, add_bias_linear=False)
            if self.moe_router_pre_softmax:
                kw["moe_router_pre_softmax"] = True
            if self.moe_ffn_hidden_size:
                kw["moe_ffn_hidden_size"] = self.moe_ffn_hidden_size
            if self.moe_shared_expert_intermediate_size:
                kw["moe_shared_expert_intermediate_size"] = self.moe_shared_expert_intermediate_size
        return kw

    def run_overrides(self) -> Dict[str, Any]:
        """TransformerConfig keywords of how the pipelined run executes (not the reference)."""
        kw: Dict[str, Any] = {}
        if self.num_experts:
            kw.update(expert_model_parallel_size=self.expert_model_parallel_size,
                      moe_token_dispatcher_type=self.moe_token_dispatcher_type)
        if self.recompute_granularity:
            kw["recompute_granularity"] = self.recompute_granularity
            if self.recompute_granularity == "full":
                kw.update(recompute_method=self.recompute_method or "uniform",
                          recompute_num_layers=self.recompute_num_layers or 1)
        return kw

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.tensor_parallel_size * self.data_parallel_size

    def model_config(self):
        from .model.tinygpt import TinyGPTConfig
        return TinyGPTConfig(num_layers=self.num_layers, hidden_size=self.hidden_size,
                             position_embedding_type="rope" if self.mtp_num_layers else "learned_absolute",
                             num_attention_heads=self.num_attention_heads, vocab_size=self.vocab_size,
                             seq_length=self.seq_length, micro_batch_size=self.micro_batch_size,
                             tie_embeddings=self.tie_embeddings, seed=self.seed,
                             variable_seq_lengths=self.variable_seq_lengths, skewed_lengths=self.balance_microbatches,
                             packed_attention=self.pack_sequences, attention_backend=self.attention_backend)

    def describe(self) -> str:
        bits = [self.schedule, f"PP={self.pipeline_parallel_size}", f"TP={self.tensor_parallel_size}",
                f"{self.placement} x{self.chunks}", f"M={self.num_microbatches}", f"L={self.num_layers}"]
        if self.data_parallel_size > 1:
            bits.insert(3, f"DP={self.data_parallel_size}")
        if self.use_distributed_optimizer:
            bits.append("distributed-optimizer")
        for k in ("sequence_parallel", "overlap_grad_reduce", "gradient_accumulation_fusion", "forward_only",
                  "variable_seq_lengths", "balance_microbatches", "pack_sequences"):
            if getattr(self, k):
                bits.append(k)
        if self.offload_ratio is not None:
            bits.append(f"offload={self.offload_ratio} K={self.offload_time}"
                        + (" half-duplex" if self.offload_half_duplex else ""))
        if self.attention_backend != "auto":
            bits.append(f"attention={self.attention_backend}")
        if self.layers_per_stage:
            bits.append("layers=" + ",".join(map(str, self.layers_per_stage)))
        if self.schedule_options.get("effort", "full") != "full":
            bits.append(f"search-effort={self.schedule_options['effort']}")
        if self.vocab_parallel:
            bits.append(f"vocab-parallel/{self.vocab_parallel}" + ("+embedding" if self.vocab_embedding else ""))
        if not self.ddp:
            bits.append("no-ddp")
        if not self.tie_embeddings:
            bits.append("untied")
        if self.num_experts:
            bits.append(f"moe={self.num_experts}x top{self.moe_router_topk} EP={self.expert_model_parallel_size} "
                        f"{self.moe_token_dispatcher_type}" + (f" aux={self.moe_aux_loss_coeff:g}"
                                                               if self.moe_aux_loss_coeff else "")
                        + (f" shared={self.moe_shared_expert_intermediate_size}"
                           if self.moe_shared_expert_intermediate_size else "")
                        + (" ep-overlap" if self.ep_overlap else ""))
        if self.recompute_granularity:
            bits.append(f"recompute={self.recompute_granularity}" + (
                f"/{self.recompute_method or 'uniform'}/{self.recompute_num_layers or 1}"
                if self.recompute_granularity == "full" else "")
                + (f" per-chunk={','.join(map(str, self.recompute_counts))}" if self.recompute_counts else ""))
        if self.config_overrides:
            bits.append(",".join(f"{k}={v}" for k, v in sorted(self.config_overrides.items())))
        if self.optimizer:
            bits.append(f"megatron-{self.optimizer}" + (" bf16" if self.bf16 else "") + (" fp16" if self.fp16 else "")
                        + (" dist-opt" if self.use_distributed_optimizer else "")
                        + (f" clip={self.clip_grad:g}" if self.clip_grad else "")
                        + (f" loss-scale={self.loss_scale:g}" if self.loss_scale is not None else "")
                        + (f" inf@{self.inject_nonfinite_at}" if self.inject_nonfinite_at is not None else "")
                        + (" post-validation" if self.post_validation else "")
                        + (f" optimizer-offload={self.optimizer_offload}" if self.optimizer_offload is not None else "")
                        + (" trough" if self.optimizer_trough else ""))
        return (self.label + ": " if self.label else "") + " ".join(bits)


def schedule_placement(name: str, chunks: Optional[int]):
    """(placement style, chunks per rank) of a core schedule, from its registry entry."""
    from ..core import schedules as core_schedules
    from ..core.ir import ScheduleError
    try:
        spec = core_schedules.get(name)
        return spec.placement, spec.resolve_chunks(chunks)
    except ScheduleError as e:
        raise VerifyUsageError(str(e)) from None


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
        style, c = schedule_placement(schedule, chunks)
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
    from ..megatron.layout.placement import stage_layer_counts
    try:
        stage_layer_counts(case.num_layers, stages, layers_per_stage=case.layers_per_stage,
                              allow_padding_num_layers=case.allow_padding_num_layers)
    except ScheduleError as e:
        raise VerifyUsageError(str(e)) from None
    if case.hidden_size % case.num_attention_heads or case.num_attention_heads % t:
        raise VerifyUsageError("num_attention_heads must divide hidden_size and be divisible by the TP size")
    if case.vocab_size % t:
        raise VerifyUsageError("vocab_size must be divisible by the TP size")
    from ..megatron.features.flags.attention import ATTENTION_BACKENDS
    if case.attention_backend not in ATTENTION_BACKENDS:
        raise VerifyUsageError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}")
    if case.sequence_parallel and t < 2:
        raise VerifyUsageError("sequence_parallel needs --tensor-parallel-size >= 2")
    if case.sequence_parallel and case.seq_length % t:
        raise VerifyUsageError("seq_length must be divisible by the TP size with sequence parallelism")
    if case.vocab_parallel is not None:
        _check_vocab(case)
    elif case.vocab_embedding:
        raise VerifyUsageError("--split-vocab-embedding needs --enable-vocab-parallel")
    if case.balance_microbatches or case.pack_sequences:  # refused in one line, or the per-token loss and the option set
        balance_problem(case, PSEUDO_SCHEDULES, VerifyUsageError)
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
    _check_model_features(case)
    _check_optimizer_options(case)
    return case


def _check_model_features(case: VerifyCase) -> None:
    """MoE, expert parallelism, recompute and MTP options, with Megatron's flag names in the errors."""
    def whole(name, v, lo):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise VerifyUsageError(f"--{name.replace('_', '-')} must be an integer >= {lo}, got {v!r}")
    ep = case.expert_model_parallel_size
    whole("expert_model_parallel_size", ep, 1)
    if case.num_experts is None:
        if ep > 1:
            raise VerifyUsageError("--expert-model-parallel-size needs --num-experts (a MoE model)")
    else:
        whole("num_experts", case.num_experts, 1)
        whole("moe_router_topk", case.moe_router_topk, 1)
        if case.moe_router_topk > case.num_experts:
            raise VerifyUsageError(f"--moe-router-topk {case.moe_router_topk} is more than --num-experts "
                                   f"{case.num_experts}")
        if case.num_experts % ep:
            raise VerifyUsageError(f"--num-experts {case.num_experts} must be divisible by "
                                   f"--expert-model-parallel-size {ep}")
        if case.data_parallel_size % ep:
            raise VerifyUsageError(f"--expert-model-parallel-size {ep} must divide --data-parallel-size "
                                   f"{case.data_parallel_size} (the experts are sharded over the data-parallel ranks; "
                                   "the expert tensor-parallel size is the TP size, Megatron's default)")
        if case.moe_token_dispatcher_type not in ("alltoall", "allgather"):
            raise VerifyUsageError(f"--moe-token-dispatcher-type must be alltoall or allgather, got "
                                   f"{case.moe_token_dispatcher_type!r} (flex needs DeepEP/HybridEP on GPUs)")
        if not (isinstance(case.moe_aux_loss_coeff, (int, float)) and math.isfinite(case.moe_aux_loss_coeff)
                and case.moe_aux_loss_coeff >= 0):
            raise VerifyUsageError(f"--moe-aux-loss-coeff must be a finite number >= 0, got {case.moe_aux_loss_coeff!r}")
        if case.moe_shared_expert_intermediate_size is not None:
            whole("moe_shared_expert_intermediate_size", case.moe_shared_expert_intermediate_size, 1)
        if case.moe_ffn_hidden_size is not None:
            whole("moe_ffn_hidden_size", case.moe_ffn_hidden_size, 1)
            if case.moe_ffn_hidden_size % case.tensor_parallel_size:
                raise VerifyUsageError("--moe-ffn-hidden-size must be divisible by the TP size")
        if case.variable_seq_lengths and case.moe_token_dispatcher_type != "alltoall":
            raise VerifyUsageError("--variable-seq-lengths with MoE needs --moe-token-dispatcher-type alltoall")
        if case.tensor_parallel_size > 1 and not case.sequence_parallel:
            raise VerifyUsageError("MoE with --tensor-parallel-size > 1 needs --sequence-parallel (Megatron's rule)")
    if case.ep_overlap:
        check_ep_overlap(case, PSEUDO_SCHEDULES, VerifyUsageError)
    check_recompute(case, VerifyUsageError)  # Megatron's flags and the count per model chunk
    if case.mtp_num_layers is not None:
        whole("mtp_num_layers", case.mtp_num_layers, 1)
        if case.placement != "single" or case.chunks != 1:
            raise VerifyUsageError("--mtp-num-layers runs with one-chunk schedules here (Megatron builds the MTP block "
                                   "on the last pipeline stage)")
        if case.tie_embeddings:
            raise VerifyUsageError("--mtp-num-layers needs --untied: with tied embeddings the MTP stage holds two copies "
                                   "of the word embedding and Megatron's finalize_model_grads all-reduces only the output "
                                   "layer's, so even Megatron's own 1F1B differs from the reference there")


def _check_optimizer_options(case: VerifyCase) -> None:
    if (case.post_validation or case.optimizer_trough) and case.optimizer is None:
        case.optimizer = "adam"
    # --use-distributed-optimizer alone is the data-parallel Adam check (gradients compared); with
    # --optimizer it selects Megatron's DistributedOptimizer for the optimizer cases
    uses = ["--" + k.replace("_", "-") for k in ("bf16", "fp16", "clip_grad", "loss_scale") if getattr(case, k)]
    if case.inject_nonfinite_at is not None:
        uses.append("--inject-nonfinite-at")
    if case.optimizer_trough and case.optimizer_offload is None:
        case.optimizer_offload = 1.0  # every state lives in host memory
    if case.optimizer_offload is not None:
        uses.append("--optimizer-offload" if not case.optimizer_trough else "--zero-bubble-optimizer-offload trough")
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
    from .model.offload_auto import check_offload
    check_offload(case, VerifyUsageError)
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


# config overrides that only change how the pipeline runs (not the math) stay off the reference
_PIPELINE_ONLY_KEYS = ("p2p", "pipeline", "overlap", "sequence_parallel", "tensor_model", "virtual", "deallocate",
                       "microbatch", "variable_seq", "fusion", "recompute", "offload", "defer", "wgrad",
                       "timers", "barrier", "moe_token_dispatcher")


def reference_overrides(case: VerifyCase) -> dict:
    kw = {k: v for k, v in case.config_overrides.items() if not any(b in k for b in _PIPELINE_ONLY_KEYS)}
    kw.update(case.model_overrides())
    return kw


def reference_key(case: VerifyCase) -> tuple:
    opt = (case.optimizer, case.optimizer_lr, case.clip_grad, case.bf16, case.fp16, case.use_distributed_optimizer,
           case.loss_scale, case.initial_loss_scale, case.inject_nonfinite_at,
           0.5 if case.optimizer_offload == "auto" else case.optimizer_offload)
    return (json.dumps(case.model_config().to_dict(), sort_keys=True), case.num_microbatches * case.data_parallel_size,
            case.iterations, case.lr, case.forward_only, case.use_distributed_optimizer,
            repr(sorted(reference_overrides(case).items())), opt if case.optimizer else None)


def _check_vocab(case: VerifyCase) -> None:
    """Vocabulary parallelism: what it runs with so far, refused in one line otherwise."""
    if case.vocab_parallel not in (1, 2):
        raise VerifyUsageError(f"vocab_parallel is 1 or 2 barriers, got {case.vocab_parallel!r}")
    blockers = [(case.placement == "bitpipe", "replicated stages (bitpipe)"),
                (case.schedule in PSEUDO_SCHEDULES, f"the pseudo-schedule {case.schedule}"),
                (bool(case.mtp_num_layers), "--mtp-num-layers"),
                (case.sequence_parallel, "--sequence-parallel"), (case.overlap_grad_reduce, "--overlap-grad-reduce"),
                (case.ep_overlap, "--overlap-moe-expert-parallel-comm")]
    for on, what in blockers:
        if on:
            raise VerifyUsageError(f"--enable-vocab-parallel cannot be combined with {what} yet")
    shards = case.pipeline_parallel_size * case.tensor_parallel_size
    if case.vocab_size % shards:
        raise VerifyUsageError(f"--enable-vocab-parallel: the vocabulary ({case.vocab_size}) must split evenly over "
                               f"{shards} pipeline x tensor-parallel ranks")

