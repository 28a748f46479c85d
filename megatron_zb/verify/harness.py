"""The verification harness: train a tiny real megatron-core GPT with a pipeline schedule and check it
against the non-pipelined single-process reference.

One launch of P x T CPU processes (gloo; see ``verify.processes.launch``) runs, per case:

1. **Reference** (rank 0 only): PP=1, TP=1, full weights, megatron's
   ``forward_backward_no_pipelining``; ``iterations`` steps of plain SGD, recording the loss and
   every parameter's gradient (by global name) at every iteration.
2. **Pipelined run** (all ranks): megatron ``parallel_state`` for PP x TP, this rank's model
   chunks for the schedule's placement (``verify.model.tinygpt`` on ``megatron.layout.placement``), identical initial weights (hashed
   from global parameter names) and identical data; the schedule is picked the way a Megatron
   user would get it: ``megatron_zb.megatron.install.install(schedule)`` and then megatron's own
   ``get_forward_backward_func()``. Gradients are gathered per global name (TP shards
   all-gathered, every copy of a tied weight included), then the same SGD step.

The parent compares per-iteration losses (absolute difference) and gradients (relative L2
difference per parameter, the worst over parameters, copies and iterations).

Pseudo-schedules that need no ``install()`` (useful to check this harness itself):

* ``megatron-1f1b``: megatron's ``forward_backward_pipelining_without_interleaving``.
* ``megatron-interleaved``: megatron's interleaved 1F1B (looped placement, ``chunks`` per rank,
  default 2). At PP=2 it sets ``overlap_p2p_comm=True, batch_p2p_comm=False`` unless told
  otherwise: megatron's default batched p2p silently corrupts gradients at PP=2 + VPP.
* ``sequential``: a deliberately naive pipelined executor for *any* placement (``placement=
  'single'|'looped'|'v'``): one microbatch at a time through every stage, forward then backward,
  real p2p between ranks. It checks model placement (e.g. V) independently of any schedule.

It never hangs: the launch has a timeout; a stuck rank is reported with its last status (the
pass it was in, as set through ``verify.processes.launch.set_status``) and its Python stack.
"""
from __future__ import annotations

import math
import time
from typing import Dict, List, Optional, Sequence

from .case import PSEUDO_SCHEDULES, VerifyCase, VerifyUsageError, make_case, reference_key

__all__ = ["run_verify", "run_verify_many", "compare"]


def run_verify(schedule: str, pipeline_parallel_size: int, tensor_parallel_size: int = 1,
               num_microbatches: Optional[int] = None, iterations: int = 3, *, timeout: float = 300.0,
               mcore_path: Optional[str] = None, **options) -> dict:
    """Verify one schedule; returns the result dict (``passed``, ``max_rel_grad_diff``,
    ``max_abs_loss_diff``, ``schedule``, ``losses``, ``reference_losses``, ``timing``, ...).

    Raises ``VerifyUsageError`` on bad input. A crash or a hang in a rank gives ``passed: False``
    and ``error`` (the rank, its traceback or last status).
    """
    case = make_case(schedule, pipeline_parallel_size, tensor_parallel_size, num_microbatches, iterations, **options)
    return run_verify_many([case], timeout=timeout, mcore_path=mcore_path)[0]


def run_verify_many(cases: Sequence[VerifyCase], *, timeout: float = 600.0, mcore_path: Optional[str] = None,
                    raise_errors: bool = False) -> List[dict]:
    """Run several cases (same P x T) in one launch, paying process start and imports once."""
    from .model.rank import rank_case
    from .processes import launch as L
    cases = list(cases)
    if not cases:
        return []
    ws = {c.world_size for c in cases}
    if len(ws) != 1:
        raise VerifyUsageError(f"cases in one launch need the same P x T x DP, got world sizes {sorted(ws)}")
    cuda = _check_devices(cases)
    t0 = time.time()
    if any(c.schedule not in PSEUDO_SCHEDULES for c in cases) and not _install_importable():
        err = RuntimeError("megatron-zb schedules are run through megatron_zb.megatron.install, which is not "
                           "available in this checkout; the pseudo-schedules " + ", ".join(PSEUDO_SCHEDULES) +
                           " work without it")
        if raise_errors:
            raise err
        return [_error_result(c, err, 0.0) for c in cases]
    try:
        references = _optimizer_references(cases, timeout, mcore_path)
        # CUDA ranks: nothing touches megatron (or CUDA) before the launch forks them, no CPU shims
        per_case = L.run_cases(rank_case, cases, ws.pop(), L.LaunchOptions(
            timeout=timeout, mcore_path=mcore_path, precheck=None if cuda else check_megatron_configs,
            cpu_shims=not cuda))
    except L.LaunchError as e:
        if raise_errors:
            raise
        if getattr(e, "exc_type", None) == "MegatronConfigRefused":  # before any rank started: one line
            return [dict(_error_result(c, e, time.time() - t0), error=e.message.split(": ", 1)[-1],
                         error_type="MegatronConfigRefused") for c in cases]
        wall = time.time() - t0
        return [_error_result(c, e, wall) for c in cases]
    wall = time.time() - t0
    out = []
    for c, ranks in zip(cases, per_case):
        if c.optimizer is not None:
            ranks[0]["reference"] = references[reference_key(c)]
        r = compare(c, ranks)
        r["timing"]["launch_wall_s"] = round(wall, 3)
        out.append(r)
    return out


def _check_devices(cases: Sequence[VerifyCase]) -> bool:
    """True when the launch's ranks run on CUDA; one device per launch, optimizer cases on CPU only."""
    devices = {c.device for c in cases}
    if not devices <= {"cpu", "cuda"} or len(devices) != 1:
        raise VerifyUsageError(f"a launch's cases need one device, cpu or cuda, got {sorted(map(str, devices))}")
    if "cuda" in devices and any(c.optimizer is not None for c in cases):
        raise VerifyUsageError("Megatron's optimizer cases (--optimizer, post-validation) are verified on CPU here")
    return "cuda" in devices


def _optimizer_references(cases, timeout, mcore_path) -> Dict[tuple, dict]:
    """The non-pipelined references of the optimizer cases: one launch of world size 1."""
    from .model.optimizer_cases import reference_case
    from .processes import launch as L
    todo = {}
    for c in cases:
        if c.optimizer is not None:
            todo.setdefault(reference_key(c), c)
    if not todo:
        return {}
    keys = list(todo)
    results = L.run_cases(reference_case, [todo[k] for k in keys], 1,
                          L.LaunchOptions(timeout=timeout, mcore_path=mcore_path))
    return {k: r[0] for k, r in zip(keys, results)}


def _install_importable() -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec("megatron_zb.megatron.install") is not None
    except (ImportError, ValueError):
        return False


class MegatronConfigRefused(ValueError):
    """Megatron's TransformerConfig refuses a case's model (raised before any rank starts)."""


def check_megatron_configs(cases: Sequence[VerifyCase]) -> None:
    """Build every case's TransformerConfig as its ranks will (in the launch's zygote, megatron
    imported, before any rank is forked): a model Megatron refuses fails here in one line instead of
    inside every rank."""
    from .model.tinygpt import make_transformer_config
    for c in cases:
        overrides = {**c.model_overrides(), **c.run_overrides(), **c.config_overrides}
        try:
            make_transformer_config(c.model_config(), tensor_parallel_size=c.tensor_parallel_size,
                                    pipeline_parallel_size=c.pipeline_parallel_size,
                                    chunks=_models_per_rank(c), sequence_parallel=c.sequence_parallel,
                                    gradient_accumulation_fusion=c.gradient_accumulation_fusion, **overrides)
        except (AssertionError, ValueError, TypeError) as e:
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise MegatronConfigRefused(f"Megatron refuses this model ({c.describe()}): {text}") from None


def _models_per_rank(c: VerifyCase) -> int:
    from ..core import schedules as core_schedules
    if c.schedule in core_schedules.names():
        return core_schedules.get(c.schedule).models(c.chunks)
    return c.chunks


def _error_result(case: VerifyCase, err: Exception, wall: float) -> dict:
    return {"passed": False, "schedule": case.schedule, "error": str(err), "error_type": type(err).__name__,
            "losses": [], "reference_losses": [], "max_rel_grad_diff": None, "max_abs_loss_diff": None,
            "pipeline_parallel_size": case.pipeline_parallel_size,
            "tensor_parallel_size": case.tensor_parallel_size, "num_microbatches": case.num_microbatches,
            "iterations": case.iterations, "chunks": case.chunks, "placement": case.placement,
            "case": case.describe(), "timing": {"launch_wall_s": round(wall, 3)}}


def _rel(a, b) -> float:
    import torch
    a = a.double()
    b = b.double()
    if a.shape != b.shape:
        return math.inf
    dn = float((a - b).norm())
    rn = float(b.norm())
    if dn == 0.0:
        return 0.0
    return dn / rn if rn > 0 else math.inf


def compare(case: VerifyCase, ranks: List[dict]) -> dict:
    """Compare the pipelined ranks' results with the reference (rank 0 carries it)."""
    if case.optimizer is not None:
        return _compare_optimizer(case, ranks)
    ref = ranks[0]["reference"]
    problems: List[str] = []
    loss_reports = [r for r in ranks if r.get("losses") is not None]
    if len(loss_reports) != case.data_parallel_size:
        problems.append(f"expected exactly {case.data_parallel_size} rank(s) to report losses (one per data-parallel "
                        f"replica), got {len(loss_reports)}")
    if len(loss_reports) == 1:
        losses = loss_reports[0]["losses"]
    else:  # data parallel: the per-token loss over every replica's microbatches
        losses = []
        for it in range(case.iterations):
            parts = [r["loss_parts"][it] for r in loss_reports if it < len(r.get("loss_parts") or [])]
            n = sum(x[1] for x in parts)
            losses.append(sum(x[0] for x in parts) / n if parts and n else None)
    for it, bad in _replica_mismatches(ranks, case):
        problems.append(f"iteration {it}: copies of {bad[:3]} differ after the step (replicas must stay bit-identical)")
    per_iter = []
    max_loss = 0.0
    max_grad = 0.0
    worst = None
    for it in range(case.iterations):
        row = {"iteration": it, "reference_loss": ref["losses"][it]}
        lo = losses[it] if it < len(losses) else None
        row["loss"] = lo
        if lo is None or ref["losses"][it] is None:
            problems.append(f"iteration {it}: missing loss")
            d = math.inf
        else:
            d = abs(lo - ref["losses"][it])
        row["abs_loss_diff"] = d
        max_loss = max(max_loss, d)
        if not case.forward_only:
            merged: Dict[str, list] = {}
            for r in ranks:
                for name, copies in r["grads"][it].items():
                    merged.setdefault(name, []).extend((r["rank"], t) for t in copies)
            rg = ref["grads"][it]
            missing = sorted(set(rg) - set(merged))
            extra = sorted(set(merged) - set(rg))
            if missing:
                problems.append(f"iteration {it}: no pipelined gradient for {missing[:5]}")
            if extra:
                problems.append(f"iteration {it}: unexpected pipelined parameters {extra[:5]}")
            it_max = 0.0
            for name, copies in merged.items():
                if name not in rg:
                    continue
                for rank, t in copies:
                    e = _rel(t, rg[name][0])
                    if e > it_max:
                        it_max = e
                    if e > max_grad or worst is None:
                        if e >= max_grad:
                            max_grad = e
                            worst = {"param": name, "rank": rank, "iteration": it, "rel_diff": e}
            row["max_rel_grad_diff"] = it_max
        per_iter.append(row)
    aux = _compare_aux_losses(case, ref, ranks, per_iter, problems)
    pairs = sum(r.get("overlapped_pairs") or 0 for r in ranks if not r.get("tp_rank") and not r.get("dp_rank"))
    if case.ep_overlap and not case.forward_only and not pairs:
        problems.append("--overlap-moe-expert-parallel-comm: no overlapped F&B pair ran as one pass")
    passed = not problems and max_loss <= case.loss_atol and (case.forward_only or max_grad <= case.grad_rtol)
    times = [r["times"] for r in ranks if r.get("times")]
    iter_ms = [max(ts[i] for ts in times) * 1e3 for i in range(len(times[0]))] if times else []
    res = {
        "passed": bool(passed),
        "schedule": case.schedule,
        "pipeline_parallel_size": case.pipeline_parallel_size,
        "tensor_parallel_size": case.tensor_parallel_size,
        "num_microbatches": case.num_microbatches,
        "iterations": case.iterations,
        "chunks": case.chunks,
        "placement": case.placement,
        "num_layers": case.num_layers,
        "losses": losses,
        "reference_losses": ref["losses"],
        "max_abs_loss_diff": _finite(max_loss),
        "max_rel_grad_diff": None if case.forward_only else _finite(max_grad),
        "worst_param": worst,
        "grad_rtol": case.grad_rtol,
        "loss_atol": case.loss_atol,
        "forward_only": case.forward_only,
        "per_iteration": [{k: _finite(v) if isinstance(v, float) else v for k, v in row.items()} for row in per_iter],
        "problems": problems,
        **aux,
        "overlapped_pairs": pairs,  # run as one pass through megatron's schedule plans, per iteration
        **_balance_report(ranks),
        **_memory_report(ranks),
        **_offload_report(ranks),
        "megatron_core": ranks[0].get("megatron_version"),
        "case": case.describe(),
        "timing": {
            "iteration_ms": [round(x, 3) for x in iter_ms],
            "median_iteration_ms": round(_median(iter_ms[1:] or iter_ms), 3) if iter_ms else None,
            "reference_iteration_ms": [round(x * 1e3, 3) for x in ref.get("times", [])],
            "reference_median_iteration_ms": round(_median([x * 1e3 for x in ref["times"]][1:] or
                                                           [x * 1e3 for x in ref["times"]]), 3)
            if ref.get("times") else None,
            "rank_wall_s": round(max(r.get("wall_s", 0.0) for r in ranks), 3),
        },
    }
    return res


def _compare_aux_losses(case: VerifyCase, ref: dict, ranks: List[dict], per_iter: List[dict],
                        problems: List[str]) -> dict:
    """MoE's auxiliary losses (megatron's layer-wise tracker): per iteration, name and global layer,
    the sum over every pipelined rank against the reference's; a difference over ``loss_atol`` is a
    problem. Returns ``{"max_abs_aux_loss_diff": ...}`` (empty when no side tracked any)."""
    ref_aux = ref.get("aux_losses") or []
    if not any(ref_aux) and not any(any(r.get("aux_losses") or []) for r in ranks):
        return {}
    worst = 0.0
    for it in range(case.iterations):
        got: Dict[tuple, float] = {}
        for r in ranks:
            per = r.get("aux_losses") or []
            for name, layers in (per[it] if it < len(per) else {}).items():
                for layer, v in layers.items():
                    got[(name, int(layer))] = got.get((name, int(layer)), 0.0) + v
        want = {(name, int(layer)): v for name, layers in (ref_aux[it] if it < len(ref_aux) else {}).items()
                for layer, v in layers.items()}
        it_max = 0.0
        for key in sorted(set(got) | set(want)):
            d = abs(got.get(key, 0.0) - want.get(key, 0.0))
            if d > case.loss_atol * max(1.0, abs(want.get(key, 0.0))):
                problems.append(f"iteration {it}: {key[0]} of layer {key[1]} is {got.get(key, 0.0):.6g}, the reference "
                                f"{want.get(key, 0.0):.6g}")
            it_max = max(it_max, d)
        per_iter[it]["max_abs_aux_loss_diff"] = it_max
        per_iter[it]["aux_losses"] = {f"{k[0]}/layer{k[1]}": v for k, v in sorted(got.items())}
        worst = max(worst, it_max)
    return {"max_abs_aux_loss_diff": worst}


def _replica_mismatches(ranks: List[dict], case: "VerifyCase") -> List[tuple]:
    """(iteration, names) where copies of a parameter (replicas, tied embeddings, data-parallel
    copies) differ in any bit after the step; only where the ranks collected parameters."""
    out = []
    for it in range(case.iterations):
        copies: Dict[str, list] = {}
        for r in ranks:
            params = r.get("params") or []
            for name, ts in (params[it] if it < len(params) else {}).items():
                copies.setdefault(name, []).extend(ts)
        bad = sorted(n for n, ts in copies.items() if any(not _equal(ts[0], t) for t in ts[1:]))
        if bad:
            out.append((it, bad))
    return out


def _equal(a, b) -> bool:
    import torch
    return a.shape == b.shape and bool(torch.equal(a, b))


def _balance_report(ranks: List[dict]) -> dict:
    """--zero-bubble-balance-microbatches: each iteration's microbatch count per replica and the
    slowest rank's planning time (balancer + schedule)."""
    rows = [r["balanced"] for r in ranks if r.get("balanced")]
    if not rows:
        return {}
    cal = [[r[i].get("calibrated") for r in rows] for i in range(len(rows[0]))]
    return {"microbatches_per_replica": [it["microbatches_per_replica"] for it in rows[0]],
            "balance_plan_ms": [round(max(r[i]["plan_seconds"] for r in rows) * 1e3, 3) for i in range(len(rows[0]))],
            # per iteration, the length cost model fitted to a profile window (None before one), and
            # whether every rank planned with the same one
            "balance_calibration": [c[0] for c in cal], "balance_calibration_agrees": all(x == c[0] for c in cal for x in c)}


def _memory_report(ranks: List[dict]) -> dict:
    """Per pipeline rank (its first tensor- and data-parallel rank): the activation peak measured in
    the last iteration and the simulator's for the same order with that run's measured mem-f/mem-w
    (``runtime.observe.memory``); empty where nothing was measured (Megatron's own schedules)."""
    mine = sorted((r["pp_rank"], r["memory"]) for r in ranks
                  if r.get("memory") and r.get("tp_rank", 0) == 0 and r.get("dp_rank", 0) == 0)
    if not mine:
        return {}
    return {"peak_activation_bytes_measured": [m["measured_peak_bytes"] for _, m in mine],
            "peak_activation_bytes_predicted": [m["predicted_peak_bytes"] for _, m in mine],
            "memory": [{"pp_rank": p, **{k: v for k, v in m.items() if k != "trace"}} for p, m in mine],
            "memory_traces": [m["trace"] for _, m in mine]}


def _offload_report(ranks: List[dict]) -> dict:
    """``offload``: per rank, the offload manager's counts of every iteration (absent without)."""
    if not any(r.get("offload") for r in ranks):
        return {}
    return {"offload": [{"rank": r["rank"], "pp_rank": r.get("pp_rank"), "tp_rank": r.get("tp_rank"),
                         "iterations": r.get("offload") or []} for r in ranks]}


def _compare_optimizer(case: VerifyCase, ranks: List[dict]) -> dict:
    from .model.optimizer_cases import compare_optimizer_case
    ref = ranks[0]["reference"]
    o = compare_optimizer_case(case, ranks, ref)
    problems = o.pop("problems_optimizer")
    passed = o.pop("passed_optimizer")
    times = [r["runs"]["post-validated" if case.post_validation else "synchronous"]["times"] for r in ranks]
    iter_ms = [max(ts[i] for ts in times) * 1e3 for i in range(len(times[0]))] if times and times[0] else []
    sync_times = [r["runs"]["synchronous"]["times"] for r in ranks]
    sync_ms = [max(ts[i] for ts in sync_times) * 1e3 for i in range(len(sync_times[0]))] if sync_times else []
    per_iter = []
    for it in range(case.iterations):
        lo = o["losses"][it] if it < len(o["losses"]) else None
        rl = o["reference_losses"][it]
        per_iter.append({"iteration": it, "loss": lo, "reference_loss": rl,
                         "abs_loss_diff": _finite(abs(lo - rl)) if lo is not None else None,
                         "skipped": not ref["steps"][it][0], "reference_grad_norm": ref["steps"][it][1]})
    res = {
        "passed": bool(passed), "schedule": case.schedule, "pipeline_parallel_size": case.pipeline_parallel_size,
        "tensor_parallel_size": case.tensor_parallel_size, "num_microbatches": case.num_microbatches,
        "iterations": case.iterations, "chunks": case.chunks, "placement": case.placement,
        "num_layers": case.num_layers, "grad_rtol": case.grad_rtol, "loss_atol": case.loss_atol,
        "param_rtol": case.param_rtol, "forward_only": False, "per_iteration": per_iter, "problems": problems,
        "megatron_core": ranks[0].get("megatron_version"), "case": case.describe(),
        "timing": {"iteration_ms": [round(x, 3) for x in iter_ms],
                   "median_iteration_ms": round(_median(iter_ms[1:] or iter_ms), 3) if iter_ms else None,
                   "synchronous_median_iteration_ms": round(_median(sync_ms[1:] or sync_ms), 3) if sync_ms else None,
                   "rank_wall_s": round(max(r.get("wall_s", 0.0) for r in ranks), 3)},
    }
    for k, v in o.items():
        res[k] = _finite(v) if isinstance(v, float) else v
    return res


def _finite(x):
    if x is None:
        return None
    return x if math.isfinite(x) else float("inf")


def _median(xs):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])
