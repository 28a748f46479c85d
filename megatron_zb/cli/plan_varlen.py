"""`megatron-zb plan --seq-lengths FILE`: the model's schedules over a file of variable-length
global batches, Megatron's sequential microbatches against the balanced ones (``core.varlen.batch``).

Costs come from the model as for plan's other rows (``core.costs.chunk_costs``: each model chunk's F/B/W
seconds and activation bytes at --seq-length, the even layout), the attention share of a layer's F
and B at --seq-length from its FLOPs (``core.costs.model``), so a sequence of s tokens costs what the
length model says. Every row: ``schedule``, ``balanced``, ``iteration_time_s`` (mean over the
file's batches), ``bubble_rate`` (idle share of every rank of every replica), ``peak_bytes`` per
rank (activations of the fullest moment + model states), ``fits``, ``flags``."""
from __future__ import annotations

import dataclasses
import json
from typing import List

from ..core import schedules
from ..core.build import ScheduleRequest
from ..core.costs.chunk_costs import chunk_costs
from ..core.ir import B, F, ScheduleError
from ..core.costs.microbatch_costs import LengthModel
from ..core.plan.row import candidate_layouts, placement_for
from ..core.varlen.batch import Templates, VarlenConfig
from .common import UsageError
from .varlen import batches_of, describe, names_for, varlen_row

__all__ = ["cmd_plan_varlen"]


def _attention(spec) -> dict:
    """A transformer layer's attention share of F and B at the spec's sequence length."""
    f, b, w = spec.layer_flops(0)
    core_f = f - w  # F = GEMMs + core, W = GEMMs (per tensor-parallel rank)
    return {F: core_f / f if f else 0.0, B: 2 * core_f / b if b else 0.0}


def rows_for(args, spec, flops_per_s: float, budget: float) -> List[dict]:
    p, d = args.pipeline_parallel_size, args.data_parallel_size or 1
    batches = batches_of(args)
    att = _attention(spec)
    if args.attention_share is not None:
        att = {F: args.attention_share[0], B: args.attention_share[1]}
    model = LengthModel(spec.seq_length, att, {k: args.pass_overhead for k in ("F", "B", "W")})
    cfg = VarlenConfig(d, model, micro_batch_size=spec.micro_batch_size, packed=args.pack_sequences,
                       max_tokens=args.max_tokens)
    rows, errors = [], []
    for name in names_for(args):
        sp = schedules.get(name)
        try:
            v = sp.resolve_chunks(2 if sp.chunks is None else None)
            pl = placement_for(sp.placement, p, v)
            lay = candidate_layouts(spec, pl, False, None, False)[0]
            cc = chunk_costs(spec, lay, pl, flops_per_s, 50e9)
            states = [spec.state_bytes(x) for x in cc.params]
            req = ScheduleRequest(name, chunks=v if sp.chunks is None else None, cost_f=cc.cost_f, cost_b=cc.cost_b,
                                  cost_w=cc.cost_w, mem_f=cc.mem_f, mem_w=cc.mem_w)
            templates = Templates(req, p, max(1, len(batches[0]) // (d * cfg.micro_batch_size)))
            # balanced replicas' schedules within the GPU's memory less each rank's model states
            rcfg = dataclasses.replace(cfg, activation_limit=tuple(budget - x for x in states))
        except ScheduleError as e:
            errors.append({"schedule": name, "error": str(e)})
            continue
        for balanced in (False, True):
            try:
                r = varlen_row(req, p, rcfg, batches, balanced, 1.0, templates, args.cost_optimizer)
            except ScheduleError as e:
                errors.append({"schedule": name, "balanced": balanced, "error": str(e)})
                continue
            peak = [a + s for a, s in zip(r.pop("peak_memory"), states)]  # activation bytes (mem_f in bytes)
            r.update(bubble_rate=r.pop("idle_rate"), peak_bytes=peak, state_bytes=states, fits=max(peak) <= budget,
                     layout=str(lay), flags=f"--pipeline-model-parallel-size {p} --zero-bubble-schedule {name}"
                     + (f" --num-virtual-stages-per-pipeline-rank {v}" if sp.placement == "looped" else "")
                     + (" --zero-bubble-balance-microbatches" if balanced else ""))
            rows.append(r)
    base = next((r for r in rows if r["schedule"] == "1f1b" and not r["balanced"]), None)
    for r in rows:
        if base is not None:
            r["speedup_vs_megatron_1f1b"] = round(base["iteration_time_s"] / r["iteration_time_s"], 4)
    rows.sort(key=lambda r: (not r["fits"], r["iteration_time_s"]))
    return rows + errors


def cmd_plan_varlen(args, spec, flops_per_s: float) -> int:
    if args.pipeline_parallel_size < 2:
        raise UsageError("--pipeline-parallel-size must be >= 2")
    budget = args.gpu_memory_gb * 2 ** 30
    batches = batches_of(args)
    rows = rows_for(args, spec, flops_per_s, budget)
    if args.json:
        print(json.dumps({"pipeline_parallel_size": args.pipeline_parallel_size,
                          "data_parallel_size": args.data_parallel_size or 1, "batches": len(batches),
                          "seq_length": spec.seq_length, "gpu_memory_gb": args.gpu_memory_gb, "rows": rows}))
        return 0
    cfg = VarlenConfig(args.data_parallel_size or 1, LengthModel(spec.seq_length, _attention(spec)),
                       micro_batch_size=spec.micro_batch_size)
    print(describe(cfg, batches, args.pipeline_parallel_size).replace("costs are one microbatch of one",
                                                                      "the model's costs at one"))
    hdr = f"{'schedule':<18} {'balanced':>8} {'iteration s':>12} {'vs 1F1B':>8} {'idle':>6} {'fits':>5} {'peak GiB':>9}  flags"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        if "error" in r:
            print(f"{r['schedule']:<18} {('yes' if r.get('balanced') else 'no'):>8} n/a: {r['error']}")
            continue
        sp = r.get("speedup_vs_megatron_1f1b")
        print(f"{r['schedule']:<18} {('yes' if r['balanced'] else 'no'):>8} {r['iteration_time_s']:>12.4g} "
              f"{(f'{sp:.3f}x' if sp else '-'):>8} {r['bubble_rate']:>6.3f} {('yes' if r['fits'] else 'no'):>5} "
              f"{max(r['peak_bytes']) / 2 ** 30:>9.2f}  {r['flags']}")
    return 0
