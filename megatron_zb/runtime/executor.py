"""Execute one rank's lowered schedule.

The executor knows nothing about Megatron: the caller supplies what a pass *does* as callables
(``StagePasses``) and this module walks the rank's action list. The path of one microbatch
through a stage:

  RECV_F  post a receive for the stage's input (or take it from the previous stage on this rank)
  F       wait for the input, run forward, keep (input, output) for the backward
  SEND_F  send the output to the rank of the next stage (or hand it over locally)
  RECV_B  post a receive for the output gradient (the last stage has none: it holds the loss)
  B / BW  wait for it, run backward (B: input gradient only, weight gradients deferred)
  SEND_B  send the input gradient to the previous stage's rank (or hand it over locally)
  W       run the deferred weight gradients of this stage and microbatch

An overlapped F&B pair (an F and a B/BW of two microbatches with only messages between them,
``overlap_pairs``) runs as one pass through ``passes.overlap`` when given (megatron's EP overlap:
one's all-to-all behind the other's compute), else as its two passes.

Runtime features (progress, activation offload, post-validation, profiling, gradient sync)
attach as hooks (``runtime.hooks``): the executor calls them at the points that module lists and
knows nothing else about them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..core.ir import (BW, OFFLOAD, OFFLOAD_KINDS, OFFLOAD_W, RECV_B, RECV_F, RELOAD, RELOAD_W, SEND_B, SEND_F,
                       VOCAB_KINDS, Action, B, F, Placement, W)
from .hooks import Hook, Hooks
from .p2p import P2P, PipelineTimeout


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


Key = Tuple[int, int]  # (stage, microbatch)


@dataclass
class _State:
    local_inputs: Dict[Key, torch.Tensor] = field(default_factory=dict)  # handed over on this rank
    local_grads: Dict[Key, torch.Tensor] = field(default_factory=dict)
    pending_inputs: Dict[Key, object] = field(default_factory=dict)  # posted receives
    pending_grads: Dict[Key, object] = field(default_factory=dict)
    saved: Dict[Key, Tuple[Optional[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    to_send_f: Dict[Key, torch.Tensor] = field(default_factory=dict)
    to_send_b: Dict[Key, torch.Tensor] = field(default_factory=dict)
    drain: bool = False  # post-validation rejected the step: pass messages on, compute nothing


class ExecutionError(RuntimeError):
    pass


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
    every peer's messages still match. Returns False in that case, else True.
    """
    st = _State()
    hk = Hooks(hooks)
    bounds = _backward_bounds(actions)
    pairs = overlap_pairs or {}
    if not hk.has("transfer") and any(a.kind in OFFLOAD_KINDS for a in actions):
        raise ExecutionError(f"rank {rank}: the schedule offloads activations but no hook moves them "
                             "(an offload manager)")
    check_at = _validation_position(actions, pairs) if hk.has("validate") and not forward_only else None
    hk.prepare(actions)

    def step(i):
        a = actions[i]
        hk.begin(a)
        try:
            _step(a, i, rank, placement, passes, p2p, st, forward_only, bounds, hk)
            hk.end(a)
        except (ExecutionError, PipelineTimeout):
            raise
        except Exception as e:
            raise ExecutionError(f"rank {rank}: {a} (position {i}) failed: {type(e).__name__}: {e}") from e

    i = 0
    while i < len(actions):
        if i == check_at and not hk.validate():
            st.drain = True
        if i in pairs and not forward_only and not st.drain:
            j = pairs[i]
            between = range(i + 1, j)
            if actions[i].kind != F or actions[j].kind not in (B, BW) or any(actions[k].is_compute for k in between):
                raise ExecutionError(f"rank {rank}: positions {i} and {j} are not an overlapped F&B pair")
            for k in between:
                if actions[k].kind in (RECV_F, RECV_B, RELOAD, RELOAD_W):
                    step(k)
            sends = [k for k in between if actions[k].kind in (SEND_F, SEND_B, OFFLOAD, OFFLOAD_W)]
            if passes.overlap is None:
                step(i)
                for k in sends:
                    step(k)
                step(j)
            else:
                fa, ba = actions[i], actions[j]
                hk.begin(fa)
                hk.begin(ba)
                try:
                    _pair(fa, i, ba, j, rank, placement, passes, st, bounds, hk)
                except (ExecutionError, PipelineTimeout):
                    raise
                except Exception as e:
                    raise ExecutionError(f"rank {rank}: the overlapped pair {fa} & {ba} (positions {i}, {j}) "
                                         f"failed: {type(e).__name__}: {e}") from e
                hk.end(fa)
                hk.end(ba)
                for k in sends:
                    step(k)
            i = j + 1
            continue
        step(i)
        i += 1
    if p2p is not None:
        p2p.reap_sends(block=True)
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


def _step(a: Action, i: int, rank: int, pl: Placement, ps: StagePasses, p2p: Optional[P2P], st: _State,
          forward_only: bool, bounds, hk: Hooks) -> None:
    key = (a.stage, a.mb)
    k = a.kind
    if st.drain and k in OFFLOAD_KINDS:
        return  # nothing is computed any more: nothing to move (the hooks hear finish(False))
    if st.drain and k in (F, B, BW, W):
        _drain(a, key, rank, pl, ps, st)
    elif k == RECV_F:
        what = f"the input of F{a.stage}.{a.mb}"
        with hk.wait(what):
            st.pending_inputs[key] = p2p.recv(ps.recv_shape(*key), ps.dtype, ps.device, a.peer, what)
    elif k == RECV_B:
        what = f"the output gradient of B{a.stage}.{a.mb}"
        with hk.wait(what):
            st.pending_grads[key] = p2p.recv(ps.recv_shape(*key), ps.dtype, ps.device, a.peer, what)
    elif k == F:
        inp = _f_input(a, key, rank, pl, st, forward_only, hk)
        if forward_only:
            out = ps.forward(a.stage, a.mb, inp)
        else:
            with hk.compute(a, (inp,)):
                out = ps.forward(a.stage, a.mb, inp)
        _f_output(a, key, rank, pl, ps, st, forward_only, inp, out)
    elif k == SEND_F:
        out = st.to_send_f.pop(key)
        p2p.send(out, a.peer, f"the output of F{a.stage}.{a.mb}")
        if ps.release_output is not None and not forward_only:
            ps.release_output(out)
        p2p.reap_sends()
    elif k in (B, BW):
        grad, inp, out = _b_inputs(a, key, i, rank, pl, st, bounds, hk, ps.vocab)
        with hk.compute(a, (inp,)):
            in_grad = ps.backward(a.stage, a.mb, inp, out, grad, k == B)
        if a.stage == 0 and getattr(ps.vocab, "inputs", None) is not None:  # the split embedding's gradient
            ps.vocab.inputs.backward_done(a.mb)
        _b_output(a, key, i, rank, pl, st, bounds, hk, in_grad)
    elif k == SEND_B:
        p2p.send(st.to_send_b.pop(key), a.peer, f"the input gradient of B{a.stage}.{a.mb}")
        p2p.reap_sends()
    elif k == W:
        with hk.compute(a, ()):
            ps.weight(a.stage, a.mb)
        if i == bounds[1].get(a.stage):
            hk.after_last_backward(a.stage)
    elif k in OFFLOAD_KINDS:
        hk.transfer(a)
    elif k in VOCAB_KINDS:  # this rank's vocabulary shard (runtime.features.vocab)
        with hk.compute(a, ()):
            ps.vocab.run(k, a.mb)
    else:
        raise ExecutionError(f"rank {rank}: unknown action {a}")


def _f_input(a: Action, key: Key, rank: int, pl: Placement, st: _State, forward_only: bool, hk: Hooks):
    if pl.is_first(a.stage):
        return None
    if key in st.pending_inputs:
        with hk.wait(f"the input of F{a.stage}.{a.mb}"):
            inp = st.pending_inputs.pop(key).wait()
        return inp.requires_grad_(not forward_only)
    if key in st.local_inputs:
        return st.local_inputs.pop(key)
    raise ExecutionError(f"rank {rank}: F{a.stage}.{a.mb} has no input: no RECV_F was posted "
                         f"and stage {pl.prev_stage(a.stage)} did not run here")


def _f_output(a: Action, key: Key, rank: int, pl: Placement, ps: StagePasses, st: _State, forward_only: bool,
              inp, out) -> None:
    if not forward_only:
        st.saved[key] = (inp, out)
    nxt = pl.next_stage(a.stage)
    if nxt is None and ps.vocab is not None:  # the output layer is every rank's shards' (evaluating too)
        ps.vocab.loss_output(a.mb, out)
        if ps.release_output is not None and not forward_only:
            ps.release_output(out)  # like a sent output (the broadcast holds the data)
    elif nxt is not None and pl.rank_of(nxt) == rank:  # local hand-over (V turn)
        st.local_inputs[(nxt, a.mb)] = out.detach().requires_grad_(not forward_only)
        release = ps.release_handed_over or ps.release_output
        if release is not None and not forward_only:
            # the detached alias keeps the data: the next stage's input alone holds it (its
            # offload frees it; its B lets it go), not this output kept for its own B as well
            release(out)
    elif nxt is not None:
        st.to_send_f[key] = out


def _b_inputs(a: Action, key: Key, i: int, rank: int, pl: Placement, st: _State, bounds, hk: Hooks, vocab=None):
    """(output gradient, saved input, saved output) of a B/BW."""
    if i == bounds[0].get(a.stage):
        hk.before_last_backward(a.stage)
    if pl.is_last(a.stage):
        grad = vocab.loss_grad(a.mb) if vocab is not None else None
    elif key in st.pending_grads:
        with hk.wait(f"the output gradient of B{a.stage}.{a.mb}"):
            grad = st.pending_grads.pop(key).wait()
    elif key in st.local_grads:
        grad = st.local_grads.pop(key)
    else:
        raise ExecutionError(f"rank {rank}: {a} has no output gradient: no RECV_B was posted "
                             f"and stage {pl.next_stage(a.stage)} did not run its backward here")
    inp, out = st.saved.pop(key)
    return grad, inp, out


def _b_output(a: Action, key: Key, i: int, rank: int, pl: Placement, st: _State, bounds, hk: Hooks, in_grad) -> None:
    prev = pl.prev_stage(a.stage)
    if prev is not None:
        if pl.rank_of(prev) == rank:
            st.local_grads[(prev, a.mb)] = in_grad
        else:
            st.to_send_b[key] = in_grad
    if i == bounds[1].get(a.stage):
        hk.after_last_backward(a.stage)


def _pair(fa: Action, i: int, ba: Action, j: int, rank: int, pl: Placement, ps: StagePasses, st: _State,
          bounds, hk: Hooks) -> None:
    """An overlapped F&B pair as one pass (``passes.overlap``): both inputs first, then the pass
    inside both passes' compute contexts (the F's outermost), then both results."""
    fkey, bkey = (fa.stage, fa.mb), (ba.stage, ba.mb)
    inp = _f_input(fa, fkey, rank, pl, st, False, hk)
    grad, b_inp, b_out = _b_inputs(ba, bkey, j, rank, pl, st, bounds, hk, ps.vocab)
    with hk.compute(fa, (inp,)), hk.compute(ba, (b_inp,)):
        out, in_grad = ps.overlap((fa.stage, fa.mb, inp), (ba.stage, ba.mb, b_inp, b_out, grad, ba.kind == B))
    _f_output(fa, fkey, rank, pl, ps, st, False, inp, out)
    _b_output(ba, bkey, j, rank, pl, st, bounds, hk, in_grad)


def _drain(a: Action, key: Key, rank: int, pl: Placement, ps: StagePasses, st: _State) -> None:
    """A pass after a rejected post-validation: consume its input, hand on zeros, compute nothing.
    Messages go where ``_step`` sends them: to the stage's neighbours along its path."""
    def zeros(stage):
        return torch.zeros(tuple(ps.recv_shape(stage, a.mb)), dtype=ps.dtype, device=ps.device)

    if a.kind == F:
        if not pl.is_first(a.stage):
            if key in st.pending_inputs:
                st.pending_inputs.pop(key).wait()
            else:
                st.local_inputs.pop(key, None)
        nxt = pl.next_stage(a.stage)
        if nxt is not None:
            if pl.rank_of(nxt) == rank:
                st.local_inputs[(nxt, a.mb)] = zeros(nxt)
            else:
                st.to_send_f[key] = zeros(nxt)
    elif a.kind in (B, BW):
        if not pl.is_last(a.stage):
            if key in st.pending_grads:
                st.pending_grads.pop(key).wait()
            else:
                st.local_grads.pop(key, None)
        st.saved.pop(key, None)
        prev = pl.prev_stage(a.stage)
        if prev is not None:
            if pl.rank_of(prev) == rank:
                st.local_grads[(prev, a.mb)] = zeros(a.stage)
            else:
                st.to_send_b[key] = zeros(a.stage)
