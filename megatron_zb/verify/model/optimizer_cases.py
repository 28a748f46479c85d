"""Verification with Megatron's real optimizer (and optimizer post-validation).

A case with ``optimizer`` set ('adam' or 'sgd') trains with ``megatron.core.optimizer.
get_megatron_optimizer`` instead of the harness's plain SGD step, in the model's dtype (fp32,
bf16 or fp16 through Megatron's ``Float16Module``), with or without the distributed optimizer,
clipping at ``clip_grad`` and an optional non-finite gradient injected at one iteration (one
element of ``decoder.final_layernorm.weight``'s gradient set to inf after the forward-backward;
Megatron skips such a step when a loss scaler checks the gradients: fp16, or ``loss_scale``).

Three runs, same weights, data and optimizer configuration:

1. **reference**: one process, no pipeline (its own launch of world size 1), Megatron's
   ``forward_backward_no_pipelining`` and synchronous ``optimizer.step()``, on every
   data-parallel replica's microbatches (replica d of the pipelined runs trains on the d-th slice);
2. **synchronous**: the pipelined schedule through ``install()``, Megatron's ``optimizer.step()``;
3. **post-validated** (``post_validation``): the same with ``install(..., post_validation=True)``
   and the optimizer's step replaced by the post-validated one.

``compare_optimizer_case`` checks losses and final parameters of (2) and (3) against (1) within
tolerances (the pipeline reduces the gradient norm in another order: last-bit differences), and
(3) against (2) **bit for bit**, with the same skipped steps.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

NONFINITE_PARAM = "decoder.final_layernorm.weight"


def needs_loss_scaler(case) -> bool:
    return case.inject_nonfinite_at is not None


def has_grad_scaler(case) -> bool:
    """Does Megatron's optimizer for this case check gradients for inf/NaN (a grad scaler)?"""
    return case.fp16 or (case.loss_scale is not None and (case.bf16 or case.use_distributed_optimizer))


def _dtype(case):
    import torch
    return torch.float16 if case.fp16 else (torch.bfloat16 if case.bf16 else torch.float32)


def _dtype_kw(case) -> dict:
    import torch
    dt = _dtype(case)
    if dt == torch.float32:
        return {}
    return dict(params_dtype=dt, pipeline_dtype=dt, bf16=case.bf16, fp16=case.fp16)


def build(case, placement, overrides: dict):
    """(DDP-wrapped chunks, Megatron optimizer, transformer config) for this process's stages."""
    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from ...megatron.execution.finalize import configure_grad_sync
    from ...megatron.layout import placement as _pl
    from . import tinygpt as M
    cfg = case.model_config()
    chunks = M.build_model_chunks(cfg, placement, M.ChunkOptions(
                                      layers_per_stage=case.layers_per_stage,
                                      allow_padding_num_layers=case.allow_padding_num_layers,
                                      vocab_parallel=bool(case.vocab_parallel) and placement.num_ranks > 1,
                                      vocab_embedding=case.vocab_embedding and placement.num_ranks > 1),
                                  sequence_parallel=case.sequence_parallel,
                                  gradient_accumulation_fusion=case.gradient_accumulation_fusion,
                                  **_dtype_kw(case), **overrides)
    config = chunks[0].config
    if _dtype(case) != torch.float32:
        chunks = _pl.float16_chunks(config, chunks)
    chunks = M.wrap_ddp(chunks, overlap_grad_reduce=case.overlap_grad_reduce,
                        use_distributed_optimizer=case.use_distributed_optimizer)
    configure_grad_sync(config, chunks, placement=placement, ddp=True,
                            overlap_grad_reduce=case.overlap_grad_reduce)
    kw = {}
    if case.fp16:
        kw["initial_loss_scale"] = case.initial_loss_scale
    fraction = rank_offload_fraction(case, placement)
    undo = None
    if fraction is not None:
        from ...megatron.features.optimizer_offload import use_cpu_as_device, use_rank_shares
        use_cpu_as_device()
        if isinstance(fraction, list):
            undo = use_rank_shares(fraction)
            fraction = 0.0  # replaced by this rank's share
        kw.update(optimizer_cpu_offload=True, optimizer_offload_fraction=fraction)
        if case.use_distributed_optimizer:  # Megatron's training arguments require it with the offload
            kw["use_precision_aware_optimizer"] = True
    ocfg = OptimizerConfig(optimizer=case.optimizer, lr=case.optimizer_lr, weight_decay=0.01,
                           clip_grad=case.clip_grad, bf16=case.bf16, fp16=case.fp16, params_dtype=_dtype(case),
                           use_distributed_optimizer=case.use_distributed_optimizer, loss_scale=case.loss_scale,
                           log_num_zeros_in_grad=True, **kw)
    try:
        opt = get_megatron_optimizer(ocfg, list(chunks), use_gloo_process_groups=False)
    finally:
        if undo is not None:
            undo()
    config.grad_scale_func = opt.scale_loss
    return chunks, opt, config


def rank_offload_fraction(case, placement):
    """This rank's share of optimizer state on the host (Megatron's optimizer_offload_fraction),
    or None without offload. The reference (one rank, ``placement.num_ranks == 1``) trains with
    the same Megatron flags (half its state on the host for 'auto'): Megatron's offloaded step
    keeps fp32 copies of the bf16 parameters itself, numerics that differ from its plain
    distributed optimizer's in the last bits, and the same on every part of the split."""
    f = case.optimizer_offload
    if f is None:
        return None
    if placement.num_ranks == 1:
        return 0.5 if f == "auto" else float(f)
    if f == "auto":  # each rank its share, set as training sets it (--zero-bubble-optimizer-offload S0,S1,..)
        from .offload_auto import verify_auto_fractions
        return verify_auto_fractions(case)
    return float(f)


def inject_nonfinite(chunks) -> int:
    """Set the first element of NONFINITE_PARAM's gradient to inf on every copy this rank holds."""
    from ...megatron.execution.finalize import grad_of
    from ...megatron.layout.placement import unwrap
    n = 0
    for c in chunks:
        for _, p in unwrap(c).named_parameters():
            if p.mzb_global_name == NONFINITE_PARAM:
                grad_of(p).view(-1)[0] = float("inf")
                n += 1
    return n


@dataclass(frozen=True)
class DataSlice:
    """The microbatches one rank trains on: data-parallel replica ``replica`` of ``replicas`` takes
    the ``replica``-th slice of every iteration's ``microbatches`` x ``replicas`` microbatches
    (None: ``case.num_microbatches``; the reference: one replica and every replica's microbatches)."""

    replica: int = 0
    replicas: int = 1
    microbatches: Optional[int] = None


def train(case, chunks, opt, fb, holds_loss: bool, tag: str, validator=None,
          data: DataSlice = DataSlice()) -> dict:
    """``case.iterations`` training iterations on ``data``; losses (per iteration: the masked loss sum
    and the token count of this rank's microbatches), step results, final parameters."""
    import torch.distributed as dist

    from ..processes.rankio import set_status
    from . import tinygpt as M
    cfg = case.model_config()
    d, n_rep = data.replica, data.replicas
    m = data.microbatches or case.num_microbatches
    losses, steps, times = [], [], []
    for it in range(case.iterations):
        set_status(f"[{tag}] iteration {it}")
        M.zero_grads_(chunks)
        opt.zero_grad()
        batches = M.make_batches(cfg, m * n_rep, it)[d * m:(d + 1) * m]
        t0 = time.perf_counter()
        out = fb(forward_step_func=M.forward_step_func, data_iterator=M.batch_iterators(batches, len(chunks)),
                 model=list(chunks), num_microbatches=m, seq_length=cfg.seq_length,
                 micro_batch_size=cfg.micro_batch_size, decoder_seq_length=cfg.seq_length, forward_only=False)
        if holds_loss:
            losses.append(M.iteration_loss_parts(out))
        if it == case.inject_nonfinite_at:
            inject_nonfinite(chunks)
        ok, norm, _ = opt.step()
        times.append(time.perf_counter() - t0)
        steps.append([bool(ok), None if norm is None else float(norm)])
    set_status(f"[{tag}] validating the last step, gathering parameters")
    if validator is not None:
        validator.finish()
    if dist.is_initialized():
        dist.barrier()
    params = M.collect_full_grads(chunks, params=True)
    res = {"losses": losses if holds_loss else None, "steps": steps, "params": params, "times": times,
           "loss_scale": float(opt.get_loss_scale()), "offloaded": _offloaded(opt)}
    if validator is not None:
        res.update(rollbacks=validator.rollbacks, skipped=validator.skipped, eager_steps=validator.eager_steps)
    else:
        res.update(rollbacks=0, skipped=sum(1 for ok, _ in steps if not ok))
    return res


def _offloaded(opt) -> list:
    """[elements with host-resident optimizer state, all elements] of this rank's optimizer."""
    from ...megatron.features.optimizer_offload import offloaded_numel
    parts = list(getattr(opt, "chained_optimizers", None) or [opt])
    out = [0, 0]
    for part in parts:
        if part.optimizer is not None:
            h, t = offloaded_numel(part.optimizer)
            out = [out[0] + h, out[1] + t]
    return out


def reference_case(case) -> dict:
    """Rank function of the world-size-1 launch: the non-pipelined reference with Megatron's optimizer."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    from ...core.ir import Placement
    from ..case import reference_overrides
    from . import tinygpt as M

    M.init_parallel_state(1, 1, seed=case.seed)
    chunks, opt, _ = build(case, Placement.single(1), reference_overrides(case))

    def fb(*, model, **kw):
        return forward_backward_no_pipelining(model=model[0], **kw)
    res = train(case, chunks, opt, fb, True, "reference",
                data=DataSlice(microbatches=case.num_microbatches * case.data_parallel_size))
    M.destroy_parallel_state()
    return res


def rank_runs(case, placement, install_fn, fb_fn) -> Dict[str, dict]:
    """On every rank of the main launch: the synchronous run and, with post_validation, the
    post-validated one (each from freshly initialised parallel state, model and optimizer)."""
    from megatron.core import parallel_state

    from ...megatron.layout import placement as _pl
    from . import tinygpt as M
    out = {}
    modes = ["synchronous"] + (["post-validated"] if case.post_validation else [])
    for mode in modes:
        M.init_parallel_state(case.tensor_parallel_size, case.pipeline_parallel_size, placement, seed=case.seed,
                              vocab_parallel=bool(case.vocab_parallel))
        handle = install_fn(case, post_validation=(mode == "post-validated"))
        trough = _trough(case, handle)
        try:
            chunks, opt, _ = build(case, placement, dict(case.config_overrides))
            validator = None
            if mode == "post-validated":
                validator = handle.post_validated_optimizer(opt, chunks, min_clean_steps=case.min_clean_steps,
                                                            log=lambda msg: None)
            infos = [_pl.unwrap(c).mzb_chunk_info for c in chunks]
            holds = any(i.post_process for i in infos) and parallel_state.get_tensor_model_parallel_rank() == 0
            data = DataSlice(parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size())
            out[mode] = train(case, chunks, opt, fb_fn(case, placement), holds, f"{case.describe()} {mode}",
                              validator, data)
            if validator is not None:
                out[mode]["validated"] = handle.post_validation.validated
            if trough is not None:
                out[mode]["trough"] = _trough_stats(trough)
        finally:
            if trough is not None:
                trough.uninstall()
            if handle is not None:
                handle.uninstall()
    return out


def _trough(case, handle):
    """--zero-bubble-optimizer-offload trough on this rank (training's feature): the trough holds
    half of the rank's host-resident states and opens as its activations fall (both kinds of
    subgroups, prefetches in the cooldown, releases in the next warm-up)."""
    if not case.optimizer_trough or handle is None:
        return None
    from ...megatron.features.optimizer_offload import use_cpu_as_device
    from ...megatron.features.optimizer_trough import use_trough
    use_cpu_as_device()  # patched before the trough's constructor hook (undone in the other order)
    return use_trough(handle.forward_backward, room=0.5, unit_bytes="room", unit_s=1e-3)


def _trough_stats(trough) -> dict:
    out = {"on_gpu": 0, "on_cpu": 0, "plans": []}
    for opt in trough.optimizers:
        out["on_gpu"] += len(opt.on_gpu)
        out["on_cpu"] += len(opt.groups) - len(opt.on_gpu)
        out["plans"].append(opt.plan.describe() if opt.plan is not None else None)
        for k, v in opt.states.stats.items():
            out[k] = out.get(k, 0) + v
    return out


def _rel(a, b, floor: float) -> float:
    """||a - b|| / max(||b||, floor): relative, but a parameter that is still near zero (a bias
    after a few steps) is measured against the size of an initialised tensor of its shape."""
    a, b = a.double(), b.double()
    if a.shape != b.shape:
        return math.inf
    dn = float((a - b).norm())
    if dn == 0.0:
        return 0.0
    rn = max(float(b.norm()), floor)
    return dn / rn if rn > 0 else math.inf


def per_token(parts) -> list:
    """[(masked loss sum, token count)] of one replica -> per-token losses."""
    return [None if n == 0 else tot / n for tot, n in parts]


def _losses(ranks, mode, replicas: int):
    """Per-token losses over every data-parallel replica's microbatches (one loss rank each), or
    None if not exactly one rank per replica reported."""
    reps = [r["runs"][mode]["losses"] for r in ranks if r["runs"][mode]["losses"] is not None]
    if len(reps) != replicas:
        return None
    return per_token([(sum(rep[it][0] for rep in reps), sum(rep[it][1] for rep in reps))
                      for it in range(len(reps[0]))])


def _params(ranks, mode) -> Dict[str, list]:
    merged: Dict[str, list] = {}
    for r in ranks:
        for name, copies in r["runs"][mode]["params"].items():
            merged.setdefault(name, []).extend((r["rank"], t) for t in copies)
    return merged


def compare_optimizer_case(case, ranks: List[dict], reference: dict) -> dict:
    """Result dict (the harness's fields plus the optimizer ones) for one optimizer case."""
    import torch
    problems: List[str] = []
    modes = ["synchronous"] + (["post-validated"] if case.post_validation else [])
    ref_params = reference["params"]
    ref_losses = per_token(reference["losses"])
    per_mode = {}
    for mode in modes:
        losses = _losses(ranks, mode, case.data_parallel_size)
        if losses is None:
            problems.append(f"{mode}: expected exactly {case.data_parallel_size} rank(s) to report losses "
                            "(one per data-parallel replica)")
            losses = []
        loss_diff = max((abs(a - b) for a, b in zip(losses, ref_losses)), default=math.inf)
        if len(losses) != len(ref_losses):
            loss_diff = math.inf
        merged = _params(ranks, mode)
        missing = sorted(set(ref_params) - set(merged))
        if missing:
            problems.append(f"{mode}: no parameter {missing[:5]}")
        worst, where = 0.0, None
        for name, copies in merged.items():
            if name not in ref_params:
                problems.append(f"{mode}: unexpected parameter {name}")
                continue
            for rank, t in copies:
                e = _rel(t, ref_params[name][0], case.model_config().init_std * math.sqrt(t.numel()))
                if e > worst or where is None:
                    worst, where = max(worst, e), {"param": name, "rank": rank, "rel_diff": e}
        skipped = [i for i, (ok, _) in enumerate(ranks[0]["runs"][mode]["steps"]) if not ok]
        per_mode[mode] = {"losses": losses, "max_abs_loss_diff": loss_diff, "max_rel_param_diff": worst,
                          "worst_param": where, "params": merged}
    sync = per_mode["synchronous"]
    ref_skipped = sum(1 for ok, _ in reference["steps"] if not ok)
    if ranks[0]["runs"]["synchronous"]["skipped"] != ref_skipped:
        problems.append(f"synchronous run skipped {ranks[0]['runs']['synchronous']['skipped']} step(s), "
                        f"the reference {ref_skipped}")
    out_mode = per_mode[modes[-1]]
    res = {"optimizer": case.optimizer, "post_validation": case.post_validation,
           "reference_losses": ref_losses, "losses": out_mode["losses"],
           "synchronous_losses": sync["losses"],
           "max_abs_loss_diff": max(per_mode[m]["max_abs_loss_diff"] for m in modes),
           "max_rel_param_diff": max(per_mode[m]["max_rel_param_diff"] for m in modes),
           "worst_param": out_mode["worst_param"], "skipped_iterations": ref_skipped,
           "clipped_iterations": sum(1 for ok, n in reference["steps"]
                                     if ok and n is not None and case.clip_grad > 0
                                     and case.clip_grad / (n + 1e-6) < 1.0),
           "rollbacks": 0, "max_rel_grad_diff": None}
    if case.post_validation:
        pv = per_mode["post-validated"]
        run = ranks[0]["runs"]["post-validated"]
        same_losses = pv["losses"] == sync["losses"]
        same_params = set(pv["params"]) == set(sync["params"]) and all(
            len(pv["params"][n]) == len(sync["params"][n]) and
            all(torch.equal(a[1], b[1]) for a, b in zip(pv["params"][n], sync["params"][n])) for n in sync["params"])
        res["bit_identical_to_synchronous"] = bool(same_losses and same_params)
        if not same_losses:
            problems.append("post-validated losses differ from the synchronous run's")
        if not same_params:
            problems.append("post-validated parameters differ from the synchronous run's")
        counts = {(r["runs"]["post-validated"]["rollbacks"], r["runs"]["post-validated"]["skipped"]) for r in ranks}
        if len(counts) != 1:
            problems.append(f"ranks disagree on (rollbacks, skipped): {sorted(counts)}")
        res["rollbacks"] = run["rollbacks"]
        res["eager_steps"] = run["eager_steps"]
        if run["skipped"] != ref_skipped:
            problems.append(f"post-validated run skipped {run['skipped']} step(s), the reference {ref_skipped}")
    if case.optimizer_offload is not None:
        res["offloaded"] = {r["rank"]: r["runs"]["synchronous"]["offloaded"] for r in ranks}
        if not any(h for h, _ in res["offloaded"].values()) and case.optimizer_offload != 0.0:
            problems.append("optimizer offload: no rank holds optimizer state on the host")
    if case.optimizer_trough:
        res["trough"] = {r["rank"]: {m: r["runs"][m].get("trough") for m in modes} for r in ranks}
        visits = [t.get("visited", 0) for by in res["trough"].values() for t in by.values() if t]
        if not visits or not all(visits):
            problems.append(f"optimizer trough: a run without visiting subgroups ({res['trough']})")
    res["problems_optimizer"] = problems
    res["passed_optimizer"] = (not problems and res["max_abs_loss_diff"] <= case.loss_atol
                               and res["max_rel_param_diff"] <= case.param_rtol)
    return res
