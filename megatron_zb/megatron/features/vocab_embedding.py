"""The input embedding split over the pipeline ranks too (``--split-vocab-embedding``, with
``--enable-vocab-parallel``; the passes: ``runtime.features.vocab_input``, their place: ``core.ir.vocab``).

* **The rows.** Every rank holds the rows of the embedding its output-layer shard holds
  (``vocab_parallel.shard_rows``). Tied embeddings: the output shard *is* the input shard (one
  parameter, its gradient from VW and VG). Untied: a second shard on the rank's first chunk
  (``mzb_vocab_input.weight``, global name ``embedding.word_embeddings.weight``).
* **The first stage** keeps no embedding weight: its ``embedding.word_embeddings`` becomes a
  stand-in (``_SplitLookup``) that returns the summed lookups of the current microbatch
  (``runtime.features.vocab_input.InputRuntime.output``), before Megatron's DDP and optimizer see the chunk
  (``drop_embedding``); its position embeddings and dropout stay.
* **The tokens** are read at VI, before the first stage's forward: the token source's chunk-0 data
  iterator is wrapped (``PrefetchIterator``) so that VI reads item j and F(0, j)'s forward step gets
  the same item. Items must be dicts with ``tokens`` (Megatron's GPT batches).
"""
from __future__ import annotations

from collections import deque
from typing import Optional, Sequence

import torch

from ...core.ir import Placement
from ...runtime.features.vocab_input import InputGroups, InputRuntime
from ..errors import ZeroBubbleConfigError
from .vocab_parallel import SHARD_ATTR, ShardSpec, VocabShard, find_shard

__all__ = ["INPUT_ATTR", "attach_input_shard", "adopt_first_chunk", "finish_rank", "find_input_shard",
           "drop_embedding", "PrefetchIterator",
           "setup_vocab_passes", "setup_inputs", "bind_inputs", "token_source"]

INPUT_ATTR = "mzb_vocab_input"


def attach_input_shard(chunk, spec: ShardSpec) -> None:
    """Untied: this rank's rows of the input embedding as a submodule of ``chunk`` (the rank's first
    chunk, which holds the output shard); tied: the output shard serves (nothing to add)."""
    if spec.tied:  # saved as the input embedding's rows too (a run with the whole embedding loads them)
        out = getattr(chunk, SHARD_ATTR)
        out.mzb_keys = ("output_layer.weight", "embedding.word_embeddings.weight")
        out.weight.shared = False  # no other copy of its rows is left: the gradient norm counts it here
        return
    v0, rows = spec.rows()
    shard = VocabShard(rows, spec.hidden, spec.dtype, spec.device, keys=("embedding.word_embeddings.weight",),
                       attr=INPUT_ATTR)
    setattr(chunk, INPUT_ATTR, shard)
    w = shard.weight
    w.mzb_global_name = "embedding.word_embeddings.weight"
    w.mzb_vocab_rows = (v0, v0 + rows, spec.vocab_size)
    w.tensor_model_parallel = True
    w.partition_dim, w.partition_stride = 0, 1
    w.allreduce = True


def adopt_first_chunk(model, info, placement: Placement, args) -> None:
    """Training (``megatron.launch.chunks.ChunkPlan``): the rank's first chunk, which got the output
    shard (``vocab_parallel.adopt_chunk``), gets the input rows too (untied)."""
    from megatron.core import parallel_state as ps
    if info.vp_stage != 0:
        return
    param = getattr(model, SHARD_ATTR).weight
    attach_input_shard(model, ShardSpec(
        vocab_size=param.mzb_vocab_rows[2], hidden=int(args.hidden_size), p=placement.num_ranks,
        tp=ps.get_tensor_model_parallel_world_size(), pp_rank=info.rank, tp_rank=ps.get_tensor_model_parallel_rank(),
        tied=not bool(getattr(args, "untie_embeddings_and_output_weights", False)), dtype=param.dtype,
        device=param.device))


def finish_rank(chunks: Sequence[torch.nn.Module], placement: Placement, deterministic: bool) -> None:
    """Training, once the rank's chunks are built and their shards initialised: the untied input rows
    take the first stage's freshly built embedding's (scattered; tied, the output shard did), then the
    first stage drops its whole embedding (before DDP and the optimizer wrap the chunks)."""
    from .vocab_parallel import scatter_embedding_rows
    own = next((getattr(c, INPUT_ATTR) for c in chunks if hasattr(c, INPUT_ATTR)), None)
    if not deterministic and own is not None:  # untied: every rank holds one (a collective over the pipeline group)
        scatter_embedding_rows(chunks, placement, own.weight)
    drop_embedding(chunks)


def find_input_shard(chunks: Sequence[torch.nn.Module]) -> Optional[torch.nn.Parameter]:
    """The rank's input rows: the untied input shard, else (tied) the output shard."""
    for c in chunks:
        m = c
        while hasattr(m, "module") and not hasattr(m, INPUT_ATTR) and not hasattr(m, SHARD_ATTR):
            m = m.module
        shard = getattr(m, INPUT_ATTR, None)
        if shard is not None:
            return shard.weight
    return find_shard(chunks)


class _Feed:
    """What the stand-in reads: the run's input runtime (bound at the first call)."""

    def __init__(self):
        self.runtime: Optional[InputRuntime] = None


class _SplitLookup(torch.nn.Module):
    """Stands in for the first stage's word embedding: the summed lookups of every rank's rows."""

    def __init__(self, feed: _Feed):
        super().__init__()
        self.mzb_feed = feed

    def forward(self, input_ids, *_, **__):
        rt = self.mzb_feed.runtime
        if rt is None:
            raise ZeroBubbleConfigError("--split-vocab-embedding: the first stage's forward ran outside megatron-zb's "
                                        "schedule (its embedding lives on every pipeline rank's vocabulary passes)")
        return rt.output()


def drop_embedding(chunks: Sequence[torch.nn.Module]) -> None:
    """The first stage's chunk (if this rank holds it) loses its word embedding's weight; before
    DDP and the optimizer wrap the chunks."""
    for c in chunks:
        emb = getattr(c, "embedding", None)
        if getattr(c, "pre_process", False) and emb is not None and not isinstance(emb.word_embeddings, _SplitLookup):
            emb.word_embeddings = _SplitLookup(_Feed())
            if not getattr(c, "post_process", False):  # Megatron asks a tied chunk for the weight in every forward
                c.share_embeddings_and_output_weights = False


def _stand_in(chunks) -> Optional[_SplitLookup]:
    for c in chunks:
        m = c
        while hasattr(m, "module") and not hasattr(m, "embedding"):
            m = m.module
        emb = getattr(m, "embedding", None) if getattr(m, "pre_process", False) else None
        if emb is not None:
            if not isinstance(emb.word_embeddings, _SplitLookup):
                raise ZeroBubbleConfigError("--split-vocab-embedding: the first stage still holds its whole word "
                                            "embedding; build the chunks through megatron-zb (megatron_zb.run, or "
                                            "megatron_zb.megatron.features.vocab_embedding.drop_embedding)")
            return emb.word_embeddings
    return None


class PrefetchIterator:
    """A data iterator whose items VI reads ahead (``peek``, in order), handed out again in the same
    order by ``next`` (the first stage's forward step)."""

    def __init__(self, inner):
        self.inner, self.ahead = inner, deque()

    def __iter__(self):
        return self

    def peek_tokens(self, mb: int) -> torch.Tensor:
        item = next(self.inner)
        if not isinstance(item, dict) or not isinstance(item.get("tokens"), torch.Tensor):
            raise ZeroBubbleConfigError(f"--split-vocab-embedding reads each microbatch's tokens before the first "
                                        f"stage's forward: its data iterator must yield dicts with 'tokens' "
                                        f"(Megatron's GPT batches), got {type(item).__name__}")
        self.ahead.append(item)
        return item["tokens"]

    def __next__(self):
        return self.ahead.popleft() if self.ahead else next(self.inner)


def token_source(made: dict, pp_rank: int, first: int) -> int:
    """The global rank that reads the tokens: the first stage's rank of tensor-parallel rank 0 (every
    shard of the replica learns it: a collective over ``made['itokens']``)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    everyone = [None] * dist.get_world_size(made["itokens"])
    dist.all_gather_object(everyone, (pp_rank, ps.get_tensor_model_parallel_rank(), dist.get_rank()),
                           group=made["itokens"])
    return next(g for pp, tp, g in everyone if pp == first and tp == 0)


def setup_vocab_passes(state, options, placement: Placement, models, config, passes, device, forward_only: bool):
    """Vocabulary parallelism's passes for this call (``vocab_parallel.setup_passes``) and, with
    ``options.vocab_embedding``, the split embedding's (``setup_inputs``); the run's ``VocabParallel``."""
    from .vocab_parallel import setup_passes
    state = setup_passes(state, options, placement, models, config, passes, device, forward_only)
    state.inputs = None
    if getattr(options, "vocab_embedding", False):
        setup_inputs(state, placement, models, passes, device, forward_only)
    return state


def setup_inputs(state, placement: Placement, models, passes, device, forward_only: bool) -> InputRuntime:
    """The split embedding's runtime for this call (``state.inputs``; ``state``: the run's
    ``VocabParallel``, made with ``embedding=True``)."""
    from .vocab_parallel import deliver_grad
    if state.token_src is None:
        state.token_src = token_source(state.input_groups, state.pp_rank, placement.rank_of(0))
    state.inputs = bind_inputs(state, placement, models, passes, device, deliver_grad, forward_only)
    return state.inputs


def bind_inputs(state, placement: Placement, models, passes, device, deliver, forward_only: bool) -> InputRuntime:
    """This call's input runtime over the rank's input rows; the token source's chunk-0 iterator
    wrapped; the first stage's stand-in fed. ``state``: the run's ``VocabParallel`` (its input groups
    and token source known)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    weight = find_input_shard(models)
    if weight is None:
        raise ZeroBubbleConfigError("--split-vocab-embedding: this rank holds no vocabulary shard")
    pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    first = placement.rank_of(0)
    is_first = state.pp_rank == first
    made, src = state.input_groups, state.token_src
    read = None
    if dist.get_rank() == src:
        c = passes.chunk_of[0]
        it = passes.iterators[c]
        if it is None:
            raise ZeroBubbleConfigError("--split-vocab-embedding: the first stage's rank got no data iterator")
        if not isinstance(it, PrefetchIterator):
            it = passes.iterators[c] = PrefetchIterator(it)
        read = it.peek_tokens
    groups = InputGroups(tokens=made["itokens"], total=made["itotal"], grad=made["igrad"], token_src=src,
                         grad_src=pp_ranks[first])
    rt = InputRuntime(weight, weight.mzb_vocab_rows[0], groups, is_first, read, deliver, device, wait=state.wait)
    rt.forward_only = bool(forward_only)
    if is_first:
        _stand_in(models).mzb_feed.runtime = rt
    return rt
