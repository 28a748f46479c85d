"""One model chunk of a megatron-zb placement, built by Megatron: what it holds and what is done to
it right after Megatron built it. Shared by megatron-zb's entry point (its own model provider) and
the drop-in route (a user's own ``model_provider`` / Megatron's model builders, ``megatron.dropin``).

* ``ChunkPlan``: for (pipeline rank, vp_stage) the chunk's stage, its pre/post-process and its
  global layers (``placement.chunk_infos``); the layer table on the chunk's config, so Megatron's
  layer count/offset functions number its layers globally (``placement.attach_layer_table``).
* ``finish``: each chunk's own recompute count (``--zero-bubble-recompute-num-layers``,
  ``features.recompute``), global parameter names, replica copies marked for clipping, and the initial weights:
  drawn from the global names (``--zero-bubble-deterministic-init``) or, where a V rank holds both
  the embedding and the tied output layer, the output copy set equal to the embedding (Megatron's
  all-reduce over a one-rank embedding group would leave it zero).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import List, Optional, Tuple

from ...core.ir import Placement
from ..layout import placement as zb_placement
from ..execution.finalize import finalize_model_grads_for, mark_replica_copies
from ..features.flags.recompute import training_stage_counts
from .startup import layer_kw, placement_of

__all__ = ["ChunkPlan"]


@dataclass
class ChunkPlan:
    """This rank's chunks of the placement the flags select (``args``: Megatron's, validated)."""

    args: object
    placement: Placement = None
    built: List = field(default_factory=list)  # this rank's chunks so far (the tied copy reads chunk 0)
    recompute: Optional[Tuple[int, ...]] = None  # each chunk's recomputed layers (--zero-bubble-recompute-num-layers)

    def __post_init__(self):
        if self.placement is None:
            self.placement = placement_of(self.args)
        if self.recompute is None:
            self.recompute = training_stage_counts(self.args, self.placement)

    @property
    def vocab_parallel(self) -> bool:
        """``--enable-vocab-parallel`` under a megatron-zb schedule: every rank holds an output-layer shard."""
        return bool(getattr(self.args, "enable_vocab_parallel", False)) and \
            getattr(self.args, "zero_bubble_resolved_schedule", None) is not None

    @property
    def reshapes(self) -> bool:
        """Whether the model differs from Megatron's own layout (V, BitPipe; the output layer spread over
        every rank by vocabulary parallelism, with its embedding group of the embedding's rank alone)."""
        return self.placement.style in ("v", "bitpipe") or self.vocab_parallel

    def info(self, vp_stage, pp_rank=None):
        from megatron.core import parallel_state
        if pp_rank is None:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        infos = zb_placement.chunk_infos(self.placement, self.args.num_layers, pp_rank, **layer_kw(self.args))
        return infos[vp_stage or 0]

    def prepare_config(self, config, pp_rank=None) -> None:
        """Megatron's layer functions answer from the placement for models built with ``config``;
        its finalize sums the tied copies a V rank holds."""
        from megatron.core import parallel_state
        if pp_rank is None:
            pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        zb_placement.attach_layer_table(config, self.placement, self.args.num_layers, placement_rank=pp_rank,
                                        **layer_kw(self.args))
        config.finalize_model_grads_func = partial(finalize_model_grads_for, placement=self.placement)

    def describe(self, info, pre_process: bool, post_process: bool) -> str:
        pl = self.placement
        layers = f"layers {info.layers[0]}-{info.layers[-1]}" if info.layers else "no layers"
        where = (f"stage {pl.logical(info.stage)} of {info.num_stages} (path {pl.path_of(info.stage)})"
                 if pl.replicated else f"stage {info.stage} of {info.num_stages}")
        rc = f", recomputes {self.recompute[info.stage]} of them" if self.recompute is not None else ""
        return (f"pipeline rank {info.rank} chunk {info.vp_stage}: {where}, {layers}{rc}"
                f"{', embedding' if pre_process else ''}{', loss' if post_process else ''}")

    def finish(self, model, info) -> None:
        """After Megatron built the chunk ``info`` describes: check its layers, name its parameters
        globally, mark replica copies, set its initial weights (see the module docstring)."""
        decoder = getattr(model, "decoder", None)
        if decoder is not None and hasattr(decoder, "layers"):
            got = [int(layer.layer_number) - 1 for layer in decoder.layers]
            if got != list(info.layers):
                raise RuntimeError(f"pipeline rank {info.rank} chunk {info.vp_stage}: megatron built layers {got}, "
                                   f"the placement wants {list(info.layers)} (the model provider must build its "
                                   "layers with the config it is given)")
        if self.recompute is not None:  # its own count of first layers recomputed in B
            from ..features.recompute import recompute_chunk
            recompute_chunk(model, self.recompute[info.stage])
        tied = bool(getattr(model, "share_embeddings_and_output_weights", False))
        zb_placement.name_params(model, info, tied)  # experts by their global index under EP
        model.mzb_chunk_info = info
        mark_replica_copies([model], self.placement)  # clipping counts each replicated weight once
        deterministic = bool(getattr(self.args, "zero_bubble_deterministic_init", False))
        if self.vocab_parallel:  # the loss chunk without its output layer; the rank's shard on its first chunk
            from ..features.vocab_parallel import adopt_chunk
            adopt_chunk(model, info, self.placement, self.args)
            if getattr(self.args, "split_vocab_embedding", False):  # the input embedding's rows too
                from ..features.vocab_embedding import adopt_first_chunk
                adopt_first_chunk(model, info, self.placement, self.args)
        if deterministic:
            zb_placement.deterministic_init_([model], seed=self.args.seed, std=self.args.init_method_std)
        elif self.placement.style == "v" and info.post_process and tied and not self.vocab_parallel:
            self._copy_tied_embedding(model)
        self.built.append(model)
        if self.vocab_parallel and not deterministic and \
                info.vp_stage in (None, len(self.placement.stages_of(info.rank)) - 1):  # the rank's last chunk
            from ..features.vocab_parallel import init_shard
            init_shard(self.built, self.placement, seed=self.args.seed, std=self.args.init_method_std)
        if self.vocab_parallel and getattr(self.args, "split_vocab_embedding", False) and \
                info.vp_stage in (None, len(self.placement.stages_of(info.rank)) - 1):
            from ..features.vocab_embedding import finish_rank
            finish_rank(self.built, self.placement, deterministic)

    def _copy_tied_embedding(self, model) -> None:
        import torch
        src = next((m for m in self.built if getattr(m, "pre_process", False)), None)
        if src is None:
            raise RuntimeError("V placement: the embedding chunk must be built before the loss chunk")
        with torch.no_grad():
            model.output_layer.weight.data.copy_(src.embedding.word_embeddings.weight.data)
