"""megatron's local GPT layer spec with sequence-parallel-capable torch norms.

The local spec's ``WrappedTorchNorm`` refuses sequence parallelism and apex/TE norms are absent
without CUDA, so a local-spec model with ``--sequence-parallel`` (CPU, or a GPU without TE) gets
these norms instead.
"""
from __future__ import annotations

import dataclasses

import torch

__all__ = ["SequenceParallelTorchNorm", "layer_spec"]


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
    """megatron's local GPT layer spec (MoE layers from ``config.num_moe_experts``: megatron's
    SequentialMLP of local experts); with sequence parallelism its norms are swapped for
    ``SequenceParallelTorchNorm`` and the block spec is given explicitly (so the final norm too)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    spec = get_gpt_layer_local_spec(num_experts=getattr(config, "num_moe_experts", None), moe_grouped_gemm=False)
    if not config.sequence_parallel:
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    sub = dataclasses.replace(spec.submodules, input_layernorm=SequenceParallelTorchNorm,
                              pre_mlp_layernorm=SequenceParallelTorchNorm)
    layer = dataclasses.replace(spec, submodules=sub)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=SequenceParallelTorchNorm)
