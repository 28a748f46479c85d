"""A tiny real megatron-core GPT, built per rank under any stage placement.

This is the model the correctness harness (``megatron-zb verify``) and the runtime tests train.
It is stock megatron-core (``GPTModel`` with the local layer spec, fp32, CPU init, no dropout);
this module only decides *what each rank builds* and *which weights it starts from*:

* **Placement.** A stage is a global model-chunk index in pipeline order (stage 0 holds the
  embedding, stage S-1 the output layer and loss). ``'single'`` puts stage r on rank r,
  ``'looped'`` is Megatron's interleaving (stage s on rank s % p, v chunks per rank) and ``'v'``
  puts stages r and 2p-1-r on rank r, so rank 0 holds both the embedding and the loss. A rank's
  chunks are ordered by stage; a chunk's index on its rank is its ``vp_stage``.
* **Layers.** Each stage holds a contiguous slice of the global layer list (``stage_layer_counts``;
  uneven splits via ``layers_per_stage`` or ``allow_padding_num_layers``, which, like the ZB
  authors' flag, gives the first and the last stage one layer less). megatron-core computes a
  chunk's layer count and global layer offset assuming looped placement and even splits
  (``get_num_layers_to_build`` / ``get_transformer_layer_offset``). We wrap both functions (in the
  modules that bound them; megatron's files are untouched) so that a config built here answers
  from its own layer table, keyed by (pipeline rank, vp_stage); other configs fall through to
  megatron. So V chunks get their true global ``layer_number`` (used e.g. by attention scaling and
  by checkpoint names).
* **Weights.** Every parameter has a *global name* (``decoder.layers.<global index>.…``,
  ``embedding.word_embeddings.weight``, …; attribute ``param.mzb_global_name``). Its initial value
  is drawn from a generator seeded by a hash of that name, as the *full* (un-sharded) tensor, then
  sliced for the rank's tensor-parallel shard. So every placement, every TP size and the
  single-process reference start from identical weights.
* **Tied embedding/output weights** (``tie_embeddings=True``, GPT's default). As in Megatron, the
  stage holding the output layer keeps its own copy of the word embedding (global name: the
  embedding's); it starts equal to the embedding, and after backward the two copies' gradients
  are summed so both copies receive the same update. For single/looped placements the copies are
  on different ranks and Megatron's embedding group does the sum. For **V** both copies live on
  rank 0 in two different chunks, so the embedding group is made of rank 0 alone (Megatron's
  all-reduce becomes a no-op) and ``finalize_model_grads_for`` adds the two local gradients and
  writes the sum into both. The reference (PP=1) has a single shared parameter, so its gradient
  is that same sum.
"""
from __future__ import annotations

import dataclasses
import hashlib
import re
import sys
import threading
from dataclasses import dataclass
from functools import partial
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..core.ir import Placement, ScheduleError

__all__ = [
    "TinyGPTConfig", "ChunkInfo", "make_placement", "stage_layer_counts", "stage_layer_ranges",
    "chunk_infos", "init_parallel_state", "destroy_parallel_state", "make_transformer_config",
    "build_model_chunks", "wrap_ddp", "global_param_name", "init_tensor", "deterministic_init_",
    "tied_embedding_copies", "finalize_model_grads_for", "make_batches", "batch_iterators",
    "forward_step_func", "loss_func", "collect_full_grads", "zero_grads_", "sgd_step_",
    "megatron_version", "unwrap",
]


# --------------------------------------------------------------------------------------------
# configuration and placement (no megatron import needed)
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TinyGPTConfig:
    """Shape of the tiny GPT and of its synthetic data. Identical on every rank and run."""

    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: Optional[int] = None  # default 4 * hidden
    vocab_size: int = 128
    seq_length: int = 32
    micro_batch_size: int = 2
    tie_embeddings: bool = True
    position_embedding_type: str = "learned_absolute"  # or "rope"
    seed: int = 1234
    init_std: float = 0.05
    # data
    variable_seq_lengths: bool = False  # each microbatch gets its own length (multiple of 4)
    loss_mask_prob: float = 0.1  # fraction of label positions masked out of the loss

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ChunkInfo:
    """What one model chunk of one rank holds."""

    stage: int  # global stage index (pipeline order)
    vp_stage: int  # index of this chunk among its rank's chunks (stage order)
    rank: int  # pipeline-parallel rank holding it
    layers: Tuple[int, ...]  # global 0-based layer indices, contiguous
    pre_process: bool  # holds stage 0 (embedding)
    post_process: bool  # holds stage S-1 (final norm, output layer, loss)
    num_stages: int

    @property
    def layer_offset(self) -> int:
        return self.layers[0] if self.layers else 0


def make_placement(style: str, pipeline_parallel_size: int, chunks: Optional[int] = None) -> Placement:
    """'single' (1 chunk per rank), 'looped' (``chunks`` per rank, stage s on rank s % p) or 'v'."""
    p = int(pipeline_parallel_size)
    if p < 1:
        raise ScheduleError(f"pipeline_parallel_size must be >= 1, got {p}")
    if style == "single":
        if chunks not in (None, 1):
            raise ScheduleError(f"'single' placement has 1 chunk per rank, got chunks={chunks}")
        return Placement.single(p)
    if style == "looped":
        v = 2 if chunks is None else int(chunks)
        if v < 1:
            raise ScheduleError(f"chunks must be >= 1, got {v}")
        return Placement.looped(p, v)
    if style == "v":
        if chunks not in (None, 2):
            raise ScheduleError(f"'v' placement has 2 chunks per rank, got chunks={chunks}")
        return Placement.vshape(p)
    raise ScheduleError(f"unknown placement {style!r}; use 'single', 'looped' or 'v'")


def stage_layer_counts(num_layers: int, num_stages: int, *, layers_per_stage: Optional[Sequence[int]] = None,
                       allow_padding_num_layers: bool = False) -> List[int]:
    """Layers per stage.

    ``layers_per_stage`` gives them explicitly. Otherwise an even split; if ``num_layers`` is not
    divisible by the stage count and ``allow_padding_num_layers`` is set, the split is computed
    for ``num_layers + 2`` and the first and last stage get one layer less (they also carry the
    embedding and the loss), e.g. 6 layers on 4 stages -> [1, 2, 2, 1].
    """
    if layers_per_stage is not None:
        counts = [int(x) for x in layers_per_stage]
        if len(counts) != num_stages:
            raise ScheduleError(f"layers_per_stage has {len(counts)} entries, need one per stage ({num_stages})")
        if any(c < 0 for c in counts) or sum(counts) != num_layers:
            raise ScheduleError(f"layers_per_stage {counts} must be non-negative and sum to num_layers={num_layers}")
        return counts
    if num_stages < 1:
        raise ScheduleError(f"need at least one stage, got {num_stages}")
    if num_layers % num_stages == 0:
        return [num_layers // num_stages] * num_stages
    if allow_padding_num_layers and num_stages >= 2 and (num_layers + 2) % num_stages == 0:
        per = (num_layers + 2) // num_stages
        if per >= 1:
            return [per - 1] + [per] * (num_stages - 2) + [per - 1]
    hint = (" (allow_padding_num_layers needs num_layers + 2 divisible by the stage count)"
            if allow_padding_num_layers else "; pass allow_padding_num_layers or layers_per_stage")
    raise ScheduleError(f"{num_layers} layers cannot be split evenly over {num_stages} stages{hint}")


def stage_layer_ranges(num_layers: int, num_stages: int, **kw) -> List[range]:
    counts = stage_layer_counts(num_layers, num_stages, **kw)
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def chunk_infos(placement: Placement, num_layers: int, pp_rank: int, **layer_kw) -> List[ChunkInfo]:
    """The chunks ``pp_rank`` builds, ordered by stage (index = vp_stage)."""
    S = placement.num_stages
    ranges = stage_layer_ranges(num_layers, S, **layer_kw)
    out = []
    for vp, s in enumerate(placement.stages_of(pp_rank)):
        out.append(ChunkInfo(stage=s, vp_stage=vp, rank=pp_rank, layers=tuple(ranges[s]),
                             pre_process=(s == 0), post_process=(s == S - 1), num_stages=S))
    return out


def placement_layer_table(placement: Placement, num_layers: int, **layer_kw) -> Dict[Tuple[int, int], Tuple[int, int]]:
    """(pp_rank, vp_stage) -> (global layer offset, layer count) for every chunk of every rank."""
    table = {}
    for r in range(placement.num_ranks):
        for info in chunk_infos(placement, num_layers, r, **layer_kw):
            table[(r, info.vp_stage)] = (info.layer_offset, len(info.layers))
    return table


# --------------------------------------------------------------------------------------------
# megatron glue
# --------------------------------------------------------------------------------------------

def megatron_version() -> str:
    try:
        from megatron.core import package_info
        return str(package_info.__version__)
    except Exception:  # pragma: no cover
        return "unknown"


def init_parallel_state(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                        placement: Optional[Placement] = None, seed: int = 1234) -> None:
    """(Re)initialise megatron's ``parallel_state`` for TP x PP over the current world.

    ``placement`` decides the virtual-pipeline size (its chunks per rank, None for 1) and the
    embedding group: for V placement the embedding and the output layer both live on pipeline
    rank 0, so the group is rank 0 alone. The world size must be a multiple of TP x PP (the rest
    is data parallelism).
    """
    from megatron.core import parallel_state, tensor_parallel

    if placement is None:
        placement = Placement.single(pipeline_parallel_size)
    if placement.num_ranks != pipeline_parallel_size:
        raise ScheduleError(f"placement has {placement.num_ranks} ranks, pipeline_parallel_size is "
                            f"{pipeline_parallel_size}")
    destroy_parallel_state()
    v = placement.chunks
    kwargs = dict(tensor_model_parallel_size=tensor_parallel_size,
                  pipeline_model_parallel_size=pipeline_parallel_size,
                  virtual_pipeline_model_parallel_size=(v if v > 1 else None),
                  create_gloo_process_groups=False)
    if placement.style == "v" or _embedding_and_loss_on_one_rank(placement):
        first = placement.rank_of(0)

        def embedding_ranks(pp_ranks, *_a):
            return [pp_ranks[first]]
        kwargs["get_embedding_ranks"] = embedding_ranks
    parallel_state.initialize_model_parallel(**kwargs)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _embedding_and_loss_on_one_rank(placement: Placement) -> bool:
    return placement.num_ranks > 1 and placement.rank_of(0) == placement.rank_of(placement.num_stages - 1)


def destroy_parallel_state() -> None:
    """Megatron's ``destroy_model_parallel`` and the torch process groups behind it (all but WORLD).

    Megatron only drops its references (and destroys its gloo copies), so every re-initialisation
    would leave each group's gloo threads running: a process that initialises many times (verify,
    the tests) slows to a crawl. Collective when torch.distributed is up: every rank calls it, as
    every rank calls ``init_parallel_state``.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ..runtime.p2p import registered_groups
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # no peer is still using a group this rank is about to close
        for group in registered_groups():
            if group is not dist.group.WORLD:
                dist.destroy_process_group(group)


def make_transformer_config(model_cfg: TinyGPTConfig, *, tensor_parallel_size: int = 1,
                            pipeline_parallel_size: int = 1, chunks: int = 1,
                            sequence_parallel: bool = False, gradient_accumulation_fusion: bool = False,
                            **overrides):
    """A fp32, CPU-initialised, dropout-free ``TransformerConfig`` for the tiny GPT.

    ``overrides`` go straight to ``TransformerConfig`` (e.g. ``overlap_p2p_comm``,
    ``batch_p2p_comm``, ``deallocate_pipeline_outputs``, ``calculate_per_token_loss``).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=model_cfg.num_layers, hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        ffn_hidden_size=model_cfg.ffn_hidden_size,
        tensor_model_parallel_size=tensor_parallel_size,
        pipeline_model_parallel_size=pipeline_parallel_size,
        virtual_pipeline_model_parallel_size=(chunks if chunks > 1 else None),
        sequence_parallel=sequence_parallel and tensor_parallel_size > 1,
        use_cpu_initialization=True,  # perform_initialization stays True: it also sets the TP attributes
        params_dtype=torch.float32, pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=gradient_accumulation_fusion,
        variable_seq_lengths=model_cfg.variable_seq_lengths,
    )
    if model_cfg.variable_seq_lengths:
        # megatron refuses variable_seq_lengths with the default 'allgather' token dispatcher,
        # even for dense models.
        kw["moe_token_dispatcher_type"] = "alltoall"
    kw.update(overrides)
    return TransformerConfig(**kw)


# -- layer-table hooks -------------------------------------------------------------------------

_HOOK_LOCK = threading.Lock()


def _lookup_layers(config, vp_stage, pp_rank) -> Optional[Tuple[int, int]]:
    spec = getattr(config, "_mzb_layers", None)
    if spec is None:
        return None
    own = spec["own_rank"]
    if own is None:
        from megatron.core import parallel_state
        own = parallel_state.get_pipeline_model_parallel_rank()
    rank = spec["placement_rank"] if (pp_rank is None or pp_rank == own) else pp_rank
    key = (rank, 0 if vp_stage is None else vp_stage)
    return spec["table"].get(key)


def install_layer_hooks() -> None:
    """Wrap megatron's layer-count / layer-offset functions once (idempotent)."""
    import megatron.core.transformer.transformer_block as tb
    import megatron.core.transformer.transformer_layer as tl

    with _HOOK_LOCK:
        if getattr(tl.get_transformer_layer_offset, "_mzb_wrapped", False) and \
                getattr(tb.get_num_layers_to_build, "_mzb_wrapped", False):
            return
        orig_offset = getattr(tl.get_transformer_layer_offset, "__wrapped__", tl.get_transformer_layer_offset)
        orig_count = getattr(tb.get_num_layers_to_build, "__wrapped__", tb.get_num_layers_to_build)

        def get_transformer_layer_offset(config, vp_stage=None, pp_rank=None, *a, **k):
            hit = _lookup_layers(config, vp_stage, pp_rank)
            if hit is not None:
                return hit[0]
            return orig_offset(config, vp_stage, pp_rank, *a, **k)

        def get_num_layers_to_build(config, vp_stage=None, pp_rank=None, *a, **k):
            hit = _lookup_layers(config, vp_stage, pp_rank)
            if hit is not None:
                return hit[1]
            return orig_count(config, vp_stage, pp_rank, *a, **k)

        for fn, orig in ((get_transformer_layer_offset, orig_offset), (get_num_layers_to_build, orig_count)):
            fn._mzb_wrapped = True
            fn.__wrapped__ = orig
            fn.__doc__ = (orig.__doc__ or "") + "\n(megatron-zb: answers from the config's layer table " \
                "for models built by megatron_zb.megatron.model)"
        # rebind everywhere megatron imported the originals by name
        for name, mod in list(sys.modules.items()):
            if mod is None or not (name == "megatron" or name.startswith("megatron.")):
                continue
            d = getattr(mod, "__dict__", {})
            if d.get("get_transformer_layer_offset") is orig_offset:
                setattr(mod, "get_transformer_layer_offset", get_transformer_layer_offset)
            if d.get("get_num_layers_to_build") is orig_count:
                setattr(mod, "get_num_layers_to_build", get_num_layers_to_build)


# -- building ----------------------------------------------------------------------------------

def build_model_chunks(model_cfg: TinyGPTConfig, placement: Placement, *, config=None,
                       pp_rank: Optional[int] = None, layers_per_stage: Optional[Sequence[int]] = None,
                       allow_padding_num_layers: bool = False, init: bool = True,
                       **config_kw) -> List[torch.nn.Module]:
    """Build this rank's model chunks (``GPTModel`` each, ordered by stage) and initialise them.

    ``config``: a TransformerConfig (default: ``make_transformer_config(model_cfg, ...)`` with the
    current TP/PP sizes and ``config_kw``). ``pp_rank``: the placement rank to build for (default:
    this process's pipeline rank; a single process may build any rank's chunks, e.g. to check a
    placement). Each chunk gets ``chunk.mzb_chunk_info`` (a ``ChunkInfo``) and each parameter a
    ``mzb_global_name``. The chunks share one config, which carries the layer table.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    install_layer_hooks()
    own_rank = parallel_state.get_pipeline_model_parallel_rank()
    if pp_rank is None:
        pp_rank = own_rank
    layer_kw = dict(layers_per_stage=layers_per_stage, allow_padding_num_layers=allow_padding_num_layers)
    infos = chunk_infos(placement, model_cfg.num_layers, pp_rank, **layer_kw)
    if config is None:
        config = make_transformer_config(
            model_cfg, tensor_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
            pipeline_parallel_size=placement.num_ranks, chunks=placement.chunks, **config_kw)
    if getattr(config, "pipeline_model_parallel_layout", None) is not None:
        raise ScheduleError("pipeline_model_parallel_layout is not supported with megatron-zb placements")
    config._mzb_layers = {"own_rank": own_rank, "placement_rank": pp_rank,
                          "table": placement_layer_table(placement, model_cfg.num_layers, **layer_kw),
                          "placement": placement}
    multi = placement.chunks > 1
    chunks = []
    for info in infos:
        model = GPTModel(
            config=config, transformer_layer_spec=layer_spec(config, len(info.layers)),
            vocab_size=model_cfg.vocab_size, max_sequence_length=model_cfg.seq_length,
            pre_process=info.pre_process, post_process=info.post_process,
            share_embeddings_and_output_weights=model_cfg.tie_embeddings,
            position_embedding_type=model_cfg.position_embedding_type,
            vp_stage=(info.vp_stage if multi else None),
        )
        model.mzb_chunk_info = info
        _check_layers(model, info)
        _name_params(model, info, model_cfg)
        chunks.append(model)
    if init:
        deterministic_init_(chunks, model_cfg.seed, model_cfg.init_std)
    return chunks


class SequenceParallelTorchNorm:
    """torch LayerNorm/RMSNorm usable with sequence parallelism (the local spec's WrappedTorchNorm
    refuses it; apex's FusedLayerNorm is not available on CPU). Like megatron's fused norms, the
    parameters are tagged ``sequence_parallel`` so finalize_model_grads all-reduces their grads
    over the TP group."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        if getattr(config, "layernorm_zero_centered_gamma", False):
            raise NotImplementedError("zero-centered gamma is not supported by the torch norm")
        kind = getattr(config, "normalization", normalization)
        if kind == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif kind == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise NotImplementedError(f"normalization {kind!r}")
        for p in norm.parameters():
            setattr(p, "sequence_parallel", bool(config.sequence_parallel))
        return norm


def layer_spec(config, num_layers: int):
    """megatron's local GPT layer spec; with sequence parallelism its norms are swapped for
    ``SequenceParallelTorchNorm`` and the block spec is given explicitly (so the final norm too)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    spec = get_gpt_layer_local_spec()
    if not config.sequence_parallel:
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    sub = dataclasses.replace(spec.submodules, input_layernorm=SequenceParallelTorchNorm,
                              pre_mlp_layernorm=SequenceParallelTorchNorm)
    layer = dataclasses.replace(spec, submodules=sub)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=SequenceParallelTorchNorm)


def _check_layers(model, info: ChunkInfo) -> None:
    layers = list(model.decoder.layers)
    got = [int(l.layer_number) - 1 for l in layers]
    if got != list(info.layers):
        raise RuntimeError(f"stage {info.stage}: megatron built layers {got}, expected {list(info.layers)} "
                           "(layer-table hooks not effective?)")


def build_reference_model(model_cfg: TinyGPTConfig, **config_kw) -> torch.nn.Module:
    """The whole model as one chunk (PP=1, TP=1 must be initialised); initialised like the rest."""
    return build_model_chunks(model_cfg, Placement.single(1), **config_kw)[0]


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def global_param_name(local_name: str, info: ChunkInfo, tie_embeddings: bool) -> str:
    """The name a chunk parameter has in the whole (unpipelined) model."""
    name = local_name
    while name.startswith("module."):
        name = name[len("module."):]
    m = _LAYER_RE.match(name)
    if m:
        i = int(m.group(1))
        if i >= len(info.layers):
            raise RuntimeError(f"stage {info.stage} has {len(info.layers)} layers, got parameter {local_name}")
        return f"decoder.layers.{info.layers[i]}.{m.group(2)}"
    if name == "output_layer.weight" and tie_embeddings:
        return "embedding.word_embeddings.weight"  # the tied copy
    return name


def _name_params(model, info: ChunkInfo, model_cfg: TinyGPTConfig) -> None:
    for n, p in model.named_parameters():
        p.mzb_global_name = global_param_name(n, info, model_cfg.tie_embeddings)
        p.mzb_stage = info.stage


def unwrap(model):
    """The GPTModel under DDP/Float16 wrappers."""
    while hasattr(model, "module") and not hasattr(model, "mzb_chunk_info"):
        model = model.module
    return model


def _name_seed(global_name: str, seed: int) -> int:
    h = hashlib.sha256(f"{seed}:{global_name}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def init_tensor(global_name: str, full_shape: Sequence[int], seed: int = 1234, std: float = 0.05) -> torch.Tensor:
    """The full (un-sharded) initial value of a parameter, a function of its global name only."""
    g = torch.Generator(device="cpu")
    g.manual_seed(_name_seed(global_name, seed))
    x = torch.randn(tuple(full_shape), generator=g, dtype=torch.float32)
    leaf = global_name.rsplit(".", 1)[-1]
    if len(full_shape) == 1 and "norm" in global_name and leaf == "weight":
        return 1.0 + 0.1 * x  # norm scales near 1
    if len(full_shape) == 1:
        return 0.02 * x  # biases, norm shifts
    return std * x


def _tp_slice(param, full: torch.Tensor) -> torch.Tensor:
    from megatron.core import parallel_state
    if not getattr(param, "tensor_model_parallel", False):
        return full
    tp = parallel_state.get_tensor_model_parallel_world_size()
    r = parallel_state.get_tensor_model_parallel_rank()
    dim = int(param.partition_dim)
    if int(getattr(param, "partition_stride", 1)) != 1:
        raise NotImplementedError(f"{param.mzb_global_name}: partition_stride != 1 not supported")
    n = param.shape[dim]
    return full.narrow(dim, r * n, n)


def _full_shape(param) -> Tuple[int, ...]:
    from megatron.core import parallel_state
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[int(param.partition_dim)] *= parallel_state.get_tensor_model_parallel_world_size()
    return tuple(shape)


@torch.no_grad()
def deterministic_init_(chunks: Sequence[torch.nn.Module], seed: int = 1234, std: float = 0.05) -> None:
    """Overwrite every parameter with ``init_tensor(global name)`` sliced for this TP rank."""
    for chunk in chunks:
        for _, p in unwrap(chunk).named_parameters():
            full = init_tensor(p.mzb_global_name, _full_shape(p), seed, std)
            p.data.copy_(_tp_slice(p, full))


def wrap_ddp(chunks: Sequence[torch.nn.Module], *, overlap_grad_reduce: bool = False,
             bucket_size: Optional[int] = None, use_distributed_optimizer: bool = False) -> List[torch.nn.Module]:
    """Wrap each chunk in megatron's ``DistributedDataParallel`` (grads go to ``param.main_grad``).

    The first chunk gets bucketing, the others not (as megatron.training does).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    out = []
    for i, c in enumerate(chunks):
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=overlap_grad_reduce,
                                                use_distributed_optimizer=use_distributed_optimizer,
                                                bucket_size=bucket_size)
        out.append(DistributedDataParallel(config=c.config, ddp_config=ddp_cfg, module=c,
                                           disable_bucketing=(i > 0)))
    return out


def configure_grad_sync(config, chunks: Sequence[torch.nn.Module], *, placement: Placement, ddp: bool,
                        overlap_grad_reduce: bool = False) -> None:
    """Set ``config.finalize_model_grads_func`` (and DDP's no_sync / grad_sync hooks) the way
    megatron.training does, with the V-placement tied-embedding fix."""
    config.finalize_model_grads_func = partial(finalize_model_grads_for, placement=placement)
    config.no_sync_func = None
    config.grad_sync_func = None
    if ddp and overlap_grad_reduce:
        fns = [c.no_sync for c in chunks]
        config.no_sync_func = fns[0] if len(fns) == 1 else fns
        gs = [c.start_grad_sync for c in chunks]
        config.grad_sync_func = gs[0] if len(gs) == 1 else gs


# -- gradients -------------------------------------------------------------------------------

def _grad_of(p) -> Optional[torch.Tensor]:
    g = getattr(p, "main_grad", None)
    return p.grad if g is None else g


def _set_grad(p, value: torch.Tensor) -> None:
    if getattr(p, "main_grad", None) is not None:
        p.main_grad.copy_(value)
    elif p.grad is not None:
        p.grad.copy_(value)
    else:
        p.grad = value.clone()


def tied_embedding_copies(chunks: Sequence[torch.nn.Module]) -> List[torch.nn.Parameter]:
    """This rank's parameters whose global name is the word embedding (1 or 2 copies)."""
    out = []
    for c in chunks:
        for _, p in unwrap(c).named_parameters():
            if p.mzb_global_name == "embedding.word_embeddings.weight":
                out.append(p)
    return out


def _sum_local_tied_copies(chunks) -> None:
    copies = tied_embedding_copies(chunks)
    if len(copies) < 2:
        return
    grads = [_grad_of(p) for p in copies]
    present = [g for g in grads if g is not None]
    if not present:
        return
    total = present[0].clone()
    for g in present[1:]:
        total.add_(g)
    for p in copies:
        _set_grad(p, total)


def _is_ddp(chunk) -> bool:
    return hasattr(chunk, "finish_grad_sync") and hasattr(chunk, "ddp_config")


def finalize_model_grads_for(model: List[torch.nn.Module], num_tokens: Optional[torch.Tensor] = None,
                             pg_collection=None, force_all_reduce: Optional[bool] = False, *,
                             placement: Optional[Placement] = None, **_ignored) -> None:
    """``config.finalize_model_grads_func`` for any placement, with or without megatron DDP.

    DDP chunks: megatron's ``finalize_model_grads`` (DP reduce, sequence-parallel norm grads,
    embedding-group sum). Plain chunks: the same sums done on ``param.grad``. Then, where the
    embedding and the output copy live on this rank in two chunks (V placement), their
    gradients are summed locally. ``num_tokens`` (``calculate_per_token_loss``) is broadcast from
    the rank that holds the last stage (rank 0 for V, not megatron's last pipeline rank).
    """
    from megatron.core import parallel_state
    model = list(model)
    v_like = placement is not None and _embedding_and_loss_on_one_rank(placement)
    if all(_is_ddp(c) for c in model):
        from megatron.core.distributed import finalize_model_grads
        kw = {}
        if force_all_reduce:
            kw["force_all_reduce"] = force_all_reduce
        if pg_collection is not None:
            kw["pg_collection"] = pg_collection
        finalize_model_grads(model, None if v_like else num_tokens, **kw)
        if not v_like:
            num_tokens = None  # megatron scaled already
    else:
        _plain_finalize(model)
    _sum_local_tied_copies(model)
    if num_tokens is not None:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        src_pp = placement.rank_of(placement.num_stages - 1) if placement is not None else \
            parallel_state.get_pipeline_model_parallel_world_size() - 1
        src = torch.distributed.get_process_group_ranks(pp_group)[src_pp]
        torch.distributed.broadcast(num_tokens, src=src, group=pp_group)
        torch.distributed.all_reduce(num_tokens, group=parallel_state.get_data_parallel_group())
        if num_tokens > 0:
            for c in model:
                for p in c.parameters():
                    g = _grad_of(p)
                    if g is not None:
                        g.mul_(1.0 / num_tokens)


def _plain_finalize(model) -> None:
    """Without DDP: DP average, sequence-parallel norm grads over TP, embedding group sum."""
    from megatron.core import parallel_state
    dist = torch.distributed
    dp = parallel_state.get_data_parallel_group()
    if dist.get_world_size(dp) > 1:
        for c in model:
            for p in c.parameters():
                g = _grad_of(p)
                if g is not None:
                    dist.all_reduce(g, group=dp)
                    g.div_(dist.get_world_size(dp))
    tp = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(tp) > 1:
        for c in model:
            for p in c.parameters():
                if getattr(p, "sequence_parallel", False):
                    g = _grad_of(p)
                    if g is not None:
                        dist.all_reduce(g, group=tp)
    emb = parallel_state.get_embedding_group(check_initialized=False) \
        if _accepts_check(parallel_state.get_embedding_group) else parallel_state.get_embedding_group()
    if emb is not None and dist.get_world_size(emb) > 1 and dist.get_rank() in dist.get_process_group_ranks(emb):
        copies = tied_embedding_copies(model)
        if copies:
            p = copies[0]
            g = _grad_of(p)
            if g is None:
                g = torch.zeros_like(p)
                p.grad = g
            dist.all_reduce(g, group=emb)


def _accepts_check(fn) -> bool:
    import inspect
    try:
        return "check_initialized" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


@torch.no_grad()
def collect_full_grads(chunks: Sequence[torch.nn.Module], *, gather_tp: bool = True,
                       params: bool = False) -> Dict[str, List[torch.Tensor]]:
    """{global name: [full gradient of each copy on this rank]} (TP shards all-gathered).

    Collective over the tensor-parallel group when TP > 1 (every TP rank must call it); only TP
    rank 0 returns entries. With ``params=True`` the parameter values are collected instead.
    """
    from megatron.core import parallel_state
    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    group = parallel_state.get_tensor_model_parallel_group()
    out: Dict[str, List[torch.Tensor]] = {}
    for c in chunks:
        for _, p in unwrap(c).named_parameters():
            t = p.detach() if params else _grad_of(p)
            t = torch.zeros_like(p) if t is None else t.detach()
            if tp > 1 and gather_tp and getattr(p, "tensor_model_parallel", False):
                parts = [torch.empty_like(t) for _ in range(tp)]
                torch.distributed.all_gather(parts, t.contiguous(), group=group)
                t = torch.cat(parts, dim=int(p.partition_dim))
            if tp_rank == 0:
                out.setdefault(p.mzb_global_name, []).append(t.clone())
    return out


def zero_grads_(chunks: Sequence[torch.nn.Module]) -> None:
    for c in chunks:
        if hasattr(c, "zero_grad_buffer"):
            c.zero_grad_buffer()
        for p in c.parameters():
            p.grad = None


@torch.no_grad()
def sgd_step_(chunks: Sequence[torch.nn.Module], lr: float) -> None:
    """p -= lr * grad (``main_grad`` under DDP). Identical on the reference and pipelined runs."""
    for c in chunks:
        for p in c.parameters():
            g = _grad_of(p)
            if g is not None:
                p.data.add_(g.to(p.dtype), alpha=-lr)


# --------------------------------------------------------------------------------------------
# data and the forward step
# --------------------------------------------------------------------------------------------

def _mb_lengths(cfg: TinyGPTConfig, num_microbatches: int, iteration: int) -> List[int]:
    if not cfg.variable_seq_lengths:
        return [cfg.seq_length] * num_microbatches
    g = torch.Generator().manual_seed(_name_seed(f"lengths/{iteration}", cfg.seed))
    lo = max(4, (cfg.seq_length // 2) // 4 * 4)
    choices = list(range(lo, cfg.seq_length + 1, 4)) or [cfg.seq_length]
    return [choices[int(i)] for i in torch.randint(len(choices), (num_microbatches,), generator=g)]


def make_batches(cfg: TinyGPTConfig, num_microbatches: int, iteration: int = 0) -> List[Dict[str, torch.Tensor]]:
    """Deterministic synthetic GPT microbatches for one iteration (same on every rank and run).

    Each: tokens, labels (next token), loss_mask (float, some positions 0), position_ids
    ([b, s] each); attention_mask None (causal).
    """
    out = []
    lengths = _mb_lengths(cfg, num_microbatches, iteration)
    for mb, s in enumerate(lengths):
        g = torch.Generator().manual_seed(_name_seed(f"batch/{iteration}/{mb}", cfg.seed))
        b = cfg.micro_batch_size
        seq = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=g)
        mask = (torch.rand((b, s), generator=g) >= cfg.loss_mask_prob).float()
        mask[:, 0] = 1.0  # never an empty microbatch
        out.append({
            "tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous(), "loss_mask": mask,
            "position_ids": torch.arange(s).unsqueeze(0).expand(b, s).contiguous(), "attention_mask": None,
        })
    return out


def batch_iterators(batches: Sequence[dict], num_chunks: int) -> List[Iterator]:
    """One iterator per model chunk, each over the same microbatches (megatron's convention)."""
    return [iter(list(batches)) for _ in range(num_chunks)]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's 3-tuple loss: (sum of masked per-token losses, token count, report dict)."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().clone().view(1), num_tokens.detach().float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step_func(data_iterator, model):
    """megatron forward_step_func: next microbatch -> (output, loss_func partial)."""
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def iteration_loss(loss_dicts: Sequence[dict]) -> Optional[float]:
    """Per-token loss of one iteration from the dicts megatron's schedules return (last stage)."""
    tot, n = 0.0, 0.0
    for d in loss_dicts or []:
        r = d["lm loss"]
        tot += float(r[0])
        n += float(r[1])
    return None if n == 0 else tot / n
