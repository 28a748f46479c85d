"""Megatron-core's expert-parallel all-to-all overlap (``--overlap-moe-expert-parallel-comm``)
under a megatron-zb schedule.

megatron-core splits each transformer layer into fine-grained callables (attention, MoE dispatch,
experts, combine) and a model chunk's pass into a *schedule plan*
(``GPTModel.build_schedule_plan``); ``TransformerModelChunkSchedulePlan.run(f_plan, b_plan,
b_grad)`` runs the forward of one microbatch and the backward of another layer by layer, one's
dispatch/combine all-to-all on the communication stream while the other computes. Megatron uses it
only inside its own interleaved 1F1B ("combined 1F1B"). Here, with the option on, every pass of a
training iteration goes through plans: an F builds its plan and runs it alone, a B runs that plan
backwards alone, and an overlapped F&B pair of the schedule (dualpipe-v's, and those the schedule
core forms in the other schedules) runs as one combined pass (the executor's ``overlap``).

The weight gradients stay ours: a split B runs inside its chunk's W queue (``megatron.execution.wgrad``),
whose linears defer their weight GEMMs whoever calls their backward; megatron's ``backward_dw``
calls in the plan act only for TE's ``delay_wgrad_compute``. The loss is computed on a detached
copy of the last stage's output, so the last stage's B first runs the loss's own backward to get
the output gradient (megatron's loss node does the same). On CPU the streams are no-ops
(``cpu_shims``): the same code runs, for correctness, without overlap.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Tuple

import torch

__all__ = ["PlanPasses", "PAIR_LABEL"]

PAIR_LABEL = "megatron-zb overlapped F&B pair"


class PlanPasses:
    """F, B and overlapped F&B passes through megatron-core's schedule plans, for the chunks and
    bookkeeping of one ``MegatronPasses`` (``owner``)."""

    def __init__(self, owner):
        from megatron.core.pipeline_parallel import schedules as S
        from megatron.core.pipeline_parallel.utils import set_streams
        self.owner, self.S = owner, S
        set_streams()  # megatron's communication stream (once per process); no-ops on CPU
        self._plans: Dict[Tuple[int, int], tuple] = {}  # (stage, mb) -> (plan, detached loss input)
        self.pairs_run = 0  # overlapped pairs run as one pass

    # -- the three passes ----------------------------------------------------------------------

    def forward(self, stage: int, mb: int, inp):
        plan, loss_func, model, held = self._start_forward(stage, mb, inp)
        with self._around_run():
            output = type(plan).run(plan, None)
        return self._finish_forward(stage, mb, plan, loss_func, model, held, output)

    def backward(self, stage: int, mb: int, inp, out, grad, split: bool):
        plan, grad = self._start_backward(stage, mb, out, grad)
        with self._deferring(stage, mb, split), self._around_run():
            type(plan).run(None, plan, b_grad=grad)
        return None if inp is None else inp.grad

    def pair(self, f: tuple, b: tuple):
        """An overlapped pair: the F of ``f = (stage, mb, input)`` and the B of ``b = (stage, mb,
        input, output, output_grad, split)`` in one ``run``. Returns (F's output, B's input grad)."""
        (f_stage, f_mb, f_inp), (b_stage, b_mb, b_inp, b_out, b_grad, split) = f, b
        f_plan, loss_func, model, held = self._start_forward(f_stage, f_mb, f_inp)
        b_plan, b_grad = self._start_backward(b_stage, b_mb, b_out, b_grad)
        with self._deferring(b_stage, b_mb, split), self._around_run(), \
                torch.profiler.record_function(PAIR_LABEL):  # the pair's window in a profiler trace
            output = type(f_plan).run(f_plan, b_plan, b_grad=b_grad)
        out = self._finish_forward(f_stage, f_mb, f_plan, loss_func, model, held, output)
        self.pairs_run += 1
        return out, (None if b_inp is None else b_inp.grad)

    # -- pieces ----------------------------------------------------------------------------------

    def _start_forward(self, stage: int, mb: int, inp):
        """Megatron's forward preprocessing, then the user's ``forward_step_func`` with
        ``return_schedule_plan=True`` (Megatron-LM's ``pretrain_gpt.forward_step`` takes it)."""
        from megatron.core.utils import get_attr_wrapped_model
        o, S = self.owner, self.S
        c = o.chunk_of[stage]
        model, it, first = o.models[c], o.iterator(c, mb), o.first_of(c)
        if o.config.timers is not None:
            o.config.timers('forward-compute', log_level=2).start()  # forward_step_calc_loss stops it
        if S.check_first_val_step(o.first_val_step, o.forward_only, first) and hasattr(model, "set_is_first_microbatch"):
            model.set_is_first_microbatch()
        S.set_current_microbatch(model, mb)
        get_attr_wrapped_model(model, "set_input_tensor")([inp])
        unwrapped = get_attr_wrapped_model(model, "build_schedule_plan", return_model_obj=True)
        with self._autocast():
            try:
                plan, loss_func = o.forward_step_func(it, unwrapped, return_schedule_plan=True)
            except TypeError as e:
                if "return_schedule_plan" not in str(e):
                    raise
                raise TypeError("--overlap-moe-expert-parallel-comm: the forward_step function must take "
                                "return_schedule_plan=True and return (model.build_schedule_plan(...), loss_func), "
                                "as Megatron-LM's pretrain_gpt.forward_step does") from None
        held: Dict[str, torch.Tensor] = {}

        def loss_on_detached(output, *args, **kwargs):
            x = output.detach().requires_grad_(output.requires_grad)
            held["x"] = x
            return loss_func(x, *args, **kwargs)

        return plan, loss_on_detached, model, held

    def _finish_forward(self, stage: int, mb: int, plan, loss_func, model, held, output):
        o = self.owner
        out, num_tokens = self.S.forward_step_calc_loss(
            model, output, loss_func, o.config, None, o.collect_non_loss_data, o.m, o.forward_data_store,
            cp_group_size=o.cp_size, is_last_stage=o.placement.is_last(stage))
        o.record_forward(mb, num_tokens)
        self._plans[(stage, mb)] = (plan, held.get("x"))
        return out

    def _start_backward(self, stage: int, mb: int, out, grad):
        """The plan of the F of (stage, mb) and its output gradient: on the last stage the loss's
        own backward gives it (the gradient of the detached copy the loss was computed on)."""
        plan, x = self._plans.pop((stage, mb))
        if grad is None:
            cfg = self.owner.config
            if cfg.grad_scale_func is not None:
                out = cfg.grad_scale_func(out)
            torch.autograd.backward(out)
            grad = x.grad
        return plan, grad

    def _deferring(self, stage: int, mb: int, split: bool):
        o = self.owner
        return o.queues[o.chunk_of[stage]].defer(mb) if split else contextlib.nullcontext()

    def _autocast(self):
        cfg = self.owner.config
        if getattr(cfg, "enable_autocast", False):
            return torch.autocast("cuda", dtype=cfg.autocast_dtype)
        return contextlib.nullcontext()

    def _around_run(self):
        """What megatron wraps a plan's run in: autocast, and FP8's delayed recipe around the whole
        pass (other recipes enter their context layer by layer inside the plan)."""
        cfg = self.owner.config
        stack = contextlib.ExitStack()
        stack.enter_context(self._autocast())
        if getattr(cfg, "fp8", None):
            from megatron.core.enums import Fp8Recipe
            if cfg.fp8_recipe == Fp8Recipe.delayed:
                from megatron.core.fp8_utils import get_fp8_context
                stack.enter_context(get_fp8_context(cfg))
        return stack

