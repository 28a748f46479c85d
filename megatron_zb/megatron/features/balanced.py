"""--zero-bubble-balance-microbatches at run time: each training iteration's global batch balanced
over the data-parallel replicas and microbatches, with the per-microbatch schedule for it.

Megatron hands every replica ``num_microbatches`` microbatches from its own data iterator. Here,
before the iteration's schedule is built (every rank of every replica does the same, so all
agree without further messages):

1. the ranks that read data take this iteration's microbatches from their iterators and split
   them into sequences (each row of a microbatch is one sequence of the microbatch's length);
2. every rank learns every replica's sequence lengths (one all-gather of a few integers);
3. the balancer and the list scheduler of the schedule core (``core.varlen.batch.plan_batch``) decide
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

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from ...core.build import Built, build
from ...core.ir import B, BW, F, W
from ...core.costs.microbatch_costs import LengthModel, fit_stages, microbatch_shape
from ...core.varlen.batch import Templates, VarlenConfig, plan_batch
from ..errors import ZeroBubbleConfigError

__all__ = ["MicrobatchBalancer", "Balanced", "attention_share_of", "check_balance_config", "split_rows", "collate",
           "collate_packed", "packed_seq_params"]

#: keys of a microbatch whose rows are padded with 0 past a sequence's end (the rest: arange)
POSITION_KEYS = ("position_ids",)


def attention_share_of(config, seq_length: int) -> float:
    """The share of a transformer layer's F at ``seq_length`` spent in attention (Q.K^T and
    scores.V over the s x s scores, as ``core.costs.model`` counts them), from Megatron's model config."""
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
    lengths: Optional[List[List[int]]] = None  # this replica's microbatches' sequence lengths, in run order
    core_seconds: float = 0.0  # of plan_seconds: the schedule core's (balancer, schedule, build, lowering)
    packed: bool = False  # microbatches in Megatron's packed-sequence format (THD)

    def shapes(self) -> dict:
        """mb -> (tokens, sum of s^2) as the passes see them (rows padded to the longest, or packed)."""
        return {i: microbatch_shape(ls, packed=self.packed) for i, ls in enumerate(self.lengths or [])}


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


@dataclass(frozen=True)
class CausalMask:
    """A row's [1, n, n] causal attention mask (True above the diagonal) as it travels between the
    replicas: its size, not its n^2 values (``pack_masks`` / ``unpack_masks``)."""

    n: int
    dtype: Any
    device: str

    def tensor(self) -> torch.Tensor:
        m = torch.triu(torch.ones((self.n, self.n), dtype=torch.bool, device=self.device), diagonal=1)
        return m.unsqueeze(0).to(self.dtype)


def pack_masks(row: dict) -> dict:
    """``row`` with each causal [1, n, n] attention mask as a ``CausalMask`` (others as they are)."""
    out = dict(row)
    for k, v in row.items():
        if isinstance(v, torch.Tensor) and v.dim() == 3 and v.shape[0] == 1 and v.shape[1] == v.shape[2]:
            c = CausalMask(int(v.shape[-1]), v.dtype, str(v.device))
            if torch.equal(v.bool(), c.tensor().bool()):
                out[k] = c
    return out


def unpack_masks(row: dict) -> dict:
    return {k: v.tensor() if isinstance(v, CausalMask) else v for k, v in row.items()}


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


def collate_packed(rows: Sequence[dict]) -> dict:
    """Rows as one microbatch in Megatron's packed-sequence format (Megatron-LM's ``--sft`` batches):
    every [s, ...] key the sequences one after another as [1, tokens, ...] (each keeps its own
    positions), ``cu_seqlens`` [1, n + 1] (int32) where each starts, ``max_seqlen`` [1] the longest;
    no attention mask (each sequence attends causally within itself)."""
    lengths = [_length(r) for r in rows]
    out: dict = {}
    for k in rows[0]:
        v0 = rows[0][k]
        if v0 is None or (isinstance(v0, torch.Tensor) and v0.dim() == 3):  # an attention mask: cu_seqlens say it
            out[k] = None
            continue
        out[k] = torch.cat([r[k] for r in rows]).unsqueeze(0)
    device = next(v.device for v in out.values() if isinstance(v, torch.Tensor))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    out["attention_mask"] = None
    out["cu_seqlens"] = cu.unsqueeze(0).to(device)
    out["max_seqlen"] = torch.tensor([max(lengths)], dtype=torch.int32, device=device)
    return out


def packed_seq_params(batch: Optional[dict]):
    """Megatron's ``PackedSeqParams`` (THD) for a packed microbatch (``collate_packed``), None for
    any other."""
    if not batch or batch.get("cu_seqlens") is None:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams
    cu = batch["cu_seqlens"].reshape(-1).to(torch.int32)
    top = int(batch["max_seqlen"].reshape(-1)[0])
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=top, max_seqlen_kv=top)


def packed_metadata(lengths: Sequence[int], device) -> dict:
    """What a pipeline stage without data (a middle stage) needs of a packed microbatch: where its
    sequences start (``cu_seqlens``) and the longest (``max_seqlen``)."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(list(lengths), dtype=torch.int32), 0)
    return {"cu_seqlens": cu.unsqueeze(0).to(device),
            "max_seqlen": torch.tensor([max(lengths)], dtype=torch.int32, device=device)}


def calibration_of(profile: dict, seq_length: int) -> Optional[dict]:
    """The length cost model fitted to a profile window's passes (``core.costs.microbatch_costs.fit_stages``
    on the profile's ``length_samples``): the shares per kind and each stage's reference costs (F,
    B, W, in units of their mean F; the hop time in the same unit), or None where the window's
    microbatches held too few distinct shapes. A schedule that fuses B and W (BW) gives B the
    fused pass and W nothing."""
    raw = profile.get("length_samples") or {}
    samples = {k: {int(s): [tuple(x) for x in xs] for s, xs in (raw.get(k) or {}).items()} for k in (F, B, W, BW)}
    if not samples[B] and samples[BW]:
        samples[B], samples[W] = samples[BW], {}
    got = fit_stages({k: samples[k] for k in (F, B, W)}, seq_length)
    if got is None:
        return None
    model, ref = got
    n = len(ref[F])
    unit = sum(ref[F]) / n if n and sum(ref[F]) > 0 else 1.0
    floor = 1e-6  # a stage's fit at or below zero (noise, a short window): a token cost, the schedule stays valid
    costs = {k: [max(x / unit, floor if k != W else 0.0) for x in ref.get(k, [0.0] * n)] for k in (F, B, W)}
    return {"attention": dict(model.attention), "overhead": dict(model.overhead),
            "cost_f": costs[F], "cost_b": costs[B], "cost_w": costs[W],
            "cost_comm": float(profile.get("cost_comm") or 0.0) / unit, "samples": sum(len(v) for v in samples[F].values())}


def agree(calibrations: Sequence[dict]) -> dict:
    """One calibration from every pipeline's (the mean of each share and cost): every rank of every
    replica must plan with the same costs (their plans must agree on which replica runs which
    sequence)."""
    n = len(calibrations)
    out: dict = {}
    for what in ("attention", "overhead"):
        kinds = sorted({k for c in calibrations for k in c[what]})
        out[what] = {k: sum(c[what].get(k, 0.0) for c in calibrations) / n for k in kinds}
    for k in ("cost_f", "cost_b", "cost_w"):
        out[k] = [sum(c[k][i] for c in calibrations) / n for i in range(len(calibrations[0][k]))]
    out["cost_comm"] = sum(c["cost_comm"] for c in calibrations) / n
    out["samples"] = sum(c["samples"] for c in calibrations)
    return out


class MicrobatchBalancer:
    """The balancer of one forward-backward function (templates and caps kept across iterations).
    Its cost model: each sequence's cost from ``--zero-bubble-attention-share`` (or the model's
    shape) until a profile window has measured passes at several lengths (``calibrate``); then the
    model and the reference costs fitted to them, agreed over every pipeline at the next iteration."""

    def __init__(self, options):
        self.options = options
        self.templates: Optional[Templates] = None
        self.last: Optional[Balanced] = None
        self.iterations = 0
        self.plan_seconds = 0.0  # summed over iterations (the all-gathers and row exchange included)
        self.core_seconds = 0.0  # of which the schedule core's: balancer, schedule, build and lowering
        self.first_seconds = 0.0  # the first iteration's (the reference template built)
        self.read_seconds = 0.0  # of plan_seconds: reading the microbatches from Megatron's data iterators
        self.pending: Optional[dict] = None  # this pipeline's fit, until every pipeline has agreed on one
        self.calibrated: Optional[dict] = None  # the agreed fit planning uses (None: not calibrated yet)
        self.calibration_note: Optional[str] = None

    def calibrate(self, profile: dict, seq_length: int) -> str:
        """Fit the length model to the profile window's passes (applied, agreed, at the next call);
        returns a line saying what was fitted, or why nothing was."""
        c = self.pending = calibration_of(profile, seq_length)
        if c is None:
            self.calibration_note = ("the profile window's microbatches held fewer than 3 distinct shapes: the length "
                                     "cost model stays " + ("--zero-bubble-attention-share's" if
                                                            self.options.balance_attention_share is not None
                                                            else "the one from the model's shape"))
            return self.calibration_note
        shares = ", ".join(f"{k} attention {c['attention'].get(k, 0.0):.3f} fixed {c['overhead'].get(k, 0.0):.3f}"
                           for k in (F, B, W))
        return (f"length cost model fitted to the profile window's {c['samples']} forward passes ({shares}; F:B:W "
                f"{sum(c['cost_f']):.2f}:{sum(c['cost_b']):.2f}:{sum(c['cost_w']):.2f}), planned with from the next "
                "iteration (the mean over the data-parallel replicas)")

    def _request(self):
        req = self.options.request().replace(offload=None)
        c = self.calibrated
        if c is not None:
            req = req.replace(cost_f=c["cost_f"], cost_b=c["cost_b"], cost_w=c["cost_w"], cost_comm=c["cost_comm"])
        return req

    def summary(self) -> str:
        """Planning time per iteration, for the session's last line."""
        n = self.iterations
        rest = (self.plan_seconds - self.first_seconds) / (n - 1) if n > 1 else self.plan_seconds
        return (f"planning {1e3 * self.first_seconds:.1f} ms the first iteration (templates built), then "
                f"{1e3 * rest:.1f} ms per iteration; of it on average the data read {1e3 * self.read_seconds / n:.1f} ms, "
                f"the schedule core {1e3 * self.core_seconds / n:.1f} ms, the rest the all-gathers"
                + (", the length cost model calibrated" if self.calibrated is not None else ""))

    def model(self, config, seq_length: int) -> LengthModel:
        c = self.calibrated
        if c is not None:
            return LengthModel(seq_length, c["attention"], c["overhead"])
        att = self.options.balance_attention_share
        return LengthModel.simple(seq_length, attention=attention_share_of(config, seq_length) if att is None else att)

    def __call__(self, iterators: List[Any], num_microbatches: int, p: int, config, seq_length: int,
                 dp_group, dp_rank: int, dp_size: int) -> Balanced:
        t0 = time.perf_counter()
        readers = [i for i, it in enumerate(iterators) if it is not None]
        mine = None
        if readers:
            pulled = [[next(iterators[i]) for _ in range(num_microbatches)] for i in readers]
            mine = [row for batch in pulled[0] for row in split_rows(batch)]
        self.read_seconds += time.perf_counter() - t0  # Megatron's data loading, done here rather than in its steps
        lengths_mine = None if mine is None else [_length(r) for r in mine]
        gathered: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (dp_rank, lengths_mine, self.pending))
        fits = [c for _, _, c in gathered if c is not None]
        if fits:  # a profile window has just ended: every rank takes the same (mean) fit
            self.calibrated, self.templates, self.pending = agree(fits), None, None
            self.calibration_note = None
        per_replica: List[Optional[List[int]]] = [None] * dp_size
        for d, ls, _ in gathered:
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
        req = self._request()
        if self.templates is None:
            self.templates = Templates(req, p, num_microbatches)
        packed = bool(getattr(o, "balance_pack", False))
        cfg = VarlenConfig(dp_size, self.model(config, seq_length), micro_batch_size=rows_per_mb, packed=packed)
        t1 = time.perf_counter()
        try:
            plan = plan_batch(lengths, req, p, cfg, True, self.templates, replica=dp_rank)
        except Exception as e:  # a core error: one line
            raise ZeroBubbleConfigError(f"{o.schedule}: balancing {len(lengths)} sequences over {dp_size} data-parallel "
                                        f"replica(s): {e}") from None
        rp = plan.replicas[dp_rank]
        core = time.perf_counter() - t1
        new_iters: List[Any] = [None] * len(iterators)
        if mine is not None:
            everyone: List[Any] = [None] * dist.get_world_size(dp_group)
            dist.all_gather_object(everyone, [pack_masks(r) for r in mine], group=dp_group)  # causal masks: sizes
            rows = [unpack_masks(row) for part in everyone for row in part]
            batches = [(collate_packed if packed else collate)([rows[i] for i in mb]) for mb in rp.microbatches]
            for i in readers:
                new_iters[i] = iter(list(batches))
        if packed:  # every other chunk (a middle stage, a tensor-parallel rank that reads nothing): the sequences' bounds
            dev = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
            meta = [packed_metadata(ls, dev) for ls in rp.lengths]
            for i in range(len(iterators)):
                if new_iters[i] is None:
                    new_iters[i] = iter(list(meta))
        try:
            t1 = time.perf_counter()
            built = build(o.request(), p, rp.num_microbatches, base=rp.schedule)
            # timed with each microbatch's own costs: the messages are ordered for the lengths that run
            built = dataclasses.replace(built, setting=dataclasses.replace(
                built.setting, microbatch_costs=rp.setting.microbatch_costs), _result=None, _lowered={})
            built.lowered()
            core += time.perf_counter() - t1
        except Exception as e:  # a core error: one line, naming the iteration's microbatch count
            raise ZeroBubbleConfigError(f"{o.schedule}: the balanced schedule for {rp.num_microbatches} microbatches: "
                                        f"{e}") from None
        self.last = Balanced(new_iters, rp.num_microbatches, built, [r.num_microbatches for r in plan.replicas],
                             time.perf_counter() - t0, rp.lengths, core, packed)
        if not self.iterations:
            self.first_seconds = self.last.plan_seconds
        self.iterations += 1
        self.plan_seconds += self.last.plan_seconds
        self.core_seconds += core
        return self.last
