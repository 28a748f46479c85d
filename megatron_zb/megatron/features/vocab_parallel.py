"""Vocabulary parallelism on megatron-core models (``--enable-vocab-parallel``; the passes:
``runtime.features.vocab``, their place in the schedule: ``core.ir.vocab``).

* **The shards.** Every pipeline rank holds rows of the output layer: V / (P x TP) of them, rank
  (pp, tp) rows tp x V/TP + pp x V/(P x TP) onwards (within one tensor-parallel slice the pipeline
  ranks cover that slice's rows of the embedding, so tied weights line up). The shard is a
  parameter of the rank's first model chunk (``mzb_vocab_shard.weight``), so Megatron's DDP, its
  optimizer, clipping and checkpoints see it like any weight (marked tensor-parallel: every TP rank
  holds different rows). Its global name is the output layer's, or with tied embeddings the word
  embedding's; ``mzb_vocab_rows`` says which rows.
* **The loss chunk** keeps its final norm and loses its output layer: its forward returns the
  hidden states instead of the loss, and the labels the model was given are kept for the
  vocabulary passes (``prepare_loss_chunk``). The user's loss function runs on the per-token
  losses the passes compute, through Megatron's own ``forward_step_calc_loss`` (its scaling, the
  token counts, the loss dict), once the statistics are in (``VocabParallel.loss_step``).
* **Tied embeddings**: the word embedding on the first stage and the shards on every rank are
  copies of the same rows; before the optimizer step their gradients are summed over the pipeline
  group (``sync_tied_gradients``), so every copy gets the same update.
"""
from __future__ import annotations

import dataclasses
import datetime
import types
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ...core.ir import Placement
from ...runtime.features.vocab import VocabConfig, VocabGroups, VocabRuntime
from ..errors import ZeroBubbleConfigError

__all__ = ["VocabShard", "ShardSpec", "shard_rows", "prepare_loss_chunk", "attach_shard", "find_shard", "VocabParallel",
           "sync_tied_gradients", "adopt_chunk", "init_shard", "scatter_embedding_rows", "SHARD_ATTR"]

SHARD_ATTR = "mzb_vocab_shard"


class VocabShard(torch.nn.Module):
    """This rank's rows of the output layer (or of the tied word embedding). ``mzb_keys``: the
    global names its rows are saved under (``features.vocab_embedding``: the input embedding's
    too); ``mzb_attr``: the submodule's name on its chunk."""

    def __init__(self, rows: int, hidden: int, dtype: torch.dtype, device, keys=("output_layer.weight",),
                 attr: str = SHARD_ATTR):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(rows, hidden, dtype=dtype, device=device))
        self.mzb_keys, self.mzb_attr = tuple(keys), attr

    def _load_from_state_dict(self, state_dict, prefix, *args, **kw):
        for i in range(1, len(self.mzb_keys)):  # the same rows under another name (saved twice, loaded once)
            state_dict.pop(f"{prefix}weight_as_{i}", None)
        super()._load_from_state_dict(state_dict, prefix, *args, **kw)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Megatron's distributed checkpoints: the shard as its rows of the whole output layer, under
        the output layer's key (``output_layer.weight``, tied embeddings too), so torch_dist reshards
        it: a checkpoint saved with vocabulary parallelism loads without it (untied: Megatron's
        tensor-parallel output layer; tied: the embedding holds the same rows) and the other way
        round (untied; a tied run without it saved no output layer: ``checkpoint_placement`` refuses)."""
        from megatron.core import parallel_state as ps
        from megatron.core.dist_checkpointing import ShardedTensor
        w = self.weight
        v0, v1, vocab = w.mzb_vocab_rows
        rows = v1 - v0
        base = prefix[:-len(self.mzb_attr) - 1] if prefix.endswith(self.mzb_attr + ".") else prefix
        dp = ps.get_data_parallel_rank(with_context_parallel=True)
        return {f"{prefix}weight" + (f"_as_{i}" if i else ""): ShardedTensor.from_rank_offsets(
            f"{base}{key}", w, (0, v0 // rows, vocab // rows), replica_id=(0, 0, dp))
            for i, key in enumerate(self.mzb_keys)}


def shard_rows(vocab_size: int, p: int, tp: int, pp_rank: int, tp_rank: int):
    """(first row, rows) of the (pp_rank, tp_rank) shard of a ``vocab_size`` vocabulary."""
    if vocab_size % (p * tp):
        raise ZeroBubbleConfigError(
            f"--enable-vocab-parallel splits the vocabulary ({vocab_size}, padded) over {p} pipeline x {tp} tensor-"
            f"parallel ranks: make it divisible by {p * tp} (--make-vocab-size-divisible-by)")
    rows = vocab_size // (p * tp)
    return tp_rank * (vocab_size // tp) + pp_rank * rows, rows


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    """This rank's vocabulary shard: the (padded) vocabulary, the hidden size, the pipeline x
    tensor-parallel grid and the rank's place in it, tied embeddings or not, the weight's dtype and device."""

    vocab_size: int
    hidden: int
    p: int
    tp: int
    pp_rank: int
    tp_rank: int
    tied: bool
    dtype: torch.dtype
    device: Any

    def rows(self):
        """(first row, rows) of the shard (``shard_rows``)."""
        return shard_rows(self.vocab_size, self.p, self.tp, self.pp_rank, self.tp_rank)


class _HiddenOut(torch.nn.Module):
    """Stands in for the loss chunk's output layer: the hidden states pass through."""

    def forward(self, hidden_states, weight=None, runtime_gather_output=None, **_):
        return hidden_states, None


class LabelStore:
    """The labels the loss chunk's forward was given, by microbatch (``current`` is set by the pass)."""

    def __init__(self):
        self.current: Optional[int] = None
        self.labels: Dict[int, torch.Tensor] = {}

    def stash(self, labels, hidden):
        if labels is None:
            raise ZeroBubbleConfigError("--enable-vocab-parallel: the loss chunk's forward got no labels (the model "
                                        "must be called with labels=..., as Megatron's pretrain_gpt does)")
        self.labels[self.current] = labels
        return hidden


def prepare_loss_chunk(model) -> None:
    """The loss chunk (a GPTModel with post_process): no output layer; its forward returns the
    hidden states and keeps the labels (``model.mzb_vocab_labels``)."""
    if getattr(model.config, "mtp_num_layers", None):
        raise ZeroBubbleConfigError("--enable-vocab-parallel cannot be combined with --mtp-num-layers yet (the MTP "
                                    "layers compute their loss with the output layer)")
    store = model.mzb_vocab_labels = LabelStore()
    model.output_layer = _HiddenOut()
    model.share_embeddings_and_output_weights = False
    model.compute_language_model_loss = types.MethodType(lambda self, labels, logits: store.stash(labels, logits),
                                                         model)
    model.mzb_vocab_loss_chunk = True
    whole = model.sharded_state_dict

    def sharded_state_dict(self, *a, **k):  # Megatron's, for a chunk without an output layer (the shards hold it)
        self.post_process = False
        try:
            return whole(*a, **k)
        finally:
            self.post_process = True
    model.sharded_state_dict = types.MethodType(sharded_state_dict, model)


def attach_shard(chunk, spec: ShardSpec) -> VocabShard:
    """This rank's shard as a submodule of ``chunk`` (the rank's first model chunk)."""
    v0, rows = spec.rows()
    tied = spec.tied
    shard = VocabShard(rows, spec.hidden, spec.dtype, spec.device)
    setattr(chunk, SHARD_ATTR, shard)
    w = shard.weight
    w.mzb_global_name = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    w.mzb_vocab_rows = (v0, v0 + rows, spec.vocab_size)
    w.tensor_model_parallel = True  # every TP rank holds different rows: clipping counts each
    w.partition_dim, w.partition_stride = 0, 1
    w.allreduce = True
    if tied:  # a copy of the first stage's embedding rows: Megatron's gradient norm counts that once
        w.shared = True
    return shard


def adopt_chunk(model, info, placement: Placement, args) -> None:
    """Training (``megatron.launch.chunks.ChunkPlan``): a chunk Megatron just built, named globally. The
    loss chunk loses its output layer; the rank's first chunk gets the rank's shard (its values:
    ``init_shard`` once the rank's chunks are built, or the deterministic init)."""
    from megatron.core import parallel_state as ps
    tied = not bool(getattr(args, "untie_embeddings_and_output_weights", False))
    if info.post_process:
        prepare_loss_chunk(model)
    if info.vp_stage != 0:
        return
    vocab = int(getattr(args, "padded_vocab_size", None) or model.vocab_size)
    param = next(model.parameters())
    attach_shard(model, ShardSpec(vocab_size=vocab, hidden=int(args.hidden_size), p=placement.num_ranks,
                                  tp=ps.get_tensor_model_parallel_world_size(), pp_rank=info.rank,
                                  tp_rank=ps.get_tensor_model_parallel_rank(), tied=tied, dtype=param.dtype,
                                  device=param.device))


def init_shard(chunks: Sequence[torch.nn.Module], placement: Placement, *, seed: int, std: float) -> None:
    """The rank's shard, once all its chunks are built (every pipeline rank calls it at its last
    chunk). Tied: the embedding's rows, scattered over the pipeline group from the rank that holds
    the embedding (its tensor-parallel slice), so the copies start equal. Untied: drawn like
    Megatron's output layer (normal, ``std``) from a generator seeded by ``seed`` and the shard's
    first row, so every shard differs and a rerun draws the same."""
    from megatron.core import parallel_state as ps
    shard = find_shard(chunks)
    if shard is None:
        raise ZeroBubbleConfigError("--enable-vocab-parallel: the rank's first model chunk got no vocabulary shard")
    v0, _, _ = shard.mzb_vocab_rows
    if shard.mzb_global_name == "output_layer.weight":
        gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(v0))
        with torch.no_grad():
            shard.copy_(torch.empty(shard.shape, dtype=torch.float32).normal_(0.0, float(std), generator=gen))
        return
    scatter_embedding_rows(chunks, placement, shard)


def scatter_embedding_rows(chunks: Sequence[torch.nn.Module], placement: Placement, target) -> None:
    """``target`` (this rank's rows of the embedding) gets them from the rank that holds the embedding
    (its tensor-parallel slice), scattered over the pipeline group (every pipeline rank calls it)."""
    from megatron.core import parallel_state as ps
    group = ps.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    src = ranks[placement.rank_of(0)]
    pieces = None
    if dist.get_rank() == src:
        emb = next(p for c in chunks for _, p in c.named_parameters()
                   if getattr(p, "mzb_vocab_rows", None) is None
                   and getattr(p, "mzb_global_name", "") == "embedding.word_embeddings.weight")
        pieces = [t.contiguous() for t in emb.detach().chunk(len(ranks), dim=0)]
    out = torch.empty_like(target.detach())
    dist.scatter(out, pieces, src=src, group=group)
    with torch.no_grad():
        target.copy_(out)


def find_shard(chunks: Sequence[torch.nn.Module]) -> Optional[torch.nn.Parameter]:
    for c in chunks:
        m = c
        while hasattr(m, "module") and not hasattr(m, SHARD_ATTR):
            m = m.module
        shard = getattr(m, SHARD_ATTR, None)
        if shard is not None:
            return shard.weight
    return None


def _enumerate_groups(mine: List[List[int]]) -> List[List[List[int]]]:
    """Every rank's lists of ranks, gathered: per kind, the distinct groups in one order."""
    everyone: List = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [tuple(x) for x in mine])
    return [sorted({tuple(e[k]) for e in everyone}) for k in range(len(mine))]


class VocabParallel:
    """This rank's vocabulary passes for a run: the groups (made once, by every rank), the runtime,
    and Megatron's loss step on the loss stage's rank."""

    def __init__(self, placement: Placement, barriers: int, timeout_s: float, embedding: bool = False):
        from megatron.core import parallel_state as ps
        self.placement, self.barriers, self.timeout_s = placement, int(barriers), float(timeout_s)
        pp = ps.get_pipeline_model_parallel_group()
        self.made_for = pp  # the parallel state the groups were made in
        mp = ps.get_model_parallel_group()
        pp_ranks = dist.get_process_group_ranks(pp)
        mp_ranks = sorted(dist.get_process_group_ranks(mp))
        me = dist.get_rank()
        pp_groups, mp_groups = _enumerate_groups([pp_ranks, mp_ranks])
        made = {}
        for g in pp_groups:  # every rank makes every group, in the same order
            for kind in ("bcast", "scale") + (("grad",) if self.barriers == 1 else ()):
                pg = dist.new_group(list(g))
                if me in g:
                    made[kind] = pg
        for g in mp_groups:
            for kind in ("stats",) + (("grad",) if self.barriers == 2 else ()):
                pg = dist.new_group(list(g))
                if me in g:
                    made[kind] = pg
        wanted = [(g, k) for g in mp_groups for k in ("itokens", "itotal")] + [(g, "igrad") for g in pp_groups]
        for g, kind in wanted if embedding else ():  # the split embedding's (features.vocab_embedding)
            pg = dist.new_group(list(g))
            if me in g:
                made[kind] = pg
        self.input_groups = {k: v for k, v in made.items() if k.startswith("i")}
        self.inputs = None  # the split embedding's runtime (runtime.features.vocab_input.InputRuntime), bound per call
        self.token_src: Optional[int] = None
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        loss_pp = placement.rank_of(placement.num_stages - 1)
        self.is_loss_rank = self.pp_rank == loss_pp
        tp = ps.get_tensor_model_parallel_world_size()
        slice_shards = [mp_ranks.index(r) for r in pp_ranks]
        self.groups = VocabGroups(bcast=made["bcast"], scale=made["scale"], stats=made["stats"], grad=made["grad"],
                                  tp=ps.get_tensor_model_parallel_group() if (tp > 1 and self.barriers == 1) else None,
                                  loss_src=pp_ranks[loss_pp], num_shards=len(mp_ranks), slice_shards=slice_shards)
        self.labels: Optional[LabelStore] = None  # the loss chunk's (bind)
        self.loss_funcs: Dict[int, Callable] = {}
        self.runtime: Optional[VocabRuntime] = None

    def bind(self, weight: torch.nn.Parameter, deliver: Callable, hidden: int, dtype, device, loss_step: Callable):
        """The runtime over this rank's shard (once the chunks are known)."""
        weight.mzb_vocab_group = self.groups.stats  # every shard of the replica (verify gathers them)
        if self.runtime is None or self.runtime.weight is not weight:
            config = VocabConfig(self.groups, self.barriers, self.is_loss_rank, hidden, dtype, device)
            self.runtime = VocabRuntime(weight, weight.mzb_vocab_rows[0], config, loss_step, deliver, wait=self._wait)
        else:
            self.runtime.loss_step = loss_step
        return self

    def wait(self, handle, what: str):
        """Wait for a collective within the run's timeout; a timeout names ``what``."""
        return self._wait(handle, what)

    def _wait(self, handle, what: str):
        try:
            handle.wait(datetime.timedelta(seconds=self.timeout_s))
        except TypeError:  # a handle without a timeout argument
            handle.wait()
        except RuntimeError as e:
            raise RuntimeError(f"pipeline rank {self.pp_rank} waited {self.timeout_s:g} s for {what} "
                               f"(vocabulary parallelism): {str(e).splitlines()[0] if str(e) else e}") from None

    # the executor's interface (StagePasses.vocab)
    def run(self, kind: str, mb: int) -> None:
        if kind in ("VI", "VG"):
            self.inputs.run(kind, mb)
        else:
            self.runtime.run(kind, mb)

    def finish(self) -> None:
        """The end of a call: nothing of its passes may be left."""
        self.runtime.finish()
        if self.inputs is not None:
            self.inputs.finish()

    def loss_output(self, mb: int, out: torch.Tensor) -> None:
        self.runtime.loss_output(mb, out, self.labels.labels.pop(mb))

    def loss_grad(self, mb: int) -> torch.Tensor:
        return self.runtime.loss_grad(mb)


def sync_tied_gradients(chunks: Sequence[torch.nn.Module], grad_of: Callable, set_grad: Callable) -> None:
    """Tied embeddings under vocabulary parallelism: the first stage's word embedding (its TP slice's
    rows) and every pipeline rank's shard of it get the sum of their gradients (an all-reduce over
    the pipeline group of one slice's rows); before the data-parallel reduction."""
    from megatron.core import parallel_state as ps
    shard = find_shard(chunks)
    if shard is None or shard.mzb_global_name != "embedding.word_embeddings.weight":
        return
    v0, v1, vocab = shard.mzb_vocab_rows
    tp = ps.get_tensor_model_parallel_world_size()
    per_slice = vocab // tp
    base = ps.get_tensor_model_parallel_rank() * per_slice
    emb = None
    for c in chunks:
        for _, p in c.named_parameters():
            if p is not shard and getattr(p, "mzb_global_name", "") == "embedding.word_embeddings.weight":
                emb = p
    g_shard = grad_of(shard)
    buf = torch.zeros(per_slice, shard.shape[1], dtype=g_shard.dtype if g_shard is not None else shard.dtype,
                      device=shard.device)
    if emb is not None and grad_of(emb) is not None:
        buf += grad_of(emb)
    if g_shard is not None:
        buf[v0 - base:v1 - base] += g_shard
    dist.all_reduce(buf, group=ps.get_pipeline_model_parallel_group())
    if emb is not None:
        set_grad(emb, buf)
    set_grad(shard, buf[v0 - base:v1 - base])


def _loss_chunk_labels(models) -> LabelStore:
    for c in models:
        m = c
        while hasattr(m, "module") and not hasattr(m, "mzb_vocab_labels"):
            m = m.module
        if getattr(m, "mzb_vocab_labels", None) is not None:
            return m.mzb_vocab_labels
    raise ZeroBubbleConfigError("--enable-vocab-parallel: the loss stage's model chunk has its output layer; build it "
                                "through megatron-zb (megatron_zb.megatron.features.vocab_parallel.prepare_loss_chunk)")


def deliver_grad(weight: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """A VW pass's gradient into the shard: Megatron DDP's ``main_grad`` buffer, else ``.grad``
    (DDP reduces it with the rest at the end of the iteration; not with --overlap-grad-reduce)."""
    mg = getattr(weight, "main_grad", None)
    if mg is not None:
        mg.add_(grad.to(mg.dtype))
    elif weight.grad is None:
        weight.grad = grad.clone()
    else:
        weight.grad.add_(grad)


def setup_passes(state: Optional["VocabParallel"], options, placement: Placement, models, config, passes,
                 dev, forward_only: bool = False) -> "VocabParallel":
    """The run's ``VocabParallel`` (made at the first training call, by every rank), bound to this
    rank's shard and to this attempt's passes (``passes.vocab``, the loss step)."""
    from megatron.core import parallel_state as ps
    if state is None or state.made_for is not ps.get_pipeline_model_parallel_group():  # (parallel state rebuilt)
        state = VocabParallel(placement, options.vocab_parallel, options.timeout_s,
                              bool(getattr(options, "vocab_embedding", False)))
    weight = find_shard(models)
    if weight is None:
        raise ZeroBubbleConfigError("--enable-vocab-parallel: this rank's model chunks hold no vocabulary shard; build "
                                    "them through megatron-zb (its entry point, megatron_zb.run, or "
                                    "megatron_zb.megatron.features.vocab_parallel.attach_shard)")
    state.bind(weight, deliver_grad, config.hidden_size, config.pipeline_dtype, dev, passes.loss_step)
    state.runtime.forward_only = bool(forward_only)
    state.runtime.mb.clear()  # (an interrupted call leaves nothing behind)
    state.labels = _loss_chunk_labels(models) if state.is_loss_rank else LabelStore()
    state.labels.labels.clear()
    state.loss_funcs.clear()
    passes.vocab = state
    return state
