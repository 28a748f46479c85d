"""megatron's local GPT layer spec with sequence-parallel-capable torch norms.

The local spec's ``WrappedTorchNorm`` refuses sequence parallelism and apex/TE norms are absent
without CUDA, so a local-spec model with ``--sequence-parallel`` (CPU, or a GPU without TE) gets
these norms instead.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ..errors import ZeroBubbleConfigError

__all__ = ["SequenceParallelTorchNorm", "layer_spec", "packed_attention", "with_core_attention"]


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


@functools.lru_cache(maxsize=None)
def packed_attention():
    """megatron's local ``DotProductAttention`` that also takes Megatron's packed-sequence format
    (THD: ``packed_seq_params.qkv_format == "thd"``, query/key/value [tokens, heads, dim] with the
    sequences one after another at ``cu_seqlens``), as TE's attention does on a GPU: each sequence
    attends causally within itself (megatron's own local attention, one sequence at a time)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class PackedDotProductAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is None:
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias)
            if packed_seq_params.qkv_format != "thd" or attention_mask is not None:
                raise ValueError("the CPU packed-sequence attention takes THD batches with causal masks only")
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            bounds = [int(x) for x in cu.tolist()]
            outs = [super(PackedDotProductAttention, self).forward(
                query[a:b].unsqueeze(1), key[a:b].unsqueeze(1), value[a:b].unsqueeze(1), None,
                attn_mask_type=attn_mask_type, attention_bias=attention_bias) for a, b in zip(bounds, bounds[1:])]
            return torch.cat(outs, dim=0)  # [tokens, 1, heads x dim]

    return PackedDotProductAttention


def with_core_attention(spec, core_attention):
    """A GPT layer spec (or a block spec's ``TransformerBlockSubmodules``) with every layer's
    self-attention computed by ``core_attention`` (a class with megatron's core-attention
    constructor and forward, e.g. ``megatron.features.sdpa_attention.SDPAttention``); None: unchanged."""
    if core_attention is None:
        return spec
    if hasattr(spec, "layer_specs"):  # a block: each of its layers
        return dataclasses.replace(spec, layer_specs=[with_core_attention(s, core_attention) for s in spec.layer_specs])
    att = getattr(spec.submodules, "self_attention", None)
    if att is None or not hasattr(getattr(att, "submodules", None), "core_attention"):
        raise ZeroBubbleConfigError(f"the layer spec {getattr(spec, 'module', spec)!r} has no self-attention core to replace")
    att = dataclasses.replace(att, submodules=dataclasses.replace(att.submodules, core_attention=core_attention))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=att))


def layer_spec(config, num_layers: int, packed: bool = False, core_attention=None):
    """megatron's local GPT layer spec (MoE layers from ``config.num_moe_experts``: megatron's
    SequentialMLP of local experts); with sequence parallelism its norms are swapped for
    ``SequenceParallelTorchNorm`` and the block spec is given explicitly (so the final norm too);
    ``packed``: its attention takes packed sequences (``packed_attention``); ``core_attention``:
    this core attention instead of megatron's (``with_core_attention``; it takes packed sequences
    itself)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    spec = get_gpt_layer_local_spec(num_experts=getattr(config, "num_moe_experts", None), moe_grouped_gemm=False)
    spec = with_core_attention(spec, core_attention or (packed_attention() if packed else None))
    if not config.sequence_parallel:
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    sub = dataclasses.replace(spec.submodules, input_layernorm=SequenceParallelTorchNorm,
                              pre_mlp_layernorm=SequenceParallelTorchNorm)
    layer = dataclasses.replace(spec, submodules=sub)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=SequenceParallelTorchNorm)
