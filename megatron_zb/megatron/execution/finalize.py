"""The weight gradients a placement needs put right before the optimizer step, and Megatron's
``finalize_model_grads`` with them (``megatron.layout.placement`` builds the placement itself).

* **Tied embedding/output weights.** As in Megatron, the stage holding the output layer keeps its
  own copy of the word embedding (global name: the embedding's); after backward the two copies'
  gradients are summed so both receive the same update. For single/looped placements the copies
  are on different ranks and Megatron's embedding group does the sum. For **V** both copies live
  on rank 0 in two chunks, so the embedding group is rank 0 alone (``placement.embedding_ranks``)
  and ``finalize_model_grads_for`` adds the two local gradients and writes the sum into both.
* **Replicated stages** (BitPipe): the copies on paths 1, 2, ... are marked ``shared`` so clipping
  counts each weight once (``mark_replica_copies``).
"""
from __future__ import annotations

import inspect
from functools import partial
from typing import List, Optional, Sequence

import torch

from ...core.ir import Placement
from ..layout.placement import embedding_and_loss_on_one_rank, unwrap

__all__ = ["call_finalize", "mark_replica_copies", "configure_grad_sync", "grad_of", "tied_embedding_copies", "sum_local_tied_copies",
           "finalize_model_grads_for"]


def mark_replica_copies(chunks: Sequence[torch.nn.Module], placement: Placement) -> None:
    """Replicated stages: mark every parameter of a chunk on path 1, 2, ... ``shared`` (megatron's flag
    for a duplicate: the gradient norm and the zero count skip it), so clipping sees each weight once.
    Call before building the optimizer (megatron copies the flag into its main parameters)."""
    if not placement.replicated:
        return
    for c in chunks:
        info = getattr(unwrap(c), "mzb_chunk_info", None)
        if info is not None and placement.path_of(info.stage) > 0:
            for p in c.parameters():
                p.shared = True


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

def grad_of(p) -> Optional[torch.Tensor]:
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
            if p.mzb_global_name == "embedding.word_embeddings.weight" and not hasattr(p, "mzb_vocab_rows"):
                out.append(p)  # (a vocabulary shard holds some rows: megatron.vocab_parallel sums those)
    return out


def sum_local_tied_copies(chunks) -> None:
    copies = tied_embedding_copies(chunks)
    if len(copies) < 2:
        return
    grads = [grad_of(p) for p in copies]
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
    embedding-group sum). Plain chunks: the same sums done on ``param.grad``. Where the embedding
    and the output copy live on this rank in two chunks (V placement, BitPipe), their gradients
    are summed locally: before the data-parallel reduction when it has not started yet (with
    megatron's distributed optimizer the two copies' reduce-scattered shards need not cover the
    same elements), after it when DDP overlapped it with the backward. ``num_tokens`` (``calculate_per_token_loss``) is broadcast from
    the rank that holds the last stage (rank 0 for V, not megatron's last pipeline rank).
    """
    from megatron.core import parallel_state
    from ..features.vocab_parallel import sync_tied_gradients
    model = list(model)
    sync_tied_gradients(model, grad_of, _set_grad)  # vocabulary parallelism: the embedding and its shards
    v_like = placement is not None and (embedding_and_loss_on_one_rank(placement) or placement.replicated)
    if all(_is_ddp(c) for c in model):
        from megatron.core.distributed import finalize_model_grads
        overlapped = any(getattr(c.ddp_config, "overlap_grad_reduce", False) for c in model)
        if not overlapped:
            sum_local_tied_copies(model)
        elif len(tied_embedding_copies(model)) > 1 and \
                any(getattr(c.ddp_config, "use_distributed_optimizer", False) for c in model):
            raise RuntimeError("the embedding and its tied output-layer copy live on one rank (V placement / "
                               "BitPipe): with the distributed optimizer their gradients must be summed before the "
                               "data-parallel reduce-scatter, which overlap_grad_reduce starts during the backward; "
                               "drop --overlap-grad-reduce or untie the embeddings")
        kw = {}
        if force_all_reduce:
            kw["force_all_reduce"] = force_all_reduce
        if pg_collection is not None:
            kw["pg_collection"] = pg_collection
        finalize_model_grads(model, None if v_like else num_tokens, **kw)
        if not v_like:
            num_tokens = None  # megatron scaled already
        if overlapped:
            sum_local_tied_copies(model)
    else:
        _plain_finalize(model)
        sum_local_tied_copies(model)
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
                    g = grad_of(p)
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
                g = grad_of(p)
                if g is not None:
                    dist.all_reduce(g, group=dp)
                    g.div_(dist.get_world_size(dp))
    tp = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(tp) > 1:
        for c in model:
            for p in c.parameters():
                if getattr(p, "sequence_parallel", False):
                    g = grad_of(p)
                    if g is not None:
                        dist.all_reduce(g, group=tp)
    emb = parallel_state.get_embedding_group(check_initialized=False) \
        if _accepts_check(parallel_state.get_embedding_group) else parallel_state.get_embedding_group()
    if emb is not None and dist.get_world_size(emb) > 1 and dist.get_rank() in dist.get_process_group_ranks(emb):
        copies = tied_embedding_copies(model)
        if copies:
            p = copies[0]
            g = grad_of(p)
            if g is None:
                g = torch.zeros_like(p)
                p.grad = g
            dist.all_reduce(g, group=emb)


def _accepts_check(fn) -> bool:
    try:
        return "check_initialized" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def call_finalize(config, models, num_tokens, pg_collection, force_all_reduce):
    """Megatron's finalize_model_grads_func with the keywords its version takes."""
    fn = config.finalize_model_grads_func
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    kw = {}
    if "pg_collection" in params and pg_collection is not None:
        kw["pg_collection"] = pg_collection
    if "force_all_reduce" in params:
        kw["force_all_reduce"] = force_all_reduce
    fn(models, num_tokens, **kw)
