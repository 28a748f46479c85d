"""``megatron-zb verify --optimizer-offload auto``: each pipeline rank's share of its Adam states on
the host, from ``core.optimizer.offload.auto_fractions`` on the verify model (the CPU test mode
of ``--zero-bubble-optimizer-offload auto``).

The need of each rank: its parameters (6 bytes each stay, 12 may go to the host) and the
schedule's activation peak on that rank (the core's simulation with unit costs, in microbatch
activations of the model's per-layer formula). The budget is the case's ``memory_limit`` in MB
where given; otherwise one that the neediest rank meets by putting about half of its states on
the host, so the ranks get different shares (the point of the check). Every rank computes the
same numbers."""
from __future__ import annotations

from typing import List

__all__ = ["check_offload", "rank_needs", "verify_auto_fractions"]


def rank_needs(case):
    """(offloadable state bytes, fixed bytes, activation peak bytes) per pipeline rank."""
    from ...core.build import ScheduleRequest, build
    from ...core.costs.model import ModelSpec
    cfg = case.model_config()
    p = case.pipeline_parallel_size
    h, layers = cfg.hidden_size, cfg.num_layers
    vocab = cfg.vocab_size
    spec = ModelSpec(num_layers=layers, hidden_size=h, num_attention_heads=cfg.num_attention_heads,
                     seq_length=cfg.seq_length, micro_batch_size=cfg.micro_batch_size, vocab_size=vocab,
                     flash_attention=False, activation_bytes=2 if (case.bf16 or case.fp16) else 4, dropout=False)
    built = build(ScheduleRequest(case.schedule if case.schedule != "megatron-1f1b" else "1f1b",
                                  chunks=case.chunks), p, case.num_microbatches, enforce_limit=False)
    peaks = built.result.peak_memory  # in stage activations of one microbatch
    m_b, _ = spec.layer_activation_bytes()
    pl = built.schedule.placement
    per_layer_params = 12 * h * h + 13 * h
    per_rank_layers = layers / p
    params = [per_rank_layers * per_layer_params for _ in range(p)]
    params[pl.rank_of(0)] += vocab * h  # the embedding
    params[pl.rank_of(pl.num_stages - 1)] += vocab * h  # the output layer (its copy when tied)
    act = [x * per_rank_layers * m_b / pl.chunks for x in peaks]
    return [12.0 * n for n in params], [6.0 * n for n in params], act


def verify_auto_fractions(case) -> List[float]:
    from ...core.optimizer.offload import auto_fractions
    states, fixed, act = rank_needs(case)
    if case.memory_limit is not None:
        budget = float(case.memory_limit) * 1e6
    else:
        r = max(range(len(states)), key=lambda i: states[i] + fixed[i] + act[i])
        budget = states[r] * 0.5 + fixed[r] + act[r]
    out = auto_fractions(states, fixed, act, budget)
    return [1.0 if f is None else f for f in out]


def check_offload(case, error) -> None:
    """``optimizer_offload``: None, a fraction 0..1 or 'auto' (``error``: the usage error to raise)."""
    f = case.optimizer_offload
    if f is None:
        return
    if case.pipeline_parallel_size < 2:
        raise error("--optimizer-offload needs --pipeline-parallel-size >= 2 (the reference trains without)")
    if case.use_distributed_optimizer and not (case.bf16 or case.fp16):
        raise error("--optimizer-offload with --use-distributed-optimizer needs --bf16 (megatron-core's CPU "
                               "offload cannot take the distributed optimizer's fp32 shards: a non-leaf tensor)")
    if (case.bf16 or case.fp16) and not case.use_distributed_optimizer:
        raise error("--optimizer-offload with --bf16/--fp16 needs --use-distributed-optimizer (Megatron's "
                               "CPU offload runs with the distributed optimizer's precision-aware path)")
    if f == "auto":
        return
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
        raise error(f"--optimizer-offload must be a fraction 0..1 or 'auto', got {f!r}")
    case.optimizer_offload = float(f)
