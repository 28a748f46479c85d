"""Megatron's own ``forward_step`` / ``backward_step`` as the executor's passes (``StagePasses``)
for one attempt at an iteration: loss scaling, token counts and auxiliary losses stay Megatron's.
A split backward (B) runs with the chunk's W queue deferring the weight-gradient GEMMs
(``megatron.execution.wgrad``); W drains them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ...core.ir import Placement
from ...runtime.executor import StagePasses
from ..layout.routing import RoutedIterator

__all__ = ["MegatronStep", "MegatronPasses", "device"]


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@dataclasses.dataclass
class MegatronStep:
    """What Megatron's forward-backward call hands every pass of this rank: its forward step, one
    data iterator per model chunk, the chunks, the model config and the call's flags."""

    forward_step_func: Callable
    iterators: List[Any]  # one per model chunk (Megatron's one iterator repeated where it passed one)
    models: List[Any]
    num_microbatches: int
    config: Any  # the model's TransformerConfig
    cp_size: int = 1  # the context-parallel group's size
    forward_only: bool = False
    collect_non_loss_data: bool = False
    first_val_step: Optional[bool] = None


class MegatronPasses:
    """What each pass does on this rank, and what the forwards collect: Megatron's loss dicts
    (``forward_data_store``, with the microbatch of each entry), and the token count."""

    def __init__(self, step: MegatronStep, *, queues: Sequence, chunk_of: Dict[int, int], placement: Placement,
                 ep_overlap: bool = False):
        from megatron.core.pipeline_parallel import schedules as S
        from megatron.core.utils import get_attr_wrapped_model, get_model_type
        self.S, self._wrapped = S, get_attr_wrapped_model
        models, forward_only = step.models, step.forward_only
        self.forward_step_func, self.models, self.queues = step.forward_step_func, models, queues
        self.chunk_of, self.placement, self.m, self.config = chunk_of, placement, step.num_microbatches, step.config
        self.cp_size, self.forward_only = step.cp_size, forward_only
        self.collect_non_loss_data, self.first_val_step = step.collect_non_loss_data, step.first_val_step
        # replicated stages: each chunk reads only the microbatches of its path
        self.iterators = [RoutedIterator(it) for it in step.iterators] if placement.replicated else list(step.iterators)
        self.vocab = None  # vocabulary parallelism (megatron.vocab_parallel.VocabParallel), set by the caller
        self.forward_data_store: List = []
        self.mb_of_entry: List[int] = []  # microbatch of each forward_data_store entry
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=device())
        self._first_done = set()
        params = inspect.signature(S.backward_step).parameters
        self._bwd_kwargs = {"model_type": get_model_type(models[0])} if "model_type" in params else {}
        # --overlap-moe-expert-parallel-comm: every training pass through megatron's schedule plans,
        # overlapped F&B pairs as one pass (megatron.ep_overlap)
        self.plans = None
        if ep_overlap and not forward_only:
            from ..features.ep_overlap import PlanPasses
            self.plans = PlanPasses(self)

    def stage_passes(self, shape) -> StagePasses:
        return StagePasses(forward=self.forward, backward=self.backward, weight=self.weight,
                           recv_shape=lambda s, mb: shape, dtype=self.config.pipeline_dtype, device=device(),
                           release_output=self.release, release_handed_over=self.release_handed_over, overlap=self.plans.pair if self.plans else None,
                           vocab=self.vocab)

    def iterator(self, chunk: int, mb: int):
        """The data iterator of ``chunk``, at microbatch ``mb`` (a replica reads only its path's)."""
        it = self.iterators[chunk]
        if isinstance(it, RoutedIterator):
            it.target = mb
        return it

    def first_of(self, chunk: int) -> bool:
        """The chunk's first forward of the call (mb 0 except on a replica)."""
        first = chunk not in self._first_done
        self._first_done.add(chunk)
        return first

    def record_forward(self, mb: int, num_tokens) -> None:
        self.mb_of_entry.extend([mb] * (len(self.forward_data_store) - len(self.mb_of_entry)))
        self.total_num_tokens += num_tokens

    def forward(self, stage: int, mb: int, inp):
        if self.plans is not None:
            return self.plans.forward(stage, mb, inp)
        c = self.chunk_of[stage]
        first = self.first_of(c)
        S = self.S
        last = self.placement.is_last(stage)
        fsf = self.forward_step_func
        if stage == 0 and self.vocab is not None and self.vocab.inputs is not None:  # the split embedding's output
            self.vocab.inputs.current = mb
        if last and self.vocab is not None:  # the output layer is the vocabulary passes': keep the loss function
            self.vocab.labels.current = mb
            fsf = self._keeping_loss_func(mb)
            last = False
        out, num_tokens = S.forward_step(
            fsf, self.iterator(c, mb), self.models[c], self.m, inp, self.forward_data_store,
            self.config, self.cp_size, self.collect_non_loss_data, None,
            is_first_microbatch=S.check_first_val_step(self.first_val_step, self.forward_only, first),
            current_microbatch=mb, vp_stage=None, is_last_stage=last)
        self.record_forward(mb, num_tokens)
        if inp is not None:  # the model chunk lets go of its input (the executor keeps it for the B):
            # megatron's set_input_tensor would hold it until the chunk's next F, past the B and
            # the W, through the optimizer step into the next iteration
            self._wrapped(self.models[c], "set_input_tensor")([None])
        return out

    def _keeping_loss_func(self, mb: int):
        def fsf(data_iterator, model, *a, **k):
            output, loss_func = self.forward_step_func(data_iterator, model, *a, **k)
            self.vocab.loss_funcs[mb] = loss_func
            return output, loss_func
        return fsf

    def loss_step(self, mb: int, losses: torch.Tensor) -> torch.Tensor:
        """Megatron's loss step on the per-token losses the vocabulary passes computed [b, s]: the
        user's loss function and Megatron's scaling (``forward_step_calc_loss``; the loss dict and the
        token count recorded as a last stage's forward would); returns each token's gradient scale."""
        c = self.chunk_of[self.placement.num_stages - 1]
        if self.forward_only:  # evaluation: the loss dict, no gradient
            _, num_tokens = self.S.forward_step_calc_loss(
                self.models[c], losses.detach(), self.vocab.loss_funcs.pop(mb), self.config, None,
                self.collect_non_loss_data, self.m, self.forward_data_store, self.cp_size, True)
            self.record_forward(mb, num_tokens)
            return None
        leaf = losses.detach().requires_grad_(True)
        with torch.enable_grad():
            out, num_tokens = self.S.forward_step_calc_loss(
                self.models[c], leaf, self.vocab.loss_funcs.pop(mb), self.config, None, self.collect_non_loss_data,
                self.m, self.forward_data_store, self.cp_size, True)
            if self.config.grad_scale_func is not None:
                out = self.config.grad_scale_func(out)
            (g,) = torch.autograd.grad(out, leaf)
        self.record_forward(mb, num_tokens)
        return g

    def backward(self, stage: int, mb: int, inp, out, grad, split: bool):
        if self.plans is not None:
            return self.plans.backward(stage, mb, inp, out, grad, split)
        ctx = self.queues[self.chunk_of[stage]].defer(mb) if split else contextlib.nullcontext()
        with ctx:
            return self.S.backward_step(inp, out, grad, config=self.config, **self._bwd_kwargs)

    def weight(self, stage: int, mb: int) -> None:
        self.queues[self.chunk_of[stage]].run(mb)

    def release(self, out) -> None:
        self.S.deallocate_output_tensor(out, self.config.deallocate_pipeline_outputs)

    def release_handed_over(self, out) -> None:
        """An output handed over to the next stage on this rank (the V's turn): that stage's input
        is a detached alias of its storage, so the output itself is needed only as the root of its
        B's graph. Released whatever ``deallocate_pipeline_outputs`` says (otherwise the storage
        outlives the input's offload and its B): with it, Megatron's pseudo-free (its backward then
        runs ``custom_backward``); without it, a one-element placeholder of the same shape (zero
        strides), all ``torch.autograd.backward`` checks of the output."""
        if self.config.deallocate_pipeline_outputs:
            self.release(out)
        elif isinstance(out, torch.Tensor) and out._base is None and out.numel() > 1:
            out.data = torch.empty((1,), dtype=out.dtype, device=out.device).expand(out.shape)

    def drain_iterators(self) -> None:
        """Replicated stages: every chunk that read data consumes exactly M items per call."""
        for it in self.iterators:
            if isinstance(it, RoutedIterator):
                it.drain(self.m)
