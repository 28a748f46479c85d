"""A plain-torch pipeline (no megatron) to test the executor, lowering and p2p over gloo.

Stage s is tanh(x @ W_s + b_s); the last stage also computes the loss mean(y^2). The backward
split is generic: B takes the input gradient with autograd.grad(retain_graph=True), W takes the
weight gradients from the retained graph later.
"""
import os

import torch
import torch.distributed as dist

from megatron_zb.core.ir import Setting
from megatron_zb.core.sim.lower import forward_only as fwd_only_schedule
from megatron_zb.core.sim.lower import lower
from megatron_zb.core.schedules import generate, get
from megatron_zb.runtime.executor import StagePasses, execute, rank_pairs
from megatron_zb.runtime.p2p import P2P, PairGroups

H, MBS = 8, 3


def stage_params(s):
    g = torch.Generator().manual_seed(1000 + s)
    return (torch.randn(H, H, generator=g) * 0.5).requires_grad_(), (torch.randn(H, generator=g) * 0.1).requires_grad_()


def batch(mb):
    g = torch.Generator().manual_seed(7 + mb)
    return torch.randn(MBS, H, generator=g)


def stage_forward(params, s, nst, x):
    w, b = params
    y = torch.tanh(x @ w + b)
    return (y ** 2).mean() if s == nst - 1 else y


def reference(nst, m):
    params = [stage_params(s) for s in range(nst)]
    losses = []
    for mb in range(m):
        x = batch(mb)
        for s in range(nst):
            x = stage_forward(params[s], s, nst, x)
        x.backward()
        losses.append(x.item())
    return losses, {s: [p.grad.numpy().copy() for p in params[s]] for s in range(nst)}


# (name, world, m, chunks) -> the generated schedule. The parent generates each once and hands them
# to the ranks (``rank_case``'s ``schedules``): four ranks generating the searched schedules again
# cost four times the parent's 6 CPU seconds at P=4 (the executor is what these tests check).
_SCHEDULES = {}


def generated(name, world, m, chunks):
    key = (name, world, m, chunks)
    if key not in _SCHEDULES:
        spec = get(name)
        _SCHEDULES[key] = generate(name, Setting(world, m, chunks=chunks if spec.chunks is None else None))
    return _SCHEDULES[key]


def run_rank(rank, world, name, m, chunks, fwd_only, drop_sends_on=None, timeout_s=60, offload=None):
    spec = get(name)
    st = Setting(world, m, chunks=chunks if spec.chunks is None else None)
    sched = generated(name, world, m, chunks)
    mgr = None
    if offload is not None:  # activation offload at this ratio (copies: synchronous CPU test mode)
        from megatron_zb.core.sim.hostlink import OffloadOptions
        from megatron_zb.core.passes.offload import add_offload
        from megatron_zb.runtime.features.offload import OffloadManager
        from megatron_zb.runtime.features.offload_hook import OffloadHook
        sched = add_offload(sched, st, OffloadOptions(ratio=offload, time=0.1, w_parts=False))
        mgr = OffloadManager("cpu", cpu_test=True, min_elements=0)
    if fwd_only:
        sched = fwd_only_schedule(sched)
    low = lower(sched)
    pl = sched.placement
    nst = pl.num_stages
    params = {s: stage_params(s) for s in pl.stages_of(rank)}
    graphs = {}
    losses = {}

    def forward(s, mb, inp):
        x = batch(mb) if s == 0 else inp
        out = stage_forward(params[s], s, nst, x)
        if s == nst - 1:
            losses[mb] = out.item()
        return out

    def backward(s, mb, inp, out, grad, split):
        if s == nst - 1:
            grad = torch.ones_like(out)
        if not split:
            torch.autograd.backward(out, grad)
            return inp.grad if inp is not None else None
        gi = torch.autograd.grad(out, [inp], grad, retain_graph=True)[0] if inp is not None else None
        graphs[(s, mb)] = (out, grad)
        return gi

    def weight(s, mb):
        out, grad = graphs.pop((s, mb))
        gw = torch.autograd.grad(out, list(params[s]), grad)
        for p, g in zip(params[s], gw):
            p.grad = g if p.grad is None else p.grad + g

    groups = _groups(world)
    p2p = P2P(groups, rank, timeout_s=timeout_s)
    passes = StagePasses(forward=forward, backward=backward, weight=weight,
                         recv_shape=lambda s, mb: (MBS, H))
    if mgr is not None:
        mgr.ignore(p for ps in params.values() for p in ps)
    actions = low.orders[rank]
    if drop_sends_on == rank:  # a broken peer: never sends anything
        actions = [a for a in actions if not a.kind.startswith("SEND")]
        passes.forward = lambda s, mb, inp: stage_forward(params[s], s, nst, batch(mb) if s == 0 else inp).detach()
    calls = []

    def pair(f, b):  # an overlapped pair as one pass (here: the F, then the B)
        calls.append(1)
        return forward(*f), backward(*b)

    passes.overlap = pair
    pairs = rank_pairs(low, rank)
    hook = OffloadHook(mgr) if mgr is not None else None
    execute(actions, rank, pl, passes, p2p, forward_only=fwd_only, overlap_pairs=pairs, hooks=[hook])
    if not fwd_only:
        assert len(calls) == len(pairs), (len(calls), len(pairs))  # the hook ran every pair
    assert not graphs, f"W passes left: {sorted(graphs)}"
    grads = {s: [None if p.grad is None else p.grad.numpy().copy() for p in params[s]] for s in params}
    if hook is not None:
        return losses, grads, hook.stats  # the manager's counts, taken when the list ended
    return losses, grads


_GROUPS = {}


def _groups(world):
    # one group per neighbouring pair for the whole process (the ring covers every placement)
    if world not in _GROUPS:
        _GROUPS[world] = PairGroups(list(range(world)), {(r, (r + 1) % world) for r in range(world)})
    return _GROUPS[world]


def rank_case(case):
    """One case on a rank of a verify launch (``verify.processes.launch.run_cases``: the process group is up,
    the rank forked from the warm torch-only server): ("ok", what ``run_rank`` returns) or ("err", its
    traceback), so that one failing case leaves the group to the next.
    ``case``: {"args": run_rank's arguments after rank and world, "schedules": the parent's}."""
    import traceback
    _SCHEDULES.update(case["schedules"])
    try:
        return "ok", run_rank(dist.get_rank(), dist.get_world_size(), *case["args"])
    except Exception:  # noqa: BLE001 - reported to the test
        return "err", traceback.format_exc()


def _lost_peer_worker(rank, port, q, mode="wait"):
    """Rank 0 exits (no teardown) while rank 1 waits for a message from it (mode "wait"), or after
    which rank 1 posts a receive from it ("post") or sends to it ("send"): rank 1 reports the error
    it got."""
    import time
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    p2p = P2P(_groups(2), rank, timeout_s=60)
    dist.barrier(group=p2p.groups.group(0, 1))  # the pair's connections are up
    if rank == 0:
        os._exit(0)
    if mode != "wait":
        time.sleep(1.0)  # rank 0 is gone and the connection broken before rank 1 touches it
    t0 = time.monotonic()
    try:
        if mode == "send":  # the first sends may still fit the socket's buffer
            for _ in range(200):
                p2p.send(torch.ones(MBS, H), 0, "the output of F1.0")
                p2p.reap_sends(block=True)
        else:
            p2p.recv((MBS, H), torch.float32, "cpu", 0, "the input of F1.0").wait()
        q.put(("no error", 0.0))
    except Exception as e:  # noqa: BLE001 - the test checks the type
        q.put((f"{type(e).__name__}: {e}", time.monotonic() - t0))
    q.close()
    q.join_thread()  # the queue's feeder thread has sent it before the hard exit
    os._exit(0)
