"""A tiny real megatron-core GPT, its data, and the scaffolding the harness trains it with.

This is the model ``megatron-zb verify`` and the runtime tests train: stock megatron-core
(``GPTModel`` with the local layer spec, its core attention torch's SDPA with ``attention_backend``
flash/fused; fp32, CPU init, no dropout) built per rank under any
stage placement with ``megatron_zb.megatron.layout.placement`` (layer table, global names, identical
initial weights for every placement, TP size and the single-process reference), plus
deterministic synthetic microbatches, Megatron's 3-tuple loss, gradient collection by global
name and a plain SGD step identical on the reference and the pipelined runs.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Dict, Iterator, List, Optional, Sequence

import torch

from ...core.ir import Placement, ScheduleError
from ...megatron.cpu.local_spec import layer_spec
from ...megatron.execution.finalize import grad_of, mark_replica_copies
from ...megatron.features.balanced import packed_seq_params
from ...megatron.features.sdpa_attention import core_attention_for
from ...megatron.layout.placement import (ChunkInfo, attach_layer_table, chunk_infos, deterministic_init_,
                                          embedding_ranks, is_expert_param, name_params, name_seed, unwrap)

__all__ = [
    "TinyGPTConfig", "megatron_version", "init_parallel_state", "destroy_parallel_state",
    "make_transformer_config", "ChunkOptions", "build_model_chunks", "build_reference_model", "wrap_ddp",
    "collect_full_grads", "take_aux_losses", "zero_grads_", "sgd_step_", "make_batches", "batch_iterators", "loss_func",
    "forward_step_func", "iteration_loss", "iteration_loss_parts",
]


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
    skewed_lengths: bool = False  # with variable_seq_lengths: 4..seq_length, most of them short (a long tail)
    packed_attention: bool = False  # attention that takes packed sequences (THD; megatron.cpu.local_spec)
    attention_backend: str = "auto"  # Megatron's --attention-backend: flash/fused = torch's SDPA (features.flags.attention)
    loss_mask_prob: float = 0.1  # fraction of label positions masked out of the loss

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def megatron_version() -> str:
    try:
        from megatron.core import package_info
        return str(package_info.__version__)
    except Exception:  # pragma: no cover
        return "unknown"


def init_parallel_state(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                        placement: Optional[Placement] = None, seed: int = 1234,
                        expert_model_parallel_size: int = 1, vocab_parallel: bool = False) -> None:
    """(Re)initialise megatron's ``parallel_state`` for TP x PP (x EP) over the current world.

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
    v = placement.models_per_rank
    kwargs = dict(tensor_model_parallel_size=tensor_parallel_size,
                  pipeline_model_parallel_size=pipeline_parallel_size,
                  virtual_pipeline_model_parallel_size=(v if v > 1 else None),
                  expert_model_parallel_size=expert_model_parallel_size,
                  create_gloo_process_groups=False)
    emb = embedding_ranks(placement, vocab_parallel)
    if emb is not None:
        kwargs["get_embedding_ranks"] = emb
    parallel_state.initialize_model_parallel(**kwargs)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel_state() -> None:
    """Megatron's ``destroy_model_parallel`` and the torch process groups behind it (all but WORLD).

    Megatron only drops its references (and destroys its gloo copies), so every re-initialisation
    would leave each group's gloo threads running: a process that initialises many times (verify,
    the tests) slows to a crawl. Collective when torch.distributed is up: every rank calls it, as
    every rank calls ``init_parallel_state``.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from ...runtime.p2p import registered_groups
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


# -- building ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ChunkOptions:
    """Which chunks ``build_model_chunks`` builds and how: for placement rank ``pp_rank`` (None: this
    process's pipeline rank; a single process may build any rank's chunks, e.g. to check a
    placement), the layers of each stage (None: even; ``allow_padding_num_layers``: Megatron's
    padding), initialised (``init``), the output layer split over the ranks (``vocab_parallel``;
    ``vocab_embedding``: the input embedding too), each stage's first layers recomputed in B
    (``recompute_layers``: one count per stage in pipeline order, ``megatron.features.recompute``)."""

    pp_rank: Optional[int] = None
    layers_per_stage: Optional[Sequence[int]] = None
    allow_padding_num_layers: bool = False
    init: bool = True
    vocab_parallel: bool = False
    vocab_embedding: bool = False
    recompute_layers: Optional[Sequence[int]] = None


def build_model_chunks(model_cfg: TinyGPTConfig, placement: Placement, options: Optional[ChunkOptions] = None, *,
                       config=None, **config_kw) -> List[torch.nn.Module]:
    """Build this rank's model chunks (``GPTModel`` each, ordered by stage) and initialise them.

    ``options``: which rank's chunks, their layers, initialised, vocabulary parallelism (``ChunkOptions``).
    ``config``: a TransformerConfig (default: ``make_transformer_config(model_cfg, ...)`` with the
    current TP/PP sizes and ``config_kw``). Each chunk gets ``chunk.mzb_chunk_info`` (a ``ChunkInfo``) and
    each parameter a ``mzb_global_name``. The chunks share one config, which carries the layer table.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    o = options if options is not None else ChunkOptions()
    vocab_parallel, vocab_embedding = o.vocab_parallel, o.vocab_embedding
    own_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_rank = own_rank if o.pp_rank is None else o.pp_rank
    layer_kw = dict(layers_per_stage=o.layers_per_stage, allow_padding_num_layers=o.allow_padding_num_layers)
    infos = chunk_infos(placement, model_cfg.num_layers, pp_rank, **layer_kw)
    if config is None:
        config = make_transformer_config(
            model_cfg, tensor_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
            pipeline_parallel_size=placement.num_ranks, chunks=placement.models_per_rank, **config_kw)
    if getattr(config, "pipeline_model_parallel_layout", None) is not None:
        raise ScheduleError("pipeline_model_parallel_layout is not supported with megatron-zb placements")
    attach_layer_table(config, placement, model_cfg.num_layers, placement_rank=pp_rank, own_rank=own_rank,
                       **layer_kw)
    multi = placement.models_per_rank > 1
    chunks = []
    for info in infos:
        spec = layer_spec(config, len(info.layers), packed=model_cfg.packed_attention,
                          core_attention=core_attention_for(model_cfg.attention_backend))
        extra = {}
        if getattr(config, "mtp_num_layers", None) and info.post_process:  # MTP: on the loss stage
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
            extra["mtp_block_spec"] = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False,
                                                             vp_stage=(info.vp_stage if multi else None))
        model = GPTModel(
            config=config, transformer_layer_spec=spec, **extra,
            vocab_size=model_cfg.vocab_size, max_sequence_length=model_cfg.seq_length,
            pre_process=info.pre_process, post_process=info.post_process,
            share_embeddings_and_output_weights=model_cfg.tie_embeddings,
            position_embedding_type=model_cfg.position_embedding_type,
            vp_stage=(info.vp_stage if multi else None),
        )
        model.mzb_chunk_info = info
        _check_layers(model, info)
        if o.recompute_layers is not None:  # the chunk's own count (the chunks share one config)
            from ...megatron.features.recompute import recompute_chunk
            recompute_chunk(model, o.recompute_layers[info.stage])
        name_params(model, info, model_cfg.tie_embeddings)
        chunks.append(model)
    if vocab_parallel:  # the output layer as every rank's shard (megatron.vocab_parallel)
        from ...megatron.features import vocab_parallel as VP
        for m, info in zip(chunks, infos):
            if info.post_process:
                VP.prepare_loss_chunk(m)
        shard = VP.ShardSpec(vocab_size=model_cfg.vocab_size, hidden=model_cfg.hidden_size, p=placement.num_ranks,
                             tp=parallel_state.get_tensor_model_parallel_world_size(), pp_rank=pp_rank,
                             tp_rank=parallel_state.get_tensor_model_parallel_rank(), tied=model_cfg.tie_embeddings,
                             dtype=config.params_dtype, device=next(chunks[0].parameters()).device)
        VP.attach_shard(chunks[0], shard)
    if vocab_parallel and vocab_embedding:  # the input embedding's rows on every rank (megatron.vocab_embedding)
        from ...megatron.features import vocab_embedding as VE
        VE.attach_input_shard(chunks[0], shard)
    if o.init:
        deterministic_init_(chunks, model_cfg.seed, model_cfg.init_std)
    if vocab_parallel and vocab_embedding:  # the first stage keeps no whole embedding
        VE.drop_embedding(chunks)
    mark_replica_copies(chunks, placement)
    return chunks

def _check_layers(model, info: ChunkInfo) -> None:
    layers = list(model.decoder.layers)
    got = [int(l.layer_number) - 1 for l in layers]
    if got != list(info.layers):
        raise RuntimeError(f"stage {info.stage}: megatron built layers {got}, expected {list(info.layers)} "
                           "(layer-table hooks not effective?)")


def build_reference_model(model_cfg: TinyGPTConfig, **config_kw) -> torch.nn.Module:
    """The whole model as one chunk (PP=1, TP=1 must be initialised); initialised like the rest."""
    return build_model_chunks(model_cfg, Placement.single(1), **config_kw)[0]


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




@torch.no_grad()
def collect_full_grads(chunks: Sequence[torch.nn.Module], *, gather_tp: bool = True,
                       params: bool = False) -> Dict[str, List[torch.Tensor]]:
    """{global name: [full gradient of each copy on this rank]} (TP shards all-gathered).

    Collective over the tensor-parallel group when TP > 1 (every TP rank must call it; expert
    parameters gather over the expert tensor-parallel group); only TP rank 0 returns entries. With
    ``params=True`` the parameter values are collected instead.
    """
    from megatron.core import parallel_state
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    out: Dict[str, List[torch.Tensor]] = {}
    for c in chunks:
        for _, p in unwrap(c).named_parameters():
            t = p.detach() if params else grad_of(p)
            t = torch.zeros_like(p) if t is None else t.detach()
            if getattr(p, "mzb_vocab_rows", None) is not None:  # a vocabulary shard: every shard's rows
                t = _gathered_shards(p, t)
                if t is not None:
                    out.setdefault(p.mzb_global_name, []).append(t)
                continue
            if gather_tp and getattr(p, "tensor_model_parallel", False):
                group = (parallel_state.get_expert_tensor_parallel_group() if is_expert_param(p)
                         else parallel_state.get_tensor_model_parallel_group())
                n = torch.distributed.get_world_size(group) if group is not None else 1
                if n > 1:
                    parts = [torch.empty_like(t) for _ in range(n)]
                    torch.distributed.all_gather(parts, t.contiguous(), group=group)
                    t = torch.cat(parts, dim=int(p.partition_dim))
            if tp_rank == 0:
                out.setdefault(p.mzb_global_name, []).append(t.clone())
    return out


def _gathered_shards(p, t: torch.Tensor) -> Optional[torch.Tensor]:
    """The whole output layer (or tied embedding) from every rank's vocabulary shard, on the
    shard holding row 0 (None elsewhere). Collective over the shards' group."""
    group = getattr(p, "mzb_vocab_group", None)
    v0, _, vocab = p.mzb_vocab_rows
    if group is None and t.shape[0] != vocab:  # before the first call made the passes' groups: the replica's
        from megatron.core import parallel_state
        group = parallel_state.get_model_parallel_group()
    if group is None:
        return t.clone()
    n = torch.distributed.get_world_size(group)
    parts = [torch.empty_like(t) for _ in range(n)]
    starts = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    torch.distributed.all_gather(starts, torch.tensor([v0], dtype=torch.int64), group=group)
    if v0 != 0:
        return None
    full = torch.empty(vocab, t.shape[1], dtype=t.dtype, device=t.device)
    for s, part in zip(starts, parts):
        full[int(s):int(s) + part.shape[0]] = part
    return full


def take_aux_losses() -> Dict[str, Dict[int, float]]:
    """MoE's auxiliary losses of the last forward-backward, {name: {global layer: summed value}},
    as megatron's layer-wise tracker holds them on this rank (its microbatches, its layers); the
    tracker is cleared. Empty without MoE."""
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:  # pragma: no cover
        return {}
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    out: Dict[str, Dict[int, float]] = {}
    for name, entry in tracker.items():
        values = entry.get("values") if isinstance(entry, dict) else None
        if values is None:
            continue
        out[name] = {i: float(v) for i, v in enumerate(values.detach().float().tolist()) if v != 0.0}
    moe_utils.clear_aux_losses_tracker()
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
            g = grad_of(p)
            if g is not None:
                p.data.add_(g.to(p.dtype), alpha=-lr)


# --------------------------------------------------------------------------------------------
# data and the forward step
# --------------------------------------------------------------------------------------------

def _mb_lengths(cfg: TinyGPTConfig, num_microbatches: int, iteration: int) -> List[int]:
    if not cfg.variable_seq_lengths:
        return [cfg.seq_length] * num_microbatches
    g = torch.Generator().manual_seed(name_seed(f"lengths/{iteration}", cfg.seed))
    if cfg.skewed_lengths:  # u^3 of a uniform u: a few long microbatches among many short ones
        u = torch.rand((num_microbatches,), generator=g) ** 3
        return [4 + 4 * int(round(float(x) * (cfg.seq_length - 4) / 4)) for x in u]
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
        g = torch.Generator().manual_seed(name_seed(f"batch/{iteration}/{mb}", cfg.seed))
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
    """One iterator per model chunk, each over the same microbatches (megatron's convention).
    Each item is a fresh copy, as a real data loader's batch is (megatron's ``get_batch`` moves it
    to the GPU): what autograd saves of it (token ids, the loss mask) lives as long as the passes
    that keep it, not the whole iteration in ``batches`` (the activation meter counts it)."""
    def fresh(items):
        for b in items:
            yield {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in b.items()}
    return [fresh(list(batches)) for _ in range(num_chunks)]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's 3-tuple loss: (sum of masked per-token losses, token count, report dict)."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.cat([loss.detach().clone().view(1), num_tokens.detach().float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def forward_step_func(data_iterator, model, return_schedule_plan: bool = False):
    """megatron forward_step_func: next microbatch -> (output, loss_func partial); with
    ``return_schedule_plan`` (megatron's EP overlap) the chunk's schedule plan instead of its output."""
    batch = next(data_iterator)
    if return_schedule_plan:
        plan = model.build_schedule_plan(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                                         labels=batch["labels"])
        return plan, partial(loss_func, batch["loss_mask"])
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
                   packed_seq_params=packed_seq_params(batch))
    return output, partial(loss_func, batch["loss_mask"])


def iteration_loss_parts(loss_dicts: Sequence[dict]):
    """(sum of the masked per-token losses, token count) of one iteration's loss dicts."""
    tot, n = 0.0, 0.0
    for d in loss_dicts or []:
        r = d["lm loss"]
        tot += float(r[0])
        n += float(r[1])
    return tot, n


def iteration_loss(loss_dicts: Sequence[dict]) -> Optional[float]:
    """Per-token loss of one iteration from the dicts megatron's schedules return (last stage)."""
    tot, n = 0.0, 0.0
    for d in loss_dicts or []:
        r = d["lm loss"]
        tot += float(r[0])
        n += float(r[1])
    return None if n == 0 else tot / n
