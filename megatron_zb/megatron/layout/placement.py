"""V (and any other) stage placement for a user's megatron-core model: what each rank builds.

A stage is a global model-chunk index in pipeline order (stage 0 holds the embedding, stage S-1
the output layer and loss). ``'single'`` puts stage r on rank r, ``'looped'`` is Megatron's
interleaving (stage s on rank s % p, v chunks per rank) and ``'v'`` puts stages r and 2p-1-r on
rank r, so rank 0 holds both the embedding and the loss. A rank's chunks are ordered by stage; a
chunk's index on its rank is its ``vp_stage``.

* **Layers.** Each stage holds a contiguous slice of the global layer list (``stage_layer_counts``;
  uneven splits via ``layers_per_stage`` or ``allow_padding_num_layers``, which, like the ZB
  authors' flag, gives the first and the last stage one layer less). megatron-core computes a
  chunk's layer count and global layer offset assuming looped placement and even splits
  (``get_num_layers_to_build`` / ``get_transformer_layer_offset``). ``install_layer_hooks`` wraps
  both functions (in the modules that bound them; megatron's files are untouched) so that a config
  carrying a layer table (``attach_layer_table``) answers from it, keyed by (pipeline rank,
  vp_stage); other configs fall through to megatron. So V chunks get their true global
  ``layer_number`` (used e.g. by attention scaling and by checkpoint names).
* **Global names.** Every parameter gets the name it has in the whole model
  (``decoder.layers.<global index>.…``, ``embedding.word_embeddings.weight``, …; attribute
  ``param.mzb_global_name``). ``deterministic_init_`` draws each parameter's initial value from a
  generator seeded by a hash of that name, as the full (un-sharded) tensor, then slices the
  rank's tensor-parallel shard: every placement and TP size starts from identical weights
  (``--zero-bubble-deterministic-init``).
* **Tied embedding/output weights** and replicated stages: their gradients are put right in
  ``megatron.execution.finalize``.
"""
from __future__ import annotations

import hashlib
import re
import sys
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ...core.ir import Placement, ScheduleError

__all__ = [
    "ChunkInfo", "make_placement", "stage_layer_counts", "stage_layer_ranges", "chunk_infos",
    "placement_layer_table", "embedding_and_loss_on_one_rank", "embedding_ranks", "install_layer_hooks",
    "attach_layer_table", "global_param_name", "name_params", "expert_offset", "is_expert_param", "unwrap",
    "name_seed", "init_tensor",
    "deterministic_init_", "float16_chunks",
]


# --------------------------------------------------------------------------------------------
# placement and layers (no megatron import needed)
# --------------------------------------------------------------------------------------------

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
    """'single' (1 chunk per rank), 'looped' (``chunks`` per rank, stage s on rank s % p), 'v', or
    'bitpipe' (two V pipelines in opposite directions: 2 chunks per rank and direction, 4 built)."""
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
    if style == "bitpipe":
        if chunks not in (None, 2):
            raise ScheduleError(f"'bitpipe' placement has 2 chunks per rank and direction, got chunks={chunks}")
        return Placement.bitpipe(p)
    raise ScheduleError(f"unknown placement {style!r}; use 'single', 'looped', 'v' or 'bitpipe'")


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
    """The chunks ``pp_rank`` builds, ordered by stage (index = vp_stage). With replicated stages
    the layers come from the chunk's logical stage (its copies hold the same layers) and
    ``num_stages`` counts logical stages."""
    S = placement.num_logical_stages
    ranges = stage_layer_ranges(num_layers, S, **layer_kw)
    out = []
    for vp, s in enumerate(placement.stages_of(pp_rank)):
        l = placement.logical(s)
        out.append(ChunkInfo(stage=s, vp_stage=vp, rank=pp_rank, layers=tuple(ranges[l]),
                             pre_process=(l == 0), post_process=(l == S - 1), num_stages=S))
    return out


def placement_layer_table(placement: Placement, num_layers: int, **layer_kw) -> Dict[Tuple[int, int], Tuple[int, int]]:
    """(pp_rank, vp_stage) -> (global layer offset, layer count) for every chunk of every rank."""
    table = {}
    for r in range(placement.num_ranks):
        for info in chunk_infos(placement, num_layers, r, **layer_kw):
            table[(r, info.vp_stage)] = (info.layer_offset, len(info.layers))
    return table


# --------------------------------------------------------------------------------------------
# megatron glue: embedding group, layer table
# --------------------------------------------------------------------------------------------

def embedding_and_loss_on_one_rank(placement: Placement) -> bool:
    """True where one rank holds both the embedding and the loss stage (V placement)."""
    return placement.num_ranks > 1 and placement.rank_of(0) == placement.rank_of(placement.num_stages - 1)


def embedding_ranks(placement: Placement, vocab_parallel: bool = False):
    """``get_embedding_ranks`` for megatron's ``initialize_model_parallel`` where the embedding and
    the tied output layer live on one rank (V): the group is that rank alone. Also for replicated
    stages (BitPipe: each direction's embedding and output layer share a rank; the replica
    gradient sync joins the directions): a cross-rank embedding group would sum twice; and with
    vocabulary parallelism (the tied copies are every rank's shards, summed by
    ``megatron.features.vocab_parallel``). None otherwise (megatron's default: first and last pipeline rank)."""
    if not (vocab_parallel or placement.style == "v" or placement.replicated
            or embedding_and_loss_on_one_rank(placement)):
        return None
    first = placement.rank_of(0)

    def get_embedding_ranks(pp_ranks, *_a, **_k):
        return [pp_ranks[first]]
    return get_embedding_ranks


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
                "set by megatron_zb.megatron.layout.placement.attach_layer_table)"
        # rebind everywhere megatron imported the originals by name
        for name, mod in list(sys.modules.items()):
            if mod is None or not (name == "megatron" or name.startswith("megatron.")):
                continue
            d = getattr(mod, "__dict__", {})
            if d.get("get_transformer_layer_offset") is orig_offset:
                setattr(mod, "get_transformer_layer_offset", get_transformer_layer_offset)
            if d.get("get_num_layers_to_build") is orig_count:
                setattr(mod, "get_num_layers_to_build", get_num_layers_to_build)



def attach_layer_table(config, placement: Placement, num_layers: int, *, placement_rank: int,
                       own_rank: Optional[int] = None, **layer_kw) -> None:
    """Make megatron's layer count/offset functions answer from ``placement`` for models built
    with ``config`` (``install_layer_hooks`` must have run). ``placement_rank``: the rank whose
    chunks are built; ``own_rank``: this process's pipeline rank (None: ask parallel_state)."""
    install_layer_hooks()
    config._mzb_layers = {"own_rank": own_rank, "placement_rank": placement_rank,
                          "table": placement_layer_table(placement, num_layers, **layer_kw),
                          "placement": placement}


# --------------------------------------------------------------------------------------------
# global parameter names and deterministic initialisation
# --------------------------------------------------------------------------------------------

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT_RE = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def global_param_name(local_name: str, info: ChunkInfo, tie_embeddings: bool, expert_offset: int = 0) -> str:
    """The name a chunk parameter has in the whole (unpipelined) model. ``expert_offset``: the global
    index of this rank's first local expert (expert parallelism shards the experts over ranks)."""
    name = local_name
    while name.startswith("module."):
        name = name[len("module."):]
    m = _LAYER_RE.match(name)
    if m:
        i = int(m.group(1))
        if i >= len(info.layers):
            raise RuntimeError(f"stage {info.stage} has {len(info.layers)} layers, got parameter {local_name}")
        rest = m.group(2)
        e = _EXPERT_RE.match(rest)
        if e and expert_offset:
            rest = f"{e.group(1)}{int(e.group(2)) + expert_offset}{e.group(3)}"
        return f"decoder.layers.{info.layers[i]}.{rest}"
    if name == "output_layer.weight" and tie_embeddings:
        return "embedding.word_embeddings.weight"  # the tied copy
    return name


def expert_offset(config) -> int:
    """Global index of this rank's first local expert (0 without MoE or expert parallelism)."""
    n = getattr(config, "num_moe_experts", None)
    if not n:
        return 0
    from megatron.core import parallel_state
    ep = parallel_state.get_expert_model_parallel_world_size()
    return parallel_state.get_expert_model_parallel_rank() * (n // ep) if ep > 1 else 0


def is_expert_param(param) -> bool:
    """megatron marks expert-parallel parameters ``allreduce=False`` (reduced over expert DP only)."""
    return not getattr(param, "allreduce", True)


def name_params(model, info: ChunkInfo, tie_embeddings: bool) -> None:
    """Set ``mzb_global_name`` / ``mzb_stage`` on every parameter of one chunk."""
    offset = expert_offset(getattr(model, "config", None))
    for n, p in model.named_parameters():
        p.mzb_global_name = global_param_name(n, info, tie_embeddings, offset)
        p.mzb_stage = info.stage


def unwrap(model):
    """The GPTModel under DDP/Float16 wrappers."""
    while hasattr(model, "module") and not hasattr(model, "mzb_chunk_info"):
        model = model.module
    return model


def float16_chunks(config, chunks: Sequence[torch.nn.Module]) -> List[torch.nn.Module]:
    """Megatron's ``Float16Module`` around each chunk, deciding "first stage" (cast the inputs)
    and "last stage" (upcast the output to fp32) from the chunk's own stage. Megatron's decides
    from the pipeline rank and the virtual index, which is right for its looped placement only:
    on a V placement it would upcast rank P-1's second chunk (stage P, an intermediate one) and
    send fp32 where the next rank expects ``pipeline_dtype``."""
    from megatron.core.transformer.module import Float16Module, float16_to_fp32, fp32_to_float16
    out = []
    for c in chunks:
        info = unwrap(c).mzb_chunk_info
        w = Float16Module(config, c)

        def forward(*inputs, fp32_output=True, _w=w, _info=info, **kwargs):
            if _info.pre_process:
                inputs = fp32_to_float16(inputs, _w.float16_convertor)
            outputs = _w.module(*inputs, **kwargs)
            if _info.post_process and fp32_output is True:
                outputs = float16_to_fp32(outputs)
            return outputs
        w.forward = forward
        out.append(w)
    return out


def name_seed(global_name: str, seed: int) -> int:
    h = hashlib.sha256(f"{seed}:{global_name}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def init_tensor(global_name: str, full_shape: Sequence[int], seed: int = 1234, std: float = 0.05) -> torch.Tensor:
    """The full (un-sharded) initial value of a parameter, a function of its global name only."""
    g = torch.Generator(device="cpu")
    g.manual_seed(name_seed(global_name, seed))
    x = torch.randn(tuple(full_shape), generator=g, dtype=torch.float32)
    leaf = global_name.rsplit(".", 1)[-1]
    if len(full_shape) == 1 and "norm" in global_name and leaf == "weight":
        return 1.0 + 0.1 * x  # norm scales near 1
    if len(full_shape) == 1:
        return 0.02 * x  # biases, norm shifts
    return std * x


def _tp_rank_size(param) -> Tuple[int, int]:
    """(rank, size) of the tensor-parallel group that shards ``param``: the expert TP group for
    expert parameters, the TP group otherwise."""
    from megatron.core import parallel_state
    if is_expert_param(param):
        return (parallel_state.get_expert_tensor_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_world_size())
    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


def _tp_slice(param, full: torch.Tensor) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False):
        return full
    r, _ = _tp_rank_size(param)
    dim = int(param.partition_dim)
    if int(getattr(param, "partition_stride", 1)) != 1:
        raise NotImplementedError(f"{param.mzb_global_name}: partition_stride != 1 not supported")
    n = param.shape[dim]
    return full.narrow(dim, r * n, n)


def _full_shape(param) -> Tuple[int, ...]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[int(param.partition_dim)] *= _tp_rank_size(param)[1]
    return tuple(shape)


@torch.no_grad()
def deterministic_init_(chunks: Sequence[torch.nn.Module], seed: int = 1234, std: float = 0.05) -> None:
    """Overwrite every parameter with ``init_tensor(global name)`` sliced for this TP rank."""
    for chunk in chunks:
        for _, p in unwrap(chunk).named_parameters():
            rows = getattr(p, "mzb_vocab_rows", None)
            if rows is not None:  # a vocabulary shard: its rows of the whole output layer / embedding
                v0, v1, vocab = rows
                p.data.copy_(init_tensor(p.mzb_global_name, (vocab, p.shape[1]), seed, std)[v0:v1])
                continue
            full = init_tensor(p.mzb_global_name, _full_shape(p), seed, std)
            p.data.copy_(_tp_slice(p, full))
