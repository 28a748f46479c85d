"""Optimizer post-validation on Megatron's own optimizer (``megatron.core.optimizer``).

    handle = install("zb-h2", post_validation=True)
    optimizer = get_megatron_optimizer(config, model_chunks)           # Megatron's, unchanged
    validator = handle.post_validated_optimizer(optimizer, model_chunks)  # patches optimizer.step
    ...                                                                  # train as usual

Megatron's ``optimizer.step()`` all-reduces the inf/NaN flag and the gradient norm over every rank
of the model, pipeline ranks included: a barrier at the end of each iteration. Post-validation
(the zero-bubble paper, Sec. 4) replaces it on the step path:

1. **Eager step** (``step()``): the gradients are prepared as Megatron does (copy to the main
   gradients, unscale, per optimizer the inf/NaN check) with every statistic reduced only over the
   ranks of this pipeline stage (Megatron's grad-stats group minus the pipeline dimension:
   the tensor-parallel group, or tensor x data parallel for the distributed optimizer). Unless the
   local part already proves the step must be skipped or clipped, the bytes the step will change
   are saved (model parameters, main parameters, optimizer state), the main gradients are kept,
   and the optimizer steps without clipping. The local values go into the pipeline reduction
   (``runtime.features.postval``) and ``step()`` returns at once.
2. **Validation**, before this rank's first backward of the next iteration: the fully reduced
   norm and flags say what Megatron's synchronous step would have done. If that is what the eager
   step did (no non-finite gradient where Megatron checks, no clipping, no norm-based skip), it
   stands. The norm reduced along the pipeline may differ from Megatron's all-reduce in the last
   bits, so a norm within 1e-5 (relative) of the clip threshold counts as "maybe clipped".
3. **Rollback** otherwise: the iteration ends without computing, the saved bytes are restored
   and the step is redone by Megatron's own ``step()`` on the kept gradients (its own all-reduced
   norm, clipping, zero count, skip rule) or, for a non-finite gradient, skipped with the loss
   scaler updated as Megatron's would be; then the iteration runs again on the same microbatches.
   The result is bit-identical to Megatron's synchronous optimizer.

What ``step()`` returns (Megatron's training loop consumes it at once): ``(True, grad norm,
zero count)`` where the norm and the count are those of the **previous** step (validated during
this iteration; None on the first). A step that later turns out skipped is undone in the learning
rate scheduler (``attach_scheduler``; ``scheduler.step(increment=-increment)``), counted in
``skipped`` and logged with the rollback. Memory: the saved bytes (parameters, main parameters and
optimizer state of this rank) and a copy of the main gradients, i.e. about the size of the
optimizer state again.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ...runtime.features.postval import PostValidation
from .optimizer_offload import is_hybrid, offload_tensors, sub_optimizers

__all__ = ["PostValidator", "post_validated", "PostValidationError", "MARGIN"]

_MOVED = object()  # a saved state entry that the trough's host copy restores instead
MARGIN = 1e-5  # relative: a norm this close to a threshold takes Megatron's own (exact) path


class PostValidationError(ValueError):
    """An optimizer configuration post-validation cannot reproduce exactly."""


@dataclass
class _Eager:
    """What one eager step changed and kept (this rank)."""

    iteration: int
    stepped: bool
    found: List[bool]
    hyper: List[List[dict]]  # per part, per param group: everything but 'params' (before the step)
    scalers: List[Optional[dict]]  # per part: the grad scaler's state before prepare_grads
    sched_steps: Optional[Any]
    grads: List[tuple]  # (main param, its gradient as the step used it)
    backup: List[tuple] = field(default_factory=list)  # (tensor, saved copy)
    states: List[tuple] = field(default_factory=list)  # (torch optimizer, {param: saved state} | None)
    verdict: str = ""  # 'ok' | 'skip' | 'redo'


class PostValidator:
    """Post-validation attached to one Megatron optimizer (see the module docstring)."""

    def __init__(self, optimizer, model_chunks: Sequence[torch.nn.Module], controller: PostValidation, *,
                 pp_group=None, min_clean_steps: int = 0, log: Optional[Callable[[str], None]] = None,
                 eager_with_one_stage: bool = False):
        from megatron.core import parallel_state
        self.optimizer = optimizer
        self.parts = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
        self.models = list(model_chunks)
        self.pv = controller
        self.pp_group = pp_group if pp_group is not None else parallel_state.get_pipeline_model_parallel_group()
        self.min_clean_steps = int(min_clean_steps)
        self.eager_with_one_stage = eager_with_one_stage  # time the eager path without a pipeline (GPU test)
        self.log = log if log is not None else _log_on_last_rank
        self.scheduler = None
        self.iteration = 0
        self.streak = 0  # validated steps in a row that were neither clipped nor skipped
        self.eager_steps = 0
        self.synchronous_steps = 0
        self.rollbacks = 0
        self.skipped = 0
        self.last_grad_norm: Optional[float] = None
        self.last_num_zeros: Optional[float] = None
        self._local_groups: Optional[List] = None
        self._eager: Optional[_Eager] = None
        self._check_supported()
        # --zero-bubble-optimizer-offload trough: states visiting the GPU are rolled back from their
        # host copy, which their write-back leaves intact until the step is validated (staged)
        self.troughs = [t for p in self.parts for t in [getattr(p.optimizer, "mzb_trough", None)] if t is not None]
        for t in self.troughs:
            t.states.staged = True
        self._megatron_step = type(optimizer).step.__get__(optimizer)
        self._attach()

    # -- set-up -----------------------------------------------------------------------------------
    def _check_supported(self):
        for part in self.parts:
            cfg = part.config
            if getattr(cfg, "use_precision_aware_optimizer", False) and not is_hybrid(part.optimizer):
                raise PostValidationError("optimizer post-validation does not support the precision-aware "
                                          "optimizer (use_precision_aware_optimizer)")
            if getattr(cfg, "overlap_param_gather_with_optimizer_step", False):
                raise PostValidationError("optimizer post-validation does not support "
                                          "overlap_param_gather_with_optimizer_step")
            ddp = getattr(part, "ddp_config", None)
            if ddp is not None and (getattr(ddp, "overlap_param_gather", False) or
                                    getattr(ddp, "use_megatron_fsdp", False)):
                raise PostValidationError("optimizer post-validation needs the parameters gathered inside the "
                                          "step: no overlap_param_gather, no Megatron FSDP")
        try:  # megatron-core >= 0.19: parameters in their own grad-norm groups are clipped by that norm
            from megatron.core.optimizer.optimizer import _get_param_grad_norm_group, _is_separate_grad_norm_group
        except ImportError:
            return
        for part in self.parts:
            for p in part.get_parameters():
                if _is_separate_grad_norm_group(_get_param_grad_norm_group(p)):
                    raise PostValidationError("optimizer post-validation does not support separate grad-norm "
                                              "groups (a parameter with its own grad_norm_group)")

    def _attach(self):
        opt = self.optimizer
        opt.step = self.step
        opt.post_validation = self
        for name in ("state_dict", "sharded_state_dict", "save_parameter_state"):
            original = getattr(opt, name, None)
            if original is None:
                continue

            def validated_first(*a, _original=original, **k):
                self.finish()
                return _original(*a, **k)
            setattr(opt, name, validated_first)

    def attach_scheduler(self, scheduler) -> None:
        """Megatron's ``OptimizerParamScheduler`` of this optimizer: a skipped step found later is
        undone in it as Megatron would never have stepped it."""
        self.scheduler = scheduler

    def finish(self) -> None:
        """Validate (and if needed roll back and redo) the last step now."""
        self.pv.finish()

    def detach(self) -> None:
        """Back to Megatron's own step (the pending step is validated first)."""
        self.finish()
        for name in ("step", "state_dict", "sharded_state_dict", "save_parameter_state", "post_validation"):
            self.optimizer.__dict__.pop(name, None)

    # -- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self):
        self.iteration += 1
        if self.pv.pending is not None:  # no iteration ran since the last step
            self.pv.finish()
        if (self.pp_group.size() == 1 and not self.eager_with_one_stage) or self.streak < self.min_clean_steps:
            ok, norm, zeros = self._megatron_step()
            self._commit()
            self.synchronous_steps += 1
            self._count(ok, norm)
            return ok, norm, zeros
        self._eager_step()
        return True, self.last_grad_norm, self.last_num_zeros

    def _count(self, ok: bool, norm) -> None:
        clean = ok and not (norm is not None and any(c > 0 and c / (norm + 1.0e-6) < 1.0 for c in self._clips()))
        self.streak = self.streak + 1 if clean else 0
        self.last_grad_norm, self.skipped = norm, self.skipped + (0 if ok else 1)

    def _clips(self) -> List[float]:
        return [float(p.config.clip_grad) for p in self.parts]

    def _skip_threshold(self) -> float:
        return min(float(getattr(p.config, "grad_norm_skip_threshold", math.inf)) for p in self.parts)

    def _eager_step(self):
        local = self._local()
        eager = _Eager(self.iteration, False, [], [_hyper(p) for p in self.parts],
                       [_scaler_state(p) for p in self.parts],
                       getattr(self.scheduler, "num_steps", None), [])
        with _grad_stats_group(self.parts, local):
            eager.found = [bool(p.prepare_grads()) for p in self.parts]
            sumsq, zeros = 0.0, 0.0
            if not any(eager.found):
                # each part's norm over this stage (Megatron's get_grad_norm on the local group)
                sumsq = sum(float(p.get_grad_norm() or 0.0) ** 2 for p in self.parts
                            if not getattr(p, "is_stub_optimizer", False))
                if self.optimizer.config.log_num_zeros_in_grad:
                    zeros = float(sum(p.count_zeros() for p in self.parts))
        # the step's gradients: .grad, or .decoupled_grad (the precision-aware path, Megatron's CPU offload)
        eager.grads = [(prm, g.clone() if k == "grad" else (k, g.clone())) for part in self.parts
                       if part.optimizer is not None for grp in part.optimizer.param_groups for prm in grp["params"]
                       for k in ("grad", "decoupled_grad") for g in [getattr(prm, k, None)] if g is not None]
        local_norm = math.sqrt(sumsq)
        certain = any(eager.found) or any(c > 0 and c / (local_norm + 1.0e-6) < 1.0 - MARGIN for c in self._clips()) \
            or local_norm > self._skip_threshold() * (1.0 + MARGIN)
        if not certain:
            eager.backup, eager.states = self._save_bytes()
            eager.stepped = bool(self.optimizer.step_with_ready_grads())
            self.eager_steps += 1
        self._eager = eager
        values = torch.tensor([sumsq, zeros] + [float(f) for f in eager.found], dtype=torch.float64)
        self.pv.submit(self.pp_group, self.iteration, values, self._judge, self._recover)

    def _judge(self, full: torch.Tensor) -> bool:
        eager = self._eager
        sumsq, zeros = float(full[0]), float(full[1])
        flags = [bool(x > 0) for x in full[2:].tolist()]
        if any(f and _has_scaler(p) for f, p in zip(flags, self.parts)):
            eager.verdict, eager.found = "skip", flags
            return False
        norm = math.sqrt(sumsq) if sumsq >= 0 else float("nan")
        maybe_clipped = any(c > 0 and c / (norm + 1.0e-6) < 1.0 + MARGIN for c in self._clips())
        maybe_skipped = norm > self._skip_threshold() * (1.0 - MARGIN)
        if maybe_clipped or maybe_skipped:
            eager.verdict = "redo"
            return False
        if not eager.stepped:  # the local part proved clipping or a skip, the whole does not
            raise RuntimeError(f"optimizer post-validation: iteration {eager.iteration}: this rank did not step "
                               f"eagerly but the reduced gradient norm {norm} says the step stands")
        eager.verdict = "ok"
        self._commit()
        self._eager = None
        self.streak += 1
        self.last_grad_norm = norm
        self.last_num_zeros = zeros if self.optimizer.config.log_num_zeros_in_grad else None
        return True

    @torch.no_grad()
    def _recover(self) -> None:
        """Restore the eager step's bytes and do what Megatron's synchronous step did (collective)."""
        eager, self._eager = self._eager, None
        for t in self.troughs:  # the visiting states back to their host copy from before the step
            t.states.rollback()
        self.rollbacks += 1
        self.streak = 0
        for t, saved in eager.backup:
            t.copy_(saved)
        for opt, saved in eager.states:
            _restore_state(opt, saved)
        current = [_hyper(p) for p in self.parts]
        for part, hyper in zip(self.parts, eager.hyper):
            _set_hyper(part, hyper)
        for part, state in zip(self.parts, eager.scalers):
            if state is not None:
                part.grad_scaler.__dict__.update(copy.deepcopy(state))
        if eager.verdict == "skip":
            for part, flag in zip(self.parts, eager.found):
                if _has_scaler(part):
                    part.grad_scaler.update(flag)  # Megatron's prepare_grads on a non-finite gradient
            ok, norm, zeros = False, None, None
        else:
            for part in self.parts:
                if _has_scaler(part):
                    part.grad_scaler.update(False)
            for prm, g in eager.grads:
                setattr(prm, *(g if isinstance(g, tuple) else ("grad", g)))
            self.optimizer.prepare_grads = lambda: False  # the gradients are prepared already
            try:
                ok, norm, zeros = self._megatron_step()  # Megatron's own norm, clipping, zero count, step
            finally:
                del self.optimizer.prepare_grads
            self._commit()
            for prm, g in eager.grads:  # as after Megatron's zero_grad at the start of this iteration
                setattr(prm, g[0] if isinstance(g, tuple) else "grad", None)
        if ok:
            for part, hyper in zip(self.parts, current):
                _set_hyper(part, hyper)  # the scheduler's values for the next step
        else:
            self.skipped += 1
            if self.scheduler is not None and eager.sched_steps is not None:
                increment = self.scheduler.num_steps - eager.sched_steps
                if increment:
                    self.scheduler.step(increment=-increment)
        self.last_grad_norm, self.last_num_zeros = norm, zeros
        what = ("skipped (non-finite gradient), loss scale " + _fmt(_loss_scale(self.optimizer))) if not ok \
            else (f"redone with Megatron's clipping (grad norm {_fmt(norm)})" if norm is not None else "redone")
        self.log(f"megatron-zb post-validation: the step of iteration {eager.iteration} was rolled back and {what}; "
                 f"{self.rollbacks} rollback(s), {self.skipped} skipped step(s) so far")

    # -- helpers ----------------------------------------------------------------------------------
    def _commit(self) -> None:
        for t in self.troughs:
            t.states.commit()

    def _local(self) -> List:
        """Per part: its grad-stats group without the pipeline dimension (created once, collectively)."""
        if self._local_groups is None or not _alive(self._local_groups):
            cache: Dict[tuple, Any] = {}
            out = []
            for part in self.parts:
                group = part.get_grad_stats_parallel_group()
                key = tuple(dist.get_process_group_ranks(group)) if group is not None else None
                if key not in cache:
                    cache[key] = split_by_pipeline_rank(group, self.pp_group)
                out.append(cache[key])
            self._local_groups = out
        return self._local_groups

    def _save_bytes(self):
        seen, backup = set(), []
        moved = set().union(*(t.managed() for t in self.troughs))  # restored from their host copy

        def keep(t):
            if id(t) in moved:
                return
            t = t.data
            k = (t.data_ptr(), t.numel(), t.dtype)
            if t.numel() and k not in seen:
                seen.add(k)
                backup.append((t, t.detach().clone()))
        for m in self.models:
            for prm in m.parameters():
                keep(prm)
        states = []
        for part in self.parts:
            opt = part.optimizer
            if opt is None:
                continue
            for g in opt.param_groups:
                for prm in g["params"]:
                    keep(prm)
            for t in offload_tensors(opt):  # Megatron's CPU offload: the host copies it steps
                keep(t)
            for o in sub_optimizers(opt) + ([opt] if is_hybrid(opt) else []):
                states.append((o, {prm: {k: (_MOVED if id(v) in moved else v.detach().clone() if torch.is_tensor(v)
                                             else copy.deepcopy(v))
                                         for k, v in st.items()} for prm, st in o.state.items()}))
        return backup, states


# -- module helpers ---------------------------------------------------------------------------------

def post_validated(optimizer, model_chunks, controller: PostValidation, **kw) -> PostValidator:
    """Attach post-validation to ``optimizer`` (Megatron's, from ``get_megatron_optimizer``)."""
    return PostValidator(optimizer, model_chunks, controller, **kw)


def split_by_pipeline_rank(group, pp_group):
    """The part of ``group`` on this rank's pipeline stage (ranks of ``group`` with this rank's
    pipeline rank). Collective over the whole world: every rank calls it at the same point."""
    world = dist.get_world_size()
    members = tuple(sorted(dist.get_process_group_ranks(group))) if group is not None else (dist.get_rank(),)
    info: List = [None] * world
    dist.all_gather_object(info, (members, pp_group.rank()))
    specs = set()
    for grp, _ in info:
        for v in {info[r][1] for r in grp}:
            specs.add(tuple(r for r in grp if info[r][1] == v))
    me = dist.get_rank()
    mine_spec = tuple(r for r in members if info[r][1] == pp_group.rank())
    mine = None
    for spec in sorted(specs):
        g = dist.new_group(list(spec))
        if spec == mine_spec and me in spec:
            mine = g
    return mine


def _alive(groups) -> bool:
    from ...runtime.p2p import registered_groups
    live = set(map(id, registered_groups()))
    return all(g is None or id(g) in live for g in groups)


class _grad_stats_group:
    """Temporarily reduce each part's gradient statistics over the given groups."""

    def __init__(self, parts, groups):
        self.parts, self.groups = parts, groups

    def __enter__(self):
        for part, g in zip(self.parts, self.groups):
            part.get_grad_stats_parallel_group = (lambda g=g: g)

    def __exit__(self, *exc):
        for part in self.parts:
            part.__dict__.pop("get_grad_stats_parallel_group", None)


def _has_scaler(part) -> bool:
    return getattr(part, "grad_scaler", None) is not None


def _scaler_state(part) -> Optional[dict]:
    return copy.deepcopy(part.grad_scaler.__dict__) if _has_scaler(part) else None


def _hyper(part) -> List[dict]:
    opt = part.optimizer
    if opt is None:
        return []
    return [{k: copy.copy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]


def _set_hyper(part, hyper: List[dict]) -> None:
    opt = part.optimizer
    if opt is None:
        return
    for g, h in zip(opt.param_groups, hyper):
        g.update(h)


def _restore_state(opt, saved: dict) -> None:
    for prm in list(opt.state.keys()):
        if prm not in saved:
            del opt.state[prm]  # created by the rolled-back step (first step of this parameter)
    for prm, st in saved.items():
        cur = opt.state[prm]
        for k in list(cur.keys()):
            if k not in st:
                del cur[k]
        for k, v in st.items():
            if v is _MOVED:
                continue
            if torch.is_tensor(v) and torch.is_tensor(cur.get(k)) and cur[k].shape == v.shape \
                    and cur[k].dtype == v.dtype:
                cur[k].copy_(v)
            else:
                cur[k] = v


def _loss_scale(optimizer):
    try:
        return float(optimizer.get_loss_scale())
    except Exception:
        return None


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.6g}"


def _log_on_last_rank(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
        print(msg, flush=True)
