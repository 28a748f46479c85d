"""--zero-bubble-balance-microbatches at run time: each training iteration's global batch balanced
over the data-parallel replicas and microbatches, with the per-microbatch schedule for it.

Megatron hands every replica ``num_microbatches`` microbatches from its own data iterator. Here,
before the iteration's schedule is built (every rank of every replica does the same, so all
agree without further messages):

1. the ranks that read data take this iteration's microbatches from their iterators and split
   them into sequences (each row of a microbatch is one sequence of the microbatch's length);
2. every rank learns every replica's sequence lengths (one all-gather of a few integers);
3. the balancer and the list scheduler of the schedule core (``core.varlen.plan_batch``) decide
   which sequences each replica runs, in which microbatches and order, and the schedule: every
   rank computes the same plan, for its own replica's schedule only;
4. the data ranks at each pipeline position swap sequences over the data-parallel group (an
   all-gather of the batch's rows) and serve their replica's microbatches, rows padded to the
   microbatch's longest with a zero loss mask (causal attention: a real token never sees a pad);
5. the forward-backward function runs the replica's microbatch count and schedule.

The loss must be normalised over the global token count (``calculate_per_token_loss``: Megatron
sums each microbatch's masked token losses and divides the reduced gradient by the token count
all-reduced over data parallelism), so the gradient is the unbalanced run's: the same tokens, each
counted once. Megatron's ``--variable-seq-lengths`` sends each activation's shape with it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from ...core.build import Built, build
from ...core.microbatch_costs import LengthModel
from ...core.varlen import Templates, VarlenConfig, plan_batch
from ..errors import ZeroBubbleConfigError

__all__ = ["MicrobatchBalancer", "Balanced", "attention_share_of", "check_balance_config", "split_rows", "collate"]

#: keys of a microbatch whose rows are padded with 0 past a sequence's end (the rest: arange)
POSITION_KEYS = ("position_ids",)


def attention_share_of(config, seq_length: int) -> float:
    """The share of a transformer layer's F at ``seq_length`` spent in attention (Q.K^T and
    scores.V over the s x s scores, as ``core.model`` counts them), from Megatron's model config."""
    h = config.hidden_size
    heads = config.num_attention_heads
    d = getattr(config, "kv_channels", None) or h // heads
    groups = getattr(config, "num_query_groups", None) or heads
    ffn = getattr(config, "ffn_hidden_size", None) or 4 * h
    linear = h * heads * d + 2 * h * groups * d + heads * d * h + (3 if getattr(config, "gated_linear_unit", False)
                                                                   else 2) * h * ffn
    core = 2 * seq_length * heads * d
    return core / (linear + core)


def check_balance_config(config, options, placement) -> None:
    """What balancing needs of the run, refused in one line each."""
    flag = "--zero-bubble-balance-microbatches"
    if not getattr(config, "variable_seq_lengths", False):
        raise ZeroBubbleConfigError(f"{flag} runs microbatches of different lengths and sizes through the pipeline: "
                                    "give --variable-seq-lengths (Megatron then sends each activation's shape)")
    if not getattr(config, "calculate_per_token_loss", False):
        raise ZeroBubbleConfigError(f"{flag} moves sequences between replicas and microbatches: the loss must be "
                                    "normalised over the global token count (--calculate-per-token-loss) for the "
                                    "gradient to stay the same")
    if placement.replicated:
        raise ZeroBubbleConfigError(f"{flag} with {options.schedule}'s replicated stages is not supported yet")
    if options.vocab_parallel is not None:
        raise ZeroBubbleConfigError(f"{flag} with --enable-vocab-parallel is not supported yet")
    if placement.models_per_rank > 1 and getattr(config, "grad_sync_func", None) is not None:
        raise ZeroBubbleConfigError(f"{flag} with --overlap-grad-reduce and {placement.models_per_rank} model chunks "
                                    "per rank: the replicas' schedules differ, so their chunks' gradient reductions "
                                    "would start in different orders; drop --overlap-grad-reduce")


@dataclass
class Balanced:
    """One iteration's balanced data and schedule for this rank's replica."""

    iterators: List[Any]
    num_microbatches: int
    built: Built
    microbatches_per_replica: List[int]
    plan_seconds: float


def split_rows(batch: dict) -> List[dict]:
    """A microbatch's rows as sequences (each a dict of its own [s, ...] tensors; None kept)."""
    ref = batch.get("tokens")
    if ref is None:
        ref = next((v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() >= 2), None)
    if ref is None:
        raise ZeroBubbleConfigError("--zero-bubble-balance-microbatches: a microbatch needs [batch, sequence] tensors "
                                    "(tokens, labels, loss_mask, position_ids)")
    b, s = int(ref.shape[0]), int(ref.shape[1])
    out = []
    for i in range(b):
        row = {}
        for k, v in batch.items():
            if isinstance(v, torch.Tensor) and v.dim() == 4 and tuple(v.shape[1:]) == (1, s, s):
                row[k] = v[i]  # a [1, s, s] attention mask (Megatron's: True = masked)
            elif isinstance(v, torch.Tensor):
                if v.dim() < 2 or v.shape[0] != b or v.shape[1] != s:
                    raise ZeroBubbleConfigError(f"--zero-bubble-balance-microbatches: microbatch key {k!r} has shape "
                                                f"{tuple(v.shape)}, not [batch {b}, sequence {s}, ...] or an attention "
                                                f"mask [batch {b}, 1, {s}, {s}]")
                row[k] = v[i]
            elif v is None:
                row[k] = None
            else:
                raise ZeroBubbleConfigError(f"--zero-bubble-balance-microbatches: microbatch key {k!r} holds a "
                                            f"{type(v).__name__}, not a tensor")
        out.append(row)
    return out


def _length(row: dict) -> int:
    return int(next(v for v in row.values() if v is not None and v.dim() == 1).shape[0])


def _pad_mask(m: torch.Tensor, top: int) -> torch.Tensor:
    """A [1, s, s] attention mask (True = masked) to [1, top, top]: a real token sees no pad; a pad
    sees what causal attention lets it (values, never a fully masked row)."""
    n = int(m.shape[-1])
    out = torch.triu(torch.ones((top, top), dtype=torch.bool, device=m.device), diagonal=1).unsqueeze(0)
    out[:, :n, :] = True
    out[:, :n, :n] = m.bool()
    return out.to(m.dtype)


def collate(rows: Sequence[dict]) -> dict:
    """Rows padded to the longest: zeros past each sequence's end (loss mask 0 there), positions
    counted on, attention masks widened (``_pad_mask``)."""
    top = max(_length(r) for r in rows)
    out = {}
    for k in rows[0]:
        if rows[0][k] is None:
            out[k] = None
            continue
        parts = []
        for r in rows:
            v = r[k]
            n = int(v.shape[0]) if v.dim() != 3 else int(v.shape[-1])
            if v.dim() == 3:  # [1, s, s] attention mask
                parts.append(_pad_mask(v, top) if n < top else v)
                continue
            if n < top:
                if k in POSITION_KEYS:
                    pad = torch.arange(n, top, dtype=v.dtype, device=v.device)
                    pad = pad.view(-1, *([1] * (v.dim() - 1))).expand(top - n, *v.shape[1:])
                else:
                    pad = torch.zeros((top - n,) + tuple(v.shape[1:]), dtype=v.dtype, device=v.device)
                v = torch.cat([v, pad])
            parts.append(v)
        out[k] = torch.stack(parts)
    return out


class MicrobatchBalancer:
    """The balancer of one forward-backward function (templates and caps kept across iterations)."""

    def __init__(self, options):
        self.options = options
        self.templates: Optional[Templates] = None
        self.last: Optional[Balanced] = None
        self.iterations = 0
        self.plan_seconds = 0.0  # summed over iterations

    def __call__(self, iterators: List[Any], num_microbatches: int, p: int, me: int, config, seq_length: int,
                 dp_group, dp_rank: int, dp_size: int) -> Balanced:
        t0 = time.perf_counter()
        readers = [i for i, it in enumerate(iterators) if it is not None]
        mine = None
        if readers:
            pulled = [[next(iterators[i]) for _ in range(num_microbatches)] for i in readers]
            mine = [row for batch in pulled[0] for row in split_rows(batch)]
        lengths_mine = None if mine is None else [_length(r) for r in mine]
        gathered: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (dp_rank, lengths_mine))
        per_replica: List[Optional[List[int]]] = [None] * dp_size
        for d, ls in gathered:
            if ls is not None:
                if per_replica[d] is not None and per_replica[d] != ls:
                    raise ZeroBubbleConfigError(f"data-parallel replica {d}: its ranks read different sequence lengths "
                                                f"({per_replica[d][:4]}... and {ls[:4]}...): every rank of a replica "
                                                "must read the same microbatches")
                per_replica[d] = ls
        missing = [d for d, ls in enumerate(per_replica) if ls is None]
        if missing:
            raise ZeroBubbleConfigError(f"--zero-bubble-balance-microbatches: no rank of data-parallel replica(s) "
                                        f"{missing} reads data")
        offsets = [0]
        for ls in per_replica:
            offsets.append(offsets[-1] + len(ls))
        lengths = [s for ls in per_replica for s in ls]
        rows_per_mb = max(1, len(per_replica[0]) // max(1, num_microbatches))
        o = self.options
        req = o.request().replace(offload=None)
        if self.templates is None:
            self.templates = Templates(req, p, num_microbatches)
        att = o.balance_attention_share
        model = LengthModel.simple(seq_length, attention=attention_share_of(config, seq_length) if att is None else att)
        cfg = VarlenConfig(dp_size, model, micro_batch_size=rows_per_mb)
        plan = plan_batch(lengths, req, p, cfg, True, self.templates, replica=dp_rank)
        rp = plan.replicas[dp_rank]
        new_iters: List[Any] = [None] * len(iterators)
        if mine is not None:
            everyone: List[Any] = [None] * dist.get_world_size(dp_group)
            dist.all_gather_object(everyone, mine, group=dp_group)
            rows = [row for part in everyone for row in part]
            batches = [collate([rows[i] for i in mb]) for mb in rp.microbatches]
            for i in readers:
                new_iters[i] = iter(list(batches))
        try:
            built = build(o.request(), p, rp.num_microbatches, base=rp.schedule)
        except Exception as e:  # a core error: one line, naming the iteration's microbatch count
            raise ZeroBubbleConfigError(f"{o.schedule}: the balanced schedule for {rp.num_microbatches} microbatches: "
                                        f"{e}") from None
        self.last = Balanced(new_iters, rp.num_microbatches, built, [r.num_microbatches for r in plan.replicas],
                             time.perf_counter() - t0)
        self.iterations += 1
        self.plan_seconds += self.last.plan_seconds
        return self.last
