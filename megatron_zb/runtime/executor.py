"""Execute one rank's lowered schedule.

The executor knows nothing about Megatron: the caller supplies what a pass *does* as callables
(``StagePasses``) and this module walks the rank's action list, each action through its handler
(the path of one microbatch through a stage: ``runtime.path``).

An overlapped F&B pair (an F and a B/BW of two microbatches with only messages between them,
``overlap_pairs``) runs as one pass through ``passes.overlap`` when given (megatron's EP overlap:
one's all-to-all behind the other's compute), else as its two passes.

Each action kind runs through a dispatch table from kind to handler (``runtime.path.BASE``);
a feature that brings action kinds of its own registers their handlers with this call: the
vocabulary passes (``runtime.features.vocab.handlers``), activation offload's OFFLOAD/RELOAD (its
hook's ``handlers()``). An overlapped F&B pair runs through ``runtime.features.pairs``. Runtime features
(progress, activation offload, post-validation, profiling, gradient sync) attach as hooks
(``runtime.hooks``): the executor calls them at the points that module lists and knows nothing else
about them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..core.ir import BW, OFFLOAD_KINDS, Action, B, Placement, W
from .hooks import Hook, Hooks
from .p2p import P2P
from .path import BASE, ExecutionError, Run, step


@dataclass
class StagePasses:
    """What each pass does on this rank. ``stage`` is the global stage index."""

    forward: Callable[[int, int, Optional[torch.Tensor]], torch.Tensor]
    # backward(stage, mb, input, output, output_grad, split) -> input grad (None on stage 0)
    backward: Callable[[int, int, Optional[torch.Tensor], torch.Tensor, Optional[torch.Tensor], bool],
                       Optional[torch.Tensor]]
    weight: Callable[[int, int], None]
    recv_shape: Callable[[int, int], Sequence[int]]  # (stage, mb) -> activation shape
    dtype: torch.dtype = torch.float32
    device: object = "cpu"
    # release an activation that has been sent or handed over (deallocate_pipeline_outputs)
    release_output: Optional[Callable[[torch.Tensor], None]] = None
    # release an output handed over to the next stage on this rank (the V's turn), whose data lives
    # on in that stage's input (a detached alias of the same storage); release_output when None
    release_handed_over: Optional[Callable[[torch.Tensor], None]] = None
    # overlapped F&B pairs (DualPipe): overlap(f, b) runs an F and a B as one pass, e.g. one's
    # all-to-all on a communication stream behind the other's compute (megatron.ep_overlap);
    # f = (stage, mb, input), b = (stage, mb, input, output, output_grad, split) as for forward and
    # backward; returns (F's output, B's input grad). Without it the two run one after the other.
    overlap: Optional[Callable[[tuple, tuple], Tuple[torch.Tensor, Optional[torch.Tensor]]]] = None
    # vocabulary parallelism (runtime.features.vocab.VocabRuntime): runs VS/VT/VW; the loss stage's output goes to
    # it (``loss_output(mb, out)``) and its backward takes the output gradient from it (``loss_grad(mb)``)
    vocab: Optional[object] = None


def execute(actions: List[Action], rank: int, placement: Placement, passes: StagePasses,
            p2p: Optional[P2P], forward_only: bool = False,
            overlap_pairs: Optional[Dict[int, int]] = None,
            hooks: Sequence[Optional[Hook]] = ()) -> bool:
    """Run ``actions`` (this rank's lowered list) to the end.

    ``overlap_pairs`` maps the position of an overlapped pair's F to its B's (only messages lie
    between them): the receives in between are posted first, then ``passes.overlap`` runs the F and
    the B as one pass (one after the other without it), then the sends in between.

    ``hooks`` (``runtime.hooks``): the runtime features of this call. If a hook's ``validate``
    (called once, right before the rank's first backward) says no, the rest of the list runs
    without computing: receives are taken and dropped, sends carry zeros of the right shape, so
    every peer's messages still match. Returns False in that case, else True. Eight parameters:
    the list, where it runs, what its passes do and its features, as every caller has them.
    """
    from .features.pairs import run_pair
    from .features.vocab import handlers as vocab_handlers
    hk = Hooks(hooks)
    table = dict(BASE)
    table.update(hk.handlers())
    if passes.vocab is not None:
        table.update(vocab_handlers(passes.vocab))
    missing = sorted({a.kind for a in actions} - set(table))
    if missing:
        raise ExecutionError(f"rank {rank}: the schedule has {', '.join(missing)} actions but nothing here runs them"
                             + (" (activation offload needs an offload manager's hook)"
                                if set(missing) & set(OFFLOAD_KINDS) else ""))
    run = Run(actions, rank, placement, passes, p2p, forward_only, hk, _backward_bounds(actions), table)
    pairs = overlap_pairs or {}
    check_at = _validation_position(actions, pairs) if hk.has("validate") and not forward_only else None
    hk.prepare(actions)
    i = 0
    while i < len(actions):
        if i == check_at and not hk.validate():
            run.st.drain = True
        if i in pairs and not forward_only and not run.st.drain:
            i = run_pair(run, i, pairs[i]) + 1
            continue
        step(run, i)
        i += 1
    if p2p is not None:
        p2p.reap_sends(block=True)
    st = run.st
    leftovers = list(st.pending_inputs) + list(st.pending_grads) + list(st.local_inputs) + \
        list(st.local_grads) + list(st.to_send_f) + list(st.to_send_b)
    if leftovers:
        raise ExecutionError(f"rank {rank}: received tensors that no pass consumed: {leftovers}")
    hk.finish(not st.drain)
    return not st.drain


def rank_pairs(lowered, rank: int) -> Dict[int, int]:
    """This rank's overlapped F&B pairs of a lowered schedule (``meta['overlap_pairs']``): position of
    the F -> position of its backward, as ``execute`` takes them (``overlap_pairs``)."""
    return {i: j for r, i, j in lowered.meta.get("overlap_pairs", ()) if r == rank}


def _validation_position(actions, pairs) -> Optional[int]:
    first = next((i for i, a in enumerate(actions) if a.kind in (B, BW)), None)
    for i, j in pairs.items():
        if j == first:
            return i
    return first


def _backward_bounds(actions):
    """Position of each stage's last B/BW (opens its gradient-sync window) and last B/BW/W."""
    last_b, last = {}, {}
    for i, a in enumerate(actions):
        if a.kind in (B, BW):
            last_b[a.stage] = i
        if a.kind in (B, BW, W):
            last[a.stage] = i
    return last_b, last
