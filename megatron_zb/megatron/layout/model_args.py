"""The run's model from Megatron's arguments: plan's ``core.costs.model.ModelSpec`` of it (its per-layer
FLOPs and activations, as the run stores them), and a memory budget in GB as microbatches of its
activation. This module imports neither torch nor megatron.
"""
from __future__ import annotations

__all__ = ["fused_attention", "model_spec", "has_model", "memory_limit_in_microbatches", "mem_w_ratio"]


def fused_attention(args) -> bool:
    """Transformer Engine's fused attention (no attention scores kept) — where TE is installed: without
    it the machine adjustments run Megatron's local implementation, which keeps them."""
    import importlib.util
    return getattr(args, "transformer_impl", "local") == "transformer_engine" and \
        importlib.util.find_spec("transformer_engine") is not None


def model_spec(args):
    """plan's model of the run's activations (``core.plan.ModelSpec``) from Megatron's arguments."""
    from ...core.costs.model import ModelSpec
    rates = [getattr(args, k, None) for k in ("hidden_dropout", "attention_dropout")]
    drop = any((0.1 if r is None else float(r)) > 0 for r in rates)  # Megatron's default rate is 0.1
    return ModelSpec(num_layers=int(args.num_layers), hidden_size=int(args.hidden_size),
                     num_attention_heads=int(args.num_attention_heads), seq_length=int(args.seq_length),
                     micro_batch_size=int(getattr(args, "micro_batch_size", 1) or 1),
                     vocab_size=int(getattr(args, "padded_vocab_size", None) or getattr(args, "vocab_size", None) or 32000),
                     tensor_parallel_size=int(getattr(args, "tensor_model_parallel_size", 1) or 1),
                     sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
                     flash_attention=fused_attention(args),
                     activation_bytes=2 if (getattr(args, "bf16", False) or getattr(args, "fp16", False)) else 4,
                     dropout=drop, num_experts=getattr(args, "num_experts", None) or None,
                     moe_router_topk=int(getattr(args, "moe_router_topk", None) or 2),
                     moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None),
                     expert_model_parallel_size=int(getattr(args, "expert_model_parallel_size", None) or 1),
                     num_query_groups=getattr(args, "num_query_groups", None)
                     if getattr(args, "group_query_attention", False) else None,
                     ffn_hidden_size=getattr(args, "ffn_hidden_size", None), swiglu=bool(getattr(args, "swiglu", False)),
                     untie_embeddings_and_output_weights=bool(getattr(args, "untie_embeddings_and_output_weights",
                                                                      False)),
                     mtp_num_layers=int(getattr(args, "mtp_num_layers", None) or 0),
                     **_recompute(args),
                     split_overhead_s=float(getattr(args, "zero_bubble_split_overhead_ms", None) or 0.0) / 1e3)


def _recompute(args) -> dict:
    """Megatron's recompute flags and megatron-zb's count per model chunk (``--zero-bubble-recompute-num-layers``:
    one per rank or per chunk, ``ModelSpec.recompute_counts``) as plan's model takes them."""
    granularity = getattr(args, "recompute_granularity", None)
    method = getattr(args, "recompute_method", None) if granularity == "full" else None
    counts = getattr(args, "zero_bubble_recompute_num_layers", None) if method == "block" else None
    return dict(recompute=granularity, recompute_method=method,
                recompute_num_layers=max(1, int(getattr(args, "recompute_num_layers", None) or 1)) if method else 1,
                recompute_counts=tuple(counts) if counts is not None else None)


def memory_limit_in_microbatches(gigabytes: float, args, *, gib: bool = False) -> float:
    """Convert a per-rank activation budget in GB into microbatches of the fullest rank's activation:
    with the model's chunk costs (``zero_bubble_chunk_costs``, the layout's or the even split's) the
    fullest rank's chunks as each holds them (``core.plan.ModelSpec``: Megatron's per-layer formula,
    here with the run's element size (bf16/fp16 or fp32), dropout or not, and no attention scores
    with Transformer Engine's fused attention); without them, to be safe on every rank, (layers on a
    rank) x M_B plus the embedding's output and the loss stage's buffers.
    """
    spec = model_spec(args)
    p = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    m_b, _ = spec.layer_activation_bytes()
    per_microbatch = m_b * spec.num_layers / p + spec.embedding_activation_bytes() + spec.loss_activation_bytes()[0]
    laid_out = getattr(args, "zero_bubble_chunk_costs", None)
    if laid_out:  # the fullest rank's chunks, as each holds them
        per_microbatch = laid_out["unit_bytes"]
    budget = gigabytes * (2 ** 30 if gib else 1e9)
    return budget / per_microbatch


def mem_w_ratio(args) -> float:
    """What W keeps of a microbatch's activation (M_W / M_B of one layer), from the same model (more
    than 1 with full recompute: B recreates what F did not keep, and W's part of it outlives B)."""
    m_b, m_w = model_spec(args).layer_activation_bytes()
    return m_w / m_b if m_b > 0 else 0.5


def has_model(args) -> bool:
    """The flags describe the model well enough for plan's per-layer formulas."""
    return all(getattr(args, k, None) for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"))
