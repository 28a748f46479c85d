"""Recompute per model chunk (``--zero-bubble-recompute-num-layers``): each model chunk recomputes
its own number of first transformer layers in B.

megatron-core's ``TransformerBlock`` decides at every forward from its own ``self.config``
(``recompute_granularity == 'full'``, then ``recompute_method`` / ``recompute_num_layers``: 0.16's
``_checkpointed_forward``, 0.19's ``megatron.core.recompute.checkpointed_forward``, which reads the
block's config too); nothing else in megatron-core reads the block method's count (the MTP block
has its own). The chunks of a rank usually share one ``TransformerConfig``, so ``recompute_chunk``
gives a built chunk's block a config of its own, a shallow copy of the shared one that differs only
in those three fields: with a count N > 0 Megatron's block method recomputing its first N layers,
with 0 no recompute at all (the block runs as without recompute). The layers keep the shared
config; the chunk's other modules are untouched.

Applied right after each chunk is built: by ``megatron.launch.chunks.ChunkPlan.finish`` (the
entry point and the drop-in) and by verify's tiny GPT (``verify.model.tinygpt``). The counts per
chunk come from ``megatron.features.flags.recompute.stage_counts``.
"""
from __future__ import annotations

import copy

__all__ = ["recompute_chunk", "recomputed_layers"]


def recompute_chunk(model, count: int) -> None:
    """Make model chunk ``model`` (a megatron-core ``GPTModel``, unwrapped) recompute the forward of
    its first ``count`` decoder layers in the backward (0: none). Raises ``ValueError`` for a count
    above the chunk's layers."""
    block = getattr(model, "decoder", None)
    held = len(getattr(block, "layers", ()))
    if count < 0 or count > held:
        raise ValueError(f"a model chunk with {held} layers cannot recompute {count}")
    if block is None:
        return
    config = copy.copy(block.config)
    if count:
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = "full", "block", count
    else:
        config.recompute_granularity, config.recompute_method, config.recompute_num_layers = None, None, None
    block.config = config


def recomputed_layers(model) -> int:
    """How many of the chunk's first decoder layers recompute in B under its block's config (full
    recompute with the uniform method: every layer)."""
    block = getattr(model, "decoder", None)
    cfg = getattr(block, "config", None)
    if cfg is None or getattr(cfg, "recompute_granularity", None) != "full":
        return 0
    held = len(block.layers)
    return min(held, int(cfg.recompute_num_layers or 0)) if cfg.recompute_method == "block" else held
