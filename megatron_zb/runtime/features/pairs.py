"""Overlapped F&B pairs (DualPipe's, and the core's pairs for MoE's all-to-all): an F and a B/BW of
two microbatches with only messages between them, run as one pass through ``passes.overlap`` (one's
all-to-all on a communication stream behind the other's compute: megatron's EP overlap), or as
their two passes where there is none. ``runtime.executor.execute`` hands a pair here by its positions."""
from __future__ import annotations

from ...core.ir import BW, OFFLOAD, OFFLOAD_W, RECV_B, RECV_F, RELOAD, RELOAD_W, SEND_B, SEND_F, B, F
from ..path import ExecutionError, Run, b_inputs, b_output, f_input, f_output, step
from ..p2p import PipelineTimeout

__all__ = ["run_pair"]


def run_pair(run: Run, i: int, j: int) -> int:
    """The pair of the F at position ``i`` and the backward at ``j``: the receives between them
    first, then the pair, then the sends between them. Returns ``j``."""
    actions, rank = run.actions, run.rank
    between = range(i + 1, j)
    if actions[i].kind != F or actions[j].kind not in (B, BW) or any(actions[k].is_compute for k in between):
        raise ExecutionError(f"rank {rank}: positions {i} and {j} are not an overlapped F&B pair")
    for k in between:
        if actions[k].kind in (RECV_F, RECV_B, RELOAD, RELOAD_W):
            step(run, k)
    sends = [k for k in between if actions[k].kind in (SEND_F, SEND_B, OFFLOAD, OFFLOAD_W)]
    if run.passes.overlap is None:
        step(run, i)
        for k in sends:
            step(run, k)
        step(run, j)
        return j
    fa, ba = actions[i], actions[j]
    run.hooks.begin(fa)
    run.hooks.begin(ba)
    try:
        _one_pass(run, i, j)
    except (ExecutionError, PipelineTimeout):
        raise
    except Exception as e:
        raise ExecutionError(f"rank {rank}: the overlapped pair {fa} & {ba} (positions {i}, {j}) "
                             f"failed: {type(e).__name__}: {e}") from e
    run.hooks.end(fa)
    run.hooks.end(ba)
    for k in sends:
        step(run, k)
    return j


def _one_pass(run: Run, i: int, j: int) -> None:
    """Both inputs first, then the pass inside both passes' compute contexts (the F's outermost),
    then both results."""
    fa, ba = run.actions[i], run.actions[j]
    inp = f_input(run, fa)
    grad, b_inp, b_out = b_inputs(run, ba, j)
    with run.hooks.compute(fa, (inp,)), run.hooks.compute(ba, (b_inp,)):
        out, in_grad = run.passes.overlap((fa.stage, fa.mb, inp), (ba.stage, ba.mb, b_inp, b_out, grad, ba.kind == B))
    f_output(run, fa, inp, out)
    b_output(run, ba, j, in_grad)
