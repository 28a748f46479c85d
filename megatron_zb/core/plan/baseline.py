"""Megatron's best configuration that fits (issue 55): the reference plan's speed-ups are taken
against. Pure Python.

What an unmodified Megatron-LM runs, with only flags it accepts: its 1F1B, or its interleaved 1F1B
(``--num-virtual-stages-per-pipeline-rank V``: M a multiple of P, as Megatron asks, and V chunks
of whole layers), its layouts (the even split, or a balanced one through its own
``--pipeline-model-parallel-layout``; interleaved, where neither fits, also that layout with each
rank's first chunk a layer lighter, as plan's own rows try), its activation recompute (none;
``selective``; ``full`` with ``--recompute-method block --recompute-num-layers N``: the first N
layers of every chunk; ``full`` with the ``uniform`` method: every layer), a fused backward (no
B/W split, no vocabulary parallelism, no offload). Each candidate is costed and timed as plan's rows are
(``plan.row``); the fastest that fits is the baseline (of equally fast ones the one met first:
the least recompute, 1F1B before interleaving). Each schedule's recompute is tried from the least
(none, selective, block 1, 2, ..., uniform) to the first that fits: more only costs time (selective
only without flash attention, where it keeps less). Megatron has no post-validation: the baseline is
timed with its synchronous step, and ``speedup_vs_megatron`` compares a row's time as plan ranks it
with that.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from ..costs.model import ModelSpec
from ..schedules.search.auto import TIE
from .levers import light_request
from .request import CHUNK_CHOICES, PlanRequest, VocabLever
from .row import row as one_row

__all__ = ["megatron_baseline", "against"]


def _recomputes(spec: ModelSpec, most: int) -> List[Tuple[str, ModelSpec]]:
    """(the recompute flags, the model with them), from none to the most: none, selective, block
    1..``most`` (layers per chunk), uniform (every layer). Not selective with flash attention: it
    keeps no attention scores either way, so selective recompute keeps the same bytes for more time
    (it fits exactly where no recompute does)."""
    base = dataclasses.replace(spec, recompute=None, recompute_method=None, recompute_num_layers=1,
                               recompute_counts=None)
    out = [("", base)]
    if not spec.flash_attention:
        out.append((" --recompute-granularity selective", dataclasses.replace(base, recompute="selective")))
    for n in range(1, most + 1):
        out.append((f" --recompute-granularity full --recompute-method block --recompute-num-layers {n}",
                    dataclasses.replace(base, recompute="full", recompute_method="block", recompute_num_layers=n)))
    out.append((" --recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                dataclasses.replace(base, recompute="full", recompute_method="uniform", recompute_num_layers=1)))
    return out


def _megatron_flags(r: dict, p: int, recompute: str) -> str:
    """The row's flags as Megatron's own: no megatron-zb flag."""
    f = [f"--pipeline-model-parallel-size {p}"]
    if r["schedule"] == "interleaved-1f1b":
        f.append(f"--num-virtual-stages-per-pipeline-rank {r['chunks']}")
    counts = r["layers_per_stage"]
    if len(set(counts)) > 1:
        f.append(f"--pipeline-model-parallel-layout '{r['layout']}'")
    return " ".join(f) + recompute


def _candidates(request: PlanRequest) -> List[Tuple[str, int]]:
    """Megatron's schedules here: (name, chunks per rank)."""
    p, m, layers = request.pipeline_parallel_size, request.microbatches, request.model.num_layers
    out = [("1f1b", 1)]
    if m % p == 0:
        out += [("interleaved-1f1b", v) for v in CHUNK_CHOICES if layers >= p * v]
    return out


def megatron_baseline(request: PlanRequest) -> Tuple[Optional[dict], Optional[str]]:
    """(the fastest of Megatron's own configurations that fits, None) or (None, why none does). The
    row has ``schedule``, ``flags`` (Megatron's only), ``iteration_time_s``, ``peak_bytes`` (per
    rank), ``fits``, ``bubble_rate``, ``layout``, ``recompute``."""
    key = "iteration_time_s"  # Megatron's synchronous optimizer step
    base = request.replace(vocab=VocabLever("off"), offload=None, optimizer_offload=None, post_validation=False,
                           schedules=None)
    best, least = None, None
    for name, v in _candidates(request):
        spec_base = request.model
        most = max(1, -(-spec_base.num_layers // (request.pipeline_parallel_size * v)))
        for flags, spec in _recomputes(spec_base, most):
            req = base.replace(model=spec, interleave_chunks=v)
            r = one_row(name, None, req, "full", False)
            if "error" in r:
                continue
            light = None if r["fits"] else light_request(r, req)
            if light is not None:  # its layout with each rank's first chunk a layer lighter, where that fits
                r2 = one_row(name, None, light, "full", False)
                if "error" not in r2 and r2["fits"]:
                    r = r2
            if least is None or max(r["peak_bytes"]) < max(least["peak_bytes"]):
                least = r
            if not r["fits"]:
                continue
            cand = dict(r, flags=_megatron_flags(r, request.pipeline_parallel_size, flags), recompute=flags.strip())
            if best is None or cand[key] < best[key] * (1 - TIE):
                best = cand
            break  # more recompute of the same schedule only costs time
    if best is None:
        gib = 1024 ** 3
        why = ("no configuration of Megatron's own (1F1B, interleaved 1F1B, its layouts, full recompute of every "
               f"layer) fits {request.gpu_memory_gb:g} GiB per GPU"
               + (f": the least needs {max(least['peak_bytes']) / gib:.1f} GiB" if least else ""))
        return None, why
    keep = ("schedule", "chunks", "flags", "iteration_time_s", "iteration_time_post_validated_s", "peak_bytes",
            "fits", "bubble_rate", "layout", "recompute")
    return {k: best[k] for k in keep if k in best}, None


def against(rows: List[dict], baseline: Optional[dict], key: str) -> None:
    """Each row's ``speedup_vs_megatron``: the baseline's time over the row's ``key`` (None without
    a baseline)."""
    for r in rows:
        if "error" not in r:
            t = r.get(key)
            r["speedup_vs_megatron"] = round(baseline["iteration_time_s"] / t, 4) if baseline and t else None
