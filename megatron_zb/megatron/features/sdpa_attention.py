"""Core attention through torch's ``scaled_dot_product_attention``: a realistic layer without
Transformer Engine.

Megatron's local layer spec computes attention with its ``DotProductAttention``, which materialises
the s x s scores (and keeps them for the backward). ``SDPAttention`` is a drop-in for it (the same
constructor megatron passes every ``core_attention`` submodule, the same [s, b, h x d] output per
tensor-parallel rank) whose forward is one call of ``torch.nn.functional.scaled_dot_product_attention``:
on a GPU torch picks its FlashAttention / memory-efficient / cuDNN kernels (no s x s tensor kept), on
a CPU its own kernels or the math path, equal to megatron's attention up to float rounding.

Selected by Megatron's own flag where Transformer Engine is absent (``--transformer-impl local``):
``--attention-backend flash`` or ``fused`` (``features.flags.attention``); ``local``, ``unfused`` and
``auto`` (Megatron's default) keep megatron's ``DotProductAttention``. With TE installed the flag
means what it means in Megatron (TE's backends) and nothing here is used.

What it computes: causal attention when the layer's mask type is causal and no mask is given
(megatron's rule: a one-token query attends to every key), or the given boolean mask (True = masked,
megatron's convention); grouped-query attention (each key/value head serves num_heads / num_groups
query heads, as megatron repeats them); the softmax scale (``softmax_scale`` or 1/sqrt(kv_channels));
attention dropout, drawn from megatron's model-parallel RNG as megatron's attention draws it; and
Megatron's packed sequences (THD, ``packed_seq_params.qkv_format == "thd"``: each sequence attends
within itself). Refused in one line: context parallelism, sliding-window attention, softmax variants
other than ``vanilla``, an attention bias.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import ZeroBubbleConfigError
from .flags.attention import uses_sdpa

__all__ = ["SDPAttention", "core_attention_for"]


def core_attention_for(backend):
    """The core-attention class a local-spec model uses for ``--attention-backend`` ``backend`` (a
    name or Megatron's enum): ``SDPAttention`` or None (megatron's own ``DotProductAttention``)."""
    return SDPAttention if uses_sdpa(backend) else None


def _is_causal_type(mask_type) -> bool:
    return "causal" in str(getattr(mask_type, "name", mask_type))


class SDPAttention(torch.nn.Module):
    """megatron's core-attention interface over ``torch.nn.functional.scaled_dot_product_attention``.

    The constructor takes what megatron's ``Attention`` passes every ``core_attention`` submodule
    (megatron-core 0.16 and 0.19 alike): that is why it has more than eight parameters. It holds no
    parameters of its own (as megatron's attention with the vanilla softmax).
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__()
        self.config = config
        self.layer_number = max(1, int(layer_number))
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        if getattr(config, "context_parallel_size", 1) != 1:
            raise ZeroBubbleConfigError("--attention-backend flash/fused without Transformer Engine (torch's SDPA) "
                                        "does not split attention over --context-parallel-size: use 1, or TE")
        if getattr(config, "window_size", None) is not None:
            raise ZeroBubbleConfigError("--attention-backend flash/fused without Transformer Engine (torch's SDPA) "
                                        "has no sliding-window attention (--window-size): use --attention-backend local")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ZeroBubbleConfigError(f"--attention-backend flash/fused without Transformer Engine (torch's SDPA) "
                                        f"computes the vanilla softmax, not {config.softmax_type!r}: use "
                                        "--attention-backend local")
        tp = pg_collection.tp.size() if pg_collection is not None and getattr(pg_collection, "tp", None) is not None \
            else _tp_world_size()
        heads, groups = int(config.num_attention_heads), int(config.num_query_groups or config.num_attention_heads)
        if heads % tp or groups % tp or heads % groups:
            raise ZeroBubbleConfigError(f"{heads} attention heads and {groups} query groups do not split over "
                                        f"tensor-parallel size {tp}")
        self.heads_per_partition, self.groups_per_partition = heads // tp, groups // tp
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else float(softmax_scale)
        self.dropout_p = float(config.attention_dropout if attention_dropout is None else attention_dropout)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] (THD: [t, np, hn] / [t, ng, hn]) ->
        [sq, b, np x hn] (THD: [t, 1, np x hn]). The layer's own mask type decides causality, as in
        megatron's ``DotProductAttention`` (``attn_mask_type`` here is not used)."""
        if attention_bias is not None:
            raise ZeroBubbleConfigError("torch's SDPA core attention takes no attention bias: use "
                                        "--attention-backend local")
        if packed_seq_params is not None:
            return self._packed(query, key, value, attention_mask, packed_seq_params)
        # [s, b, n, d] -> [b, n, s, d]
        out = self._attend(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
                           attention_mask)
        out = out.permute(2, 0, 1, 3)  # [sq, b, np, hn]
        return out.reshape(out.size(0), out.size(1), -1)

    def _packed(self, query, key, value, attention_mask, params):
        if params.qkv_format != "thd" or attention_mask is not None:
            raise ZeroBubbleConfigError("torch's SDPA core attention takes packed sequences in THD format without "
                                        "an attention mask only")
        cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_k = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        bq, bk = [int(x) for x in cu_q.tolist()], [int(x) for x in (cu_k if cu_k is not None else cu_q).tolist()]
        outs = []
        for (q0, q1), (k0, k1) in zip(zip(bq, bq[1:]), zip(bk, bk[1:])):
            # [len, n, d] -> [1, n, len, d]
            o = self._attend(query[q0:q1].transpose(0, 1).unsqueeze(0), key[k0:k1].transpose(0, 1).unsqueeze(0),
                             value[k0:k1].transpose(0, 1).unsqueeze(0), None)
            outs.append(o[0].transpose(0, 1))  # [len, np, hn]
        out = torch.cat(outs, dim=0)
        return out.reshape(out.size(0), 1, -1)

    def _attend(self, q, k, v, attention_mask):
        """q [b, np, sq, hn], k/v [b, ng, sk, hn] -> [b, np, sq, hn]."""
        rep = self.heads_per_partition // self.groups_per_partition
        if q.size(1) != self.heads_per_partition or k.size(1) != self.groups_per_partition:
            raise ZeroBubbleConfigError(f"torch's SDPA core attention expected {self.heads_per_partition} query and "
                                        f"{self.groups_per_partition} key/value heads per rank, got {q.size(1)} and "
                                        f"{k.size(1)}")
        if rep > 1:  # grouped-query attention: each key/value head serves `rep` neighbouring query heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        sq, sk = q.size(2), k.size(2)
        mask, causal = None, False
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise ZeroBubbleConfigError("torch's SDPA core attention takes megatron's boolean attention masks "
                                            f"(True = masked), got {attention_mask.dtype}")
            mask = ~attention_mask  # SDPA: True = takes part
        elif _is_causal_type(self.attn_mask_type) and sq > 1:
            if sq != sk:
                raise ZeroBubbleConfigError(f"causal attention needs as many queries as keys, got {sq} and {sk}")
            causal = True
        p = self.dropout_p if self.training else 0.0
        if p > 0.0 and not getattr(self.config, "sequence_parallel", False):
            from megatron.core import tensor_parallel  # each tensor-parallel rank its own dropout, as megatron's
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal,
                                                      scale=self.softmax_scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal,
                                              scale=self.softmax_scale)


def _tp_world_size() -> int:
    from megatron.core import parallel_state
    return parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() \
        else 1
