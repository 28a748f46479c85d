"""The path of one microbatch through a rank: what each action of a lowered list does, as
handlers of a dispatch table from action kind to handler (``BASE``), and the context an
``executor.execute`` call gives them (``Run``)::

  RECV_F  post a receive for the stage's input (or take it from the previous stage on this rank)
  F       wait for the input, run forward, keep (input, output) for the backward
  SEND_F  send the output to the rank of the next stage (or hand it over locally)
  RECV_B  post a receive for the output gradient (the last stage has none: it holds the loss)
  B / BW  wait for it, run backward (B: input gradient only, weight gradients deferred)
  SEND_B  send the input gradient to the previous stage's rank (or hand it over locally)
  W       run the deferred weight gradients of this stage and microbatch

After a rejected post-validation a compute pass only hands zeros on (``step``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..core.ir import BW, OFFLOAD_KINDS, RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, Placement, W
from .hooks import Hooks
from .p2p import P2P, PipelineTimeout

__all__ = ["Run", "ExecutionError", "step", "BASE", "f_input", "f_output", "b_inputs", "b_output"]


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


@dataclass
class Run:
    """One ``execute`` call's context: what every handler reads and writes."""

    actions: List[Action]
    rank: int
    placement: Placement
    passes: object  # runtime.executor.StagePasses: what each pass does (the executor imports this module)
    p2p: Optional[P2P]
    forward_only: bool
    hooks: Hooks
    bounds: Tuple[Dict[int, int], Dict[int, int]]  # each stage's last B/BW and last B/BW/W (positions)
    table: Dict[str, Callable[["Run", Action, int], None]]
    st: _State = field(default_factory=_State)


def step(run: Run, i: int) -> None:
    """Action ``i`` through its handler, between its hooks' ``begin`` and ``end``; after a rejected
    post-validation a compute pass only hands on zeros and nothing is moved to the host."""
    a = run.actions[i]
    run.hooks.begin(a)
    try:
        if run.st.drain and a.kind in OFFLOAD_KINDS:
            pass  # nothing is computed any more: nothing to move (the hooks hear finish(False))
        elif run.st.drain and a.kind in (F, B, BW, W):
            _drain(run, a)
        else:
            run.table[a.kind](run, a, i)
        run.hooks.end(a)
    except (ExecutionError, PipelineTimeout):
        raise
    except Exception as e:
        raise ExecutionError(f"rank {run.rank}: {a} (position {i}) failed: {type(e).__name__}: {e}") from e


# -- the base handlers: the path of one microbatch ----------------------------------------------

def _recv_f(run: Run, a: Action, i: int) -> None:
    ps, what = run.passes, f"the input of F{a.stage}.{a.mb}"
    with run.hooks.wait(what):
        run.st.pending_inputs[(a.stage, a.mb)] = run.p2p.recv(ps.recv_shape(a.stage, a.mb), ps.dtype, ps.device,
                                                               a.peer, what)


def _recv_b(run: Run, a: Action, i: int) -> None:
    ps, what = run.passes, f"the output gradient of B{a.stage}.{a.mb}"
    with run.hooks.wait(what):
        run.st.pending_grads[(a.stage, a.mb)] = run.p2p.recv(ps.recv_shape(a.stage, a.mb), ps.dtype, ps.device,
                                                              a.peer, what)


def _forward(run: Run, a: Action, i: int) -> None:
    inp = f_input(run, a)
    if run.forward_only:
        out = run.passes.forward(a.stage, a.mb, inp)
    else:
        with run.hooks.compute(a, (inp,)):
            out = run.passes.forward(a.stage, a.mb, inp)
    f_output(run, a, inp, out)


def _send_f(run: Run, a: Action, i: int) -> None:
    out = run.st.to_send_f.pop((a.stage, a.mb))
    run.p2p.send(out, a.peer, f"the output of F{a.stage}.{a.mb}")
    if run.passes.release_output is not None and not run.forward_only:
        run.passes.release_output(out)
    run.p2p.reap_sends()


def _backward(run: Run, a: Action, i: int) -> None:
    ps = run.passes
    grad, inp, out = b_inputs(run, a, i)
    with run.hooks.compute(a, (inp,)):
        in_grad = ps.backward(a.stage, a.mb, inp, out, grad, a.kind == B)
    if a.stage == 0 and getattr(ps.vocab, "inputs", None) is not None:  # the split embedding's gradient
        ps.vocab.inputs.backward_done(a.mb)
    b_output(run, a, i, in_grad)


def _send_b(run: Run, a: Action, i: int) -> None:
    run.p2p.send(run.st.to_send_b.pop((a.stage, a.mb)), a.peer, f"the input gradient of B{a.stage}.{a.mb}")
    run.p2p.reap_sends()


def _weight(run: Run, a: Action, i: int) -> None:
    with run.hooks.compute(a, ()):
        run.passes.weight(a.stage, a.mb)
    if i == run.bounds[1].get(a.stage):
        run.hooks.after_last_backward(a.stage)


#: action kind -> handler(run, action, position): the path of one microbatch
BASE: Dict[str, Callable[[Run, Action, int], None]] = {
    RECV_F: _recv_f, RECV_B: _recv_b, F: _forward, SEND_F: _send_f, B: _backward, BW: _backward,
    SEND_B: _send_b, W: _weight}


def f_input(run: Run, a: Action):
    """The input of F ``a``: received, handed over on this rank, or None on the first stage."""
    pl, st, key = run.placement, run.st, (a.stage, a.mb)
    if pl.is_first(a.stage):
        return None
    if key in st.pending_inputs:
        with run.hooks.wait(f"the input of F{a.stage}.{a.mb}"):
            inp = st.pending_inputs.pop(key).wait()
        return inp.requires_grad_(not run.forward_only)
    if key in st.local_inputs:
        return st.local_inputs.pop(key)
    raise ExecutionError(f"rank {run.rank}: F{a.stage}.{a.mb} has no input: no RECV_F was posted "
                         f"and stage {pl.prev_stage(a.stage)} did not run here")


def f_output(run: Run, a: Action, inp, out) -> None:
    """Keep F ``a``'s (input, output) for its backward and pass its output on."""
    pl, st, ps, key = run.placement, run.st, run.passes, (a.stage, a.mb)
    if not run.forward_only:
        st.saved[key] = (inp, out)
    nxt = pl.next_stage(a.stage)
    if nxt is None and ps.vocab is not None:  # the output layer is every rank's shards' (evaluating too)
        ps.vocab.loss_output(a.mb, out)
        if ps.release_output is not None and not run.forward_only:
            ps.release_output(out)  # like a sent output (the broadcast holds the data)
    elif nxt is not None and pl.rank_of(nxt) == run.rank:  # local hand-over (V turn)
        st.local_inputs[(nxt, a.mb)] = out.detach().requires_grad_(not run.forward_only)
        release = ps.release_handed_over or ps.release_output
        if release is not None and not run.forward_only:
            # the detached alias keeps the data: the next stage's input alone holds it (its
            # offload frees it; its B lets it go), not this output kept for its own B as well
            release(out)
    elif nxt is not None:
        st.to_send_f[key] = out


def b_inputs(run: Run, a: Action, i: int):
    """(output gradient, saved input, saved output) of B/BW ``a`` at position ``i``."""
    pl, st, key = run.placement, run.st, (a.stage, a.mb)
    if i == run.bounds[0].get(a.stage):
        run.hooks.before_last_backward(a.stage)
    vocab = run.passes.vocab
    if pl.is_last(a.stage):
        grad = vocab.loss_grad(a.mb) if vocab is not None else None
    elif key in st.pending_grads:
        with run.hooks.wait(f"the output gradient of B{a.stage}.{a.mb}"):
            grad = st.pending_grads.pop(key).wait()
    elif key in st.local_grads:
        grad = st.local_grads.pop(key)
    else:
        raise ExecutionError(f"rank {run.rank}: {a} has no output gradient: no RECV_B was posted "
                             f"and stage {pl.next_stage(a.stage)} did not run its backward here")
    inp, out = st.saved.pop(key)
    return grad, inp, out


def b_output(run: Run, a: Action, i: int, in_grad) -> None:
    """Pass B/BW ``a``'s input gradient on (to send, or handed over on this rank)."""
    pl, st = run.placement, run.st
    prev = pl.prev_stage(a.stage)
    if prev is not None:
        if pl.rank_of(prev) == run.rank:
            st.local_grads[(prev, a.mb)] = in_grad
        else:
            st.to_send_b[(a.stage, a.mb)] = in_grad
    if i == run.bounds[1].get(a.stage):
        run.hooks.after_last_backward(a.stage)


def _drain(run: Run, a: Action) -> None:
    """A pass after a rejected post-validation: consume its input, hand on zeros, compute nothing.
    Messages go where the handlers send them: to the stage's neighbours along its path."""
    pl, st, ps, rank, key = run.placement, run.st, run.passes, run.rank, (a.stage, a.mb)

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
