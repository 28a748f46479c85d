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

With activation offload (``StagePasses.offload``): F runs under ``capture``; OFFLOAD / RELOAD
(OFFLOAD_W / RELOAD_W for what W needs) start the copies; B (W) first ``wait``s for its reload.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..core.ir import (B, BW, F, OFFLOAD, OFFLOAD_W, RECV_B, RECV_F, RELOAD, RELOAD_W, SEND_B, SEND_F, W, Action,
                       Placement)
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
    # called right before the first / after the last pass that touches a stage's gradients
    before_last_backward: Optional[Callable[[int], None]] = None
    after_last_backward: Optional[Callable[[int], None]] = None
    # timing hook: called with (kind, stage, mb, seconds) after each compute pass
    on_pass: Optional[Callable[[str, int, int, float], None]] = None
    # release an activation that has been sent or handed over (deallocate_pipeline_outputs)
    release_output: Optional[Callable[[torch.Tensor], None]] = None
    # overlapped F&B pairs (DualPipe): overlap(run_f, run_b) runs both thunks, e.g. on two CUDA
    # streams; without it they run one after the other
    overlap: Optional[Callable[[Callable[[], None], Callable[[], None]], None]] = None
    # activation offload (runtime.offload.OffloadManager or the same methods): capture(stage, mb,
    # offload, inputs) around every F, offload/reload(_w) at OFFLOAD/RELOAD(_W), wait(_w) before B/W
    offload: Optional[object] = None


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
    offloaded: set = field(default_factory=set)  # (stage, mb) whose activation an OFFLOAD moves
    drain: bool = False  # post-validation rejected the step: pass messages on, compute nothing


class ExecutionError(RuntimeError):
    pass


def execute(actions: List[Action], rank: int, placement: Placement, passes: StagePasses,
            p2p: Optional[P2P], forward_only: bool = False,
            overlap_pairs: Optional[Dict[int, int]] = None,
            validate: Optional[Callable[[], bool]] = None) -> bool:
    """Run ``actions`` (this rank's lowered list) to the end.

    ``overlap_pairs`` maps the position of an overlapped pair's F to its B's (only messages lie
    between them): the receives in between are posted first, then ``passes.overlap`` gets the F
    (with the sends that follow it) and the B as two thunks.

    ``validate`` (optimizer post-validation, ``runtime.postval``): called once, right before the
    rank's first backward (before the overlapped pair holding it). If it returns False the rest
    of the list runs without computing: receives are taken and dropped, sends carry zeros of the
    right shape, so every peer's messages still match. Returns False in that case, else True.
    """
    nst = placement.num_stages
    st = _State()
    last_b, last = _backward_bounds(actions)
    pairs = overlap_pairs or {}
    st.offloaded = {(a.stage, a.mb) for a in actions if a.kind == OFFLOAD}
    if passes.offload is None and any(a.kind in (OFFLOAD, RELOAD, OFFLOAD_W, RELOAD_W) for a in actions):
        raise ExecutionError(f"rank {rank}: the schedule offloads activations but no offload manager was given "
                             "(StagePasses.offload)")
    check_at = _validation_position(actions, pairs) if validate is not None and not forward_only else None

    prog = getattr(p2p, "progress", None)  # runtime.progress: what this rank runs / finished last

    def step(i):
        a = actions[i]
        if prog is not None:
            prog.begin(a)
        try:
            _step(a, i, rank, placement, nst, passes, p2p, st, forward_only, last_b, last)
            if prog is not None:
                prog.end(a)
        except (ExecutionError, PipelineTimeout):
            raise
        except Exception as e:
            raise ExecutionError(f"rank {rank}: {a} (position {i}) failed: {type(e).__name__}: {e}") from e

    i = 0
    while i < len(actions):
        if i == check_at and not validate():
            st.drain = True
        if i in pairs and not forward_only and not st.drain:
            j = pairs[i]
            between = range(i + 1, j)
            if actions[i].kind != F or actions[j].kind not in (B, BW) or any(actions[k].is_compute for k in between):
                raise ExecutionError(f"rank {rank}: positions {i} and {j} are not an overlapped F&B pair")
            for k in between:
                if actions[k].kind in (RECV_F, RECV_B, RELOAD, RELOAD_W):
                    step(k)

            def run_f(i=i, between=between):
                step(i)
                for k in between:
                    if actions[k].kind in (SEND_F, SEND_B, OFFLOAD, OFFLOAD_W):
                        step(k)

            (passes.overlap or _one_after_the_other)(run_f, lambda j=j: step(j))
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
    return not st.drain


def _validation_position(actions, pairs) -> Optional[int]:
    first = next((i for i, a in enumerate(actions) if a.kind in (B, BW)), None)
    for i, j in pairs.items():
        if j == first:
            return i
    return first


def _one_after_the_other(run_f, run_b):
    run_f()
    run_b()


def _backward_bounds(actions):
    """Position of each stage's last B/BW (opens its gradient-sync window) and last B/BW/W."""
    last_b, last = {}, {}
    for i, a in enumerate(actions):
        if a.kind in (B, BW):
            last_b[a.stage] = i
        if a.kind in (B, BW, W):
            last[a.stage] = i
    return last_b, last


def _step(a: Action, i: int, rank: int, pl: Placement, nst: int, ps: StagePasses, p2p: Optional[P2P],
          st: _State, forward_only: bool, last_b: Dict[int, int], last: Dict[int, int]) -> None:
    key = (a.stage, a.mb)
    k = a.kind
    if st.drain and k in (OFFLOAD, RELOAD, OFFLOAD_W, RELOAD_W):
        return  # nothing is computed any more: nothing to move (the caller discards the manager's parts)
    if st.drain and k in (F, B, BW, W):
        _drain(a, key, rank, pl, nst, ps, st)
    elif k == RECV_F:
        st.pending_inputs[key] = p2p.recv(ps.recv_shape(*key), ps.dtype, ps.device, a.peer,
                                          f"the input of F{a.stage}.{a.mb}")
    elif k == RECV_B:
        st.pending_grads[key] = p2p.recv(ps.recv_shape(*key), ps.dtype, ps.device, a.peer,
                                         f"the output gradient of B{a.stage}.{a.mb}")
    elif k == F:
        if pl.is_first(a.stage):
            inp = None
        elif key in st.pending_inputs:
            inp = st.pending_inputs.pop(key).wait().requires_grad_(not forward_only)
        elif key in st.local_inputs:
            inp = st.local_inputs.pop(key)
        else:
            raise ExecutionError(f"rank {rank}: F{a.stage}.{a.mb} has no input: no RECV_F was posted "
                                 f"and stage {pl.prev_stage(a.stage)} did not run here")
        t0 = time.perf_counter()
        if ps.offload is not None and not forward_only:
            with ps.offload.capture(a.stage, a.mb, key in st.offloaded, (inp,)):
                out = ps.forward(a.stage, a.mb, inp)
        else:
            out = ps.forward(a.stage, a.mb, inp)
        _timed(ps, "F", a, t0)
        if not forward_only:
            st.saved[key] = (inp, out)
        nxt = pl.next_stage(a.stage)
        if nxt is not None and pl.rank_of(nxt) == rank:  # local hand-over (V turn)
            st.local_inputs[(nxt, a.mb)] = out.detach().requires_grad_(not forward_only)
            if ps.release_output is not None and not forward_only:
                ps.release_output(out)  # like a sent output: the detached copy keeps the data
        elif nxt is not None:
            st.to_send_f[key] = out
    elif k == SEND_F:
        out = st.to_send_f.pop(key)
        p2p.send(out, a.peer, f"the output of F{a.stage}.{a.mb}")
        if ps.release_output is not None and not forward_only:
            ps.release_output(out)
        p2p.reap_sends()
    elif k in (B, BW):
        if i == last_b.get(a.stage) and ps.before_last_backward is not None:
            ps.before_last_backward(a.stage)
        if pl.is_last(a.stage):
            grad = None
        elif key in st.pending_grads:
            grad = st.pending_grads.pop(key).wait()
        elif key in st.local_grads:
            grad = st.local_grads.pop(key)
        else:
            raise ExecutionError(f"rank {rank}: {a} has no output gradient: no RECV_B was posted "
                                 f"and stage {pl.next_stage(a.stage)} did not run its backward here")
        inp, out = st.saved.pop(key)
        if ps.offload is not None:
            ps.offload.wait(a.stage, a.mb)
        t0 = time.perf_counter()
        in_grad = ps.backward(a.stage, a.mb, inp, out, grad, k == B)
        _timed(ps, k, a, t0)
        prev = pl.prev_stage(a.stage)
        if prev is not None:
            if pl.rank_of(prev) == rank:
                st.local_grads[(prev, a.mb)] = in_grad
            else:
                st.to_send_b[key] = in_grad
        if i == last.get(a.stage) and ps.after_last_backward is not None:
            ps.after_last_backward(a.stage)
    elif k == SEND_B:
        p2p.send(st.to_send_b.pop(key), a.peer, f"the input gradient of B{a.stage}.{a.mb}")
        p2p.reap_sends()
    elif k == W:
        if ps.offload is not None:
            ps.offload.wait_w(a.stage, a.mb)
        t0 = time.perf_counter()
        ps.weight(a.stage, a.mb)
        _timed(ps, "W", a, t0)
        if i == last.get(a.stage) and ps.after_last_backward is not None:
            ps.after_last_backward(a.stage)
    elif k == OFFLOAD:
        ps.offload.offload(a.stage, a.mb)
    elif k == RELOAD:
        ps.offload.reload(a.stage, a.mb)
    elif k == OFFLOAD_W:
        ps.offload.offload_w(a.stage, a.mb)
    elif k == RELOAD_W:
        ps.offload.reload_w(a.stage, a.mb)
    else:
        raise ExecutionError(f"rank {rank}: unknown action {a}")


def _drain(a: Action, key: Key, rank: int, pl: Placement, nst: int, ps: StagePasses, st: _State) -> None:
    """A pass after a rejected post-validation: consume its input, hand on zeros, compute nothing."""
    def zeros(stage):
        return torch.zeros(tuple(ps.recv_shape(stage, a.mb)), dtype=ps.dtype, device=ps.device)

    if a.kind == F:
        if a.stage > 0:
            if key in st.pending_inputs:
                st.pending_inputs.pop(key).wait()
            else:
                st.local_inputs.pop(key, None)
        if a.stage + 1 < nst:
            if pl.rank_of(a.stage + 1) == rank:
                st.local_inputs[(a.stage + 1, a.mb)] = zeros(a.stage + 1)
            else:
                st.to_send_f[key] = zeros(a.stage + 1)
    elif a.kind in (B, BW):
        if a.stage < nst - 1:
            if key in st.pending_grads:
                st.pending_grads.pop(key).wait()
            else:
                st.local_grads.pop(key, None)
        st.saved.pop(key, None)
        if a.stage > 0:
            if pl.rank_of(a.stage - 1) == rank:
                st.local_grads[(a.stage - 1, a.mb)] = zeros(a.stage)
            else:
                st.to_send_b[key] = zeros(a.stage)


def _timed(ps: StagePasses, kind: str, a: Action, t0: float) -> None:
    if ps.on_pass is not None:
        ps.on_pass(kind, a.stage, a.mb, time.perf_counter() - t0)
