"""Each model chunk's own cost, from its layout: F/B/W seconds, activation bytes and parameters of
the embedding, the transformer layers, the MTP layers and the output layer + loss it holds
(``core.costs.model.ModelSpec``'s per-layer formulas at a GPU's peak x efficiency). Pure Python.

A chunk is a virtual stage of ``core.costs.layout.Layout`` (pipeline order); its values go to the core
per chunk (``ir.Setting`` takes one value per model chunk). Where MTP layers sit in a chunk before
the loss's, the shared output layer and loss they compute again run with the loss (Megatron's
multi-token prediction), so that part is charged to the loss's chunk.

Tied embeddings: the output layer uses the embedding's weight. On another rank than the embedding
it keeps a copy (Megatron's), counted there; on the embedding's rank (a V) it is the same tensor.
A replicated placement (BitPipe) has one embedding and one loss per path, each counted on its
rank; its per-chunk values are per logical stage (each path's copy runs the same layers)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional

from ..ir import Placement, ScheduleError
from .layout import Layout, from_counts
from .model import ModelSpec

__all__ = ["ChunkCosts", "UnitCosts", "chunk_costs", "unit_costs", "in_seconds", "stage_work", "vocab_setting"]


@dataclass
class ChunkCosts:
    """Per chunk (virtual stage, pipeline order): seconds of one microbatch's F, B, W and of its
    expert-parallel all-to-all (in an F, and again in a B), activation bytes held from F to B
    (mem_f) and from B to W (mem_w); per rank: parameters. B and W carry the split's overhead
    (``ModelSpec.split_overhead_s``), the fused backward ``cost_bw`` none."""

    layout: Layout
    cost_f: List[float]
    cost_b: List[float]
    cost_w: List[float]
    cost_a2a: List[float]
    mem_f: List[float]
    mem_w: List[float]
    params: List[float]
    cost_bw: List[float] = dataclasses.field(default_factory=list)

    def rank_sum(self, name: str, placement: Placement) -> List[float]:
        """Per rank, the sum of ``name`` over the chunks it holds (one path's share when replicated)."""
        values = getattr(self, name)
        out = [0.0] * placement.num_ranks
        for s in range(placement.num_stages):
            out[placement.rank_of(s)] += values[placement.logical(s)] / placement.num_paths
        return out


def _flops(spec: ModelSpec, stage: str, layers: range, mtp_total: int, vocab: bool = False, recomputed: int = 0):
    """(F, B, W) FLOPs, (M_B, M_W) bytes and all-to-all bytes of one chunk's content. ``vocab``:
    vocabulary parallelism takes the output layer and loss off the loss's chunk (``vocab_setting``);
    it keeps the final norm's input and output. ``recomputed``: the chunk's first that many layers
    recompute their forward in B (the block method: ``ModelSpec.recomputed_layers``)."""
    f = [0.0, 0.0, 0.0]
    m = [0.0, 0.0]
    a2a = 0.0

    def add(x, y=None):
        for k in range(3):
            f[k] += x[k]
        if y is not None:
            m[0] += y[0]
            m[1] += y[1]

    if "E" in stage:
        add(spec.embedding_flops(), (spec.embedding_activation_bytes(), 0.0))
    again = spec.recomputing() if recomputed else None
    for k, i in enumerate(layers):
        one = again if k < recomputed else spec
        add(one.layer_flops(i), one.layer_activation_bytes(i))
        a2a += spec.layer_a2a_bytes(i)
    n_mtp = stage.count("m")
    for _ in range(n_mtp):
        add(spec.mtp_layer_flops(with_output=False), spec.mtp_activation_bytes(with_output=False))
        a2a += spec.layer_a2a_bytes(spec.num_layers - 1)
    if "L" in stage and vocab:
        e, tp = spec.activation_bytes, spec.tensor_parallel_size
        m[0] += 2 * e * spec.seq_length * spec.micro_batch_size * spec.hidden_size / (tp if spec.sequence_parallel else 1)
    elif "L" in stage:
        add(spec.output_flops(), spec.loss_activation_bytes())
        for _ in range(mtp_total):  # each MTP layer's shared output layer and loss run here
            add(spec.output_flops(), spec.loss_activation_bytes())
    return f, m, a2a


def stage_work(spec: ModelSpec, layout: Layout) -> List[float]:
    """FLOPs of one microbatch's F + B + W per chunk (what a layout balances)."""
    out = []
    for stage, layers in zip(layout.stages, layout.layer_ranges()):
        f, _, _ = _flops(spec, stage, layers, layout.num_mtp_layers)
        out.append(sum(f))
    return out


def chunk_costs(spec: ModelSpec, layout: Layout, placement: Placement, flops_per_s: float,
                ep_bytes_per_s: float, vocab: bool = False, vocab_embedding: bool = False,
                split_overhead: Optional[float] = None) -> ChunkCosts:
    """Each chunk's costs for ``layout`` on ``placement`` (whose logical stages it must describe);
    ``vocab``: with vocabulary parallelism (the output layer in ``vocab_setting``'s passes);
    ``vocab_embedding``: the input embedding split over the ranks too (each holds V / P of its rows:
    tied, they are its output shard; the first stage's rank keeps no whole embedding).
    ``split_overhead``: what the split adds per transformer layer in the costs' unit (default
    ``spec.split_overhead_s``: seconds; ``unit_costs`` gives it in FLOPs)."""
    if layout.num_stages != placement.num_logical_stages:
        raise ScheduleError(f"layout {layout} has {layout.num_stages} stages; the placement runs "
                            f"{placement.num_logical_stages} model chunks")
    if layout.num_layers != spec.num_layers:
        raise ScheduleError(f"layout {layout} holds {layout.num_layers} transformer layers, the model "
                            f"{spec.num_layers}")
    if layout.num_mtp_layers != spec.mtp_num_layers:
        raise ScheduleError(f"layout {layout} holds {layout.num_mtp_layers} MTP layers, the model "
                            f"{spec.mtp_num_layers} (--mtp-num-layers)")
    over = spec.split_overhead_s if split_overhead is None else split_overhead
    cf, cb, cw, cbw, ca, mf, mw, par = [], [], [], [], [], [], [], []
    for lg, (stage, layers) in enumerate(zip(layout.stages, layout.layer_ranges())):
        f, m, a2a = _flops(spec, stage, layers, layout.num_mtp_layers, vocab,
                           spec.recomputed_layers(placement.rank_of(_physical(placement, lg)), lg, layout.num_stages,
                                                  len(layers)))
        split = over * (len(layers) + stage.count("m") + (0.25 if "L" in stage and not vocab else 0.0)) / 2
        cf.append(f[0] / flops_per_s)
        cb.append(f[1] / flops_per_s + split)
        cw.append(f[2] / flops_per_s + split)
        cbw.append((f[1] + f[2]) / flops_per_s)
        ca.append(a2a / ep_bytes_per_s if ep_bytes_per_s > 0 else 0.0)
        mf.append(m[0])
        mw.append(m[1])
        p = sum(spec.params_per_layer(i) for i in layers) + stage.count("m") * spec.mtp_params()
        par.append(p)
    params = [0.0] * placement.num_ranks
    last = layout.num_stages - 1
    for s in range(placement.num_stages):
        r, l = placement.rank_of(s), placement.logical(s)
        params[r] += par[l]
        path = placement.path(placement.path_of(s))
        if l == 0 and not (vocab and vocab_embedding):
            params[r] += spec.embedding_params()
        if l == last and not vocab:
            if spec.untie_embeddings_and_output_weights:
                params[r] += spec.output_params()
            elif placement.rank_of(path[0]) != r:  # the tied weight's copy on the loss's rank
                params[r] += spec.embedding_params()
    if vocab:  # every rank holds its shard of the output layer (tied: of the embedding's weight)
        shards = 2 if vocab_embedding and spec.untie_embeddings_and_output_weights else 1  # untied: the input's too
        for r in range(placement.num_ranks):
            params[r] += shards * spec.embedding_params() / placement.num_ranks
    return ChunkCosts(layout, cf, cb, cw, ca, mf, mw, params, cbw)


def _physical(placement: Placement, logical: int) -> int:
    """A physical stage of ``placement`` that runs logical stage ``logical`` (itself without replicas)."""
    if placement.paths is None:
        return logical
    return next(s for s in range(placement.num_stages) if placement.logical(s) == logical)


def vocab_setting(spec: ModelSpec, p: int, flops_per_s: float, bytes_per_s: float, barriers: int = 1,
                  mem_unit: float = 1.0, embedding: bool = False):
    """The vocabulary passes of ``spec`` over ``p`` pipeline ranks (``core.ir.vocab.VocabSetting``):
    each rank's shard of the output layer (V / (p x TP) rows). One barrier: VS computes the logits,
    their statistics and the shard's part of the input gradient (two GEMMs), VT the softmax and the
    logits' gradient (elementwise); two barriers: VS the logits and statistics, VT the input
    gradient's part. VW the shard's weight gradient. Memory (units of ``mem_unit`` bytes): VS holds
    the fp32 logits shard and a copy of the hidden states until VT, VW's the logits' gradient and
    the hidden states. A barrier: the statistics (4 floats per token), and the input gradient
    (s b h elements) gathered to (one barrier) or summed on (two) the loss's rank. ``embedding``: the
    input embedding split too: VI the lookup of the rank's rows (an elementwise pass over the s b h
    output), VG their weight gradient (the embedding's W: a scatter-add of s b h), CI the sum of the
    partial outputs on the first stage's rank (a reduce: (p - 1) / p of them over the link), CG the
    broadcast of their gradient from there (the same); each holds the embedding output (e s b h)."""
    from ..ir.vocab import VocabSetting
    f, b, w = (x / p for x in spec.output_flops())
    tokens = spec.seq_length * spec.micro_batch_size
    shard = spec.vocab_size / (p * spec.tensor_parallel_size)
    e = spec.activation_bytes
    soft = 10.0 * tokens * shard  # softmax, its gradient: a few operations per logit
    hidden = e * tokens * spec.hidden_size
    if barriers == 1:
        cs, ct = (f + b) / flops_per_s, soft / flops_per_s
        moved = hidden * (p - 1) + 16.0 * tokens * p
    else:
        cs, ct = (f + soft) / flops_per_s, b / flops_per_s
        moved = 2.0 * hidden * (p - 1) / p + 16.0 * tokens * p
    split = {}
    if embedding:
        out = hidden / spec.tensor_parallel_size  # the embedding output (VocabParallelEmbedding's, per TP rank)
        link = out * (p - 1) / p / bytes_per_s if bytes_per_s > 0 else 0.0
        split = dict(embedding=True, cost_i=2.0 * out / e / flops_per_s, cost_g=spec.embedding_flops()[2] / flops_per_s,
                     cost_ci=link, cost_cg=link, mem_i=out / mem_unit)
    return VocabSetting(barriers=barriers, cost_s=cs, cost_t=ct, cost_w=w / flops_per_s,
                        cost_comm=moved / bytes_per_s if bytes_per_s > 0 else 0.0,
                        mem_s=(4.0 * tokens * shard + hidden) / mem_unit, mem_w=(e * tokens * shard + hidden) / mem_unit,
                        **split)


@dataclass
class UnitCosts:
    """A layout's per-chunk costs in the units training plans its schedule with (``unit_costs``):
    F/B/W in units of the busiest rank's F (``time_flops`` FLOPs), activations in units of the fullest
    rank's (``unit_bytes``), and with vocabulary parallelism its passes in the same units."""

    cost_f: List[float]
    cost_b: List[float]
    cost_w: List[float]
    mem_f: List[float]
    mem_w: List[float]
    time_flops: float
    unit_bytes: float
    vocab: Optional[object] = None  # core.ir.vocab.VocabSetting
    cost_bw: Optional[List[float]] = None  # the fused backward, where the split costs (None: B + W)

    def seconds(self, flops_per_s: float) -> float:
        """One time unit in seconds at ``flops_per_s``."""
        return self.time_flops / flops_per_s


def unit_costs(spec: ModelSpec, layout: Optional[Layout], placement: Placement, barriers: Optional[int] = None,
               embedding: bool = False, flops_per_s: float = 989.0 * 0.5 * 1e12,
               link_bytes_per_s: float = 50e9) -> UnitCosts:
    """``layout``'s chunks on ``placement`` (None: the even split) as training plans them from the
    model's flags, and as ``plan`` builds a row's schedule, so that both build the same one:
    ``chunk_costs`` in FLOPs and bytes over the busiest rank's F and the fullest rank's activation.
    ``barriers``: with vocabulary parallelism (``vocab_setting``; ``embedding``: the input embedding
    split too), its collectives at ``link_bytes_per_s`` against ``flops_per_s`` of compute."""
    if layout is None:
        S, L = placement.num_logical_stages, spec.num_layers
        if L % S:
            raise ScheduleError(f"{L} layers do not split evenly over {S} model chunks")
        layout = from_counts([L // S] * S, spec.mtp_num_layers)
    vocab = barriers is not None
    cc = chunk_costs(spec, layout, placement, 1.0, 1.0, vocab=vocab, vocab_embedding=vocab and embedding,
                     split_overhead=spec.split_overhead_s * flops_per_s)
    t = max(cc.rank_sum("cost_f", placement)) or 1.0
    u = max(cc.rank_sum("mem_f", placement)) or 1.0
    vs = None
    if vocab:
        link = link_bytes_per_s * t / flops_per_s  # bytes per time unit
        vs = vocab_setting(spec, placement.num_ranks, t, link, barriers, mem_unit=u, embedding=embedding)
    return UnitCosts([x / t for x in cc.cost_f], [x / t for x in cc.cost_b], [x / t for x in cc.cost_w],
                     [x / u for x in cc.mem_f], [x / u for x in cc.mem_w], t, u, vs,
                     [x / t for x in cc.cost_bw] if spec.split_overhead_s else None)


def in_seconds(setting, unit_s: float):
    """``setting`` (``ir.Setting``) with every time multiplied by ``unit_s`` (seconds per unit)."""
    times = {k: [x * unit_s for x in getattr(setting, k)] for k in ("cost_f", "cost_b", "cost_w", "cost_a2a")}
    vocab = setting.vocab
    if vocab is not None:
        vocab = dataclasses.replace(vocab, **{k: [x * unit_s for x in getattr(vocab, k)]
                                              for k in ("cost_s", "cost_t", "cost_w", "cost_i", "cost_g")},
                                    **{k: getattr(vocab, k) * unit_s for k in ("cost_comm", "cost_ci", "cost_cg")})
    if setting.cost_bw is not None:
        times["cost_bw"] = [x * unit_s for x in setting.cost_bw]
    return dataclasses.replace(setting, cost_comm=setting.cost_comm * unit_s, cost_sync=setting.cost_sync * unit_s,
                               vocab=vocab, **times)
