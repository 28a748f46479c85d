"""Several verify ranks on one GPU: NCCL refuses two ranks on one device, so CUDA ranks talk over
gloo. Gloo runs all_reduce, broadcast, all_gather and all_to_all on CUDA tensors itself (through
host copies), but its point-to-point messages read and write host memory only: here a CUDA
tensor's ``isend``/``send`` goes out from a host copy, and an ``irecv``/``recv`` lands in a host
buffer that is copied to the GPU tensor when the receive is waited on. What the pipeline runtime
sees is unchanged (``runtime.p2p`` calls ``dist.isend``/``dist.irecv`` and waits on the work).
Gloo's ``allreduce_coalesced`` takes host tensors only, and megatron-core's DDP reduces its grad
buckets under ``torch.distributed._coalescing_manager``, which calls it: on a gloo group with CUDA
tensors each tensor is all-reduced on its own instead (the same sums, done when the call returns).

``use_cuda()`` is what a verify rank with ``device="cuda"`` calls first; ``apply(stage_host=True)``
stages host tensors too (a CPU check of this path, ``MZB_VERIFY_STAGE_P2P=1``)."""
from __future__ import annotations

import functools
import os

__all__ = ["use_cuda", "apply", "STAGE_ENV"]

STAGE_ENV = "MZB_VERIFY_STAGE_P2P"  # "1": stage every message through a host copy (CPU check)


def use_cuda():
    """This rank's CUDA device (``LOCAL_RANK`` modulo the GPUs: ranks share a GPU when there are
    fewer), the point-to-point staging, and megatron-core's MoE adjustments for a machine without
    Transformer Engine. Returns the ``torch.device``."""
    import torch
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % max(1, torch.cuda.device_count()))
    apply()
    from ...megatron.cpu import cpu_moe
    cpu_moe.apply()  # split sizes as lists, 0.16's MoE names without TE: harmless with CUDA
    return torch.device("cuda", torch.cuda.current_device())


def _gloo(group) -> bool:
    import torch.distributed as dist
    try:
        return dist.get_backend(group) == "gloo"
    except (RuntimeError, ValueError):  # pragma: no cover - not a group torch knows
        return False


class _HostSend:
    """A send posted from a host copy: the copy lives as long as the work."""

    def __init__(self, work, host):
        self.work, self.host = work, host

    def wait(self, *args, **kwargs):
        return self.work.wait(*args, **kwargs)

    def is_completed(self):
        return self.work.is_completed()

    def __getattr__(self, name):
        return getattr(self.work, name)


class _Done:
    """The work of collectives that already ran when it was made."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


class _HostRecv(_HostSend):
    """A receive into a host buffer, copied into the caller's tensor once waited on."""

    def __init__(self, work, host, target):
        super().__init__(work, host)
        self.target, self.copied = target, False

    def wait(self, *args, **kwargs):
        out = self.work.wait(*args, **kwargs)
        if not self.copied:
            _fill(self.target, self.host)
            self.copied = True
        return out


def _fill(target, host) -> None:
    """The received bytes into the caller's tensor (a leaf that requires grad too: megatron's receive
    buffers are made with ``requires_grad=True``)."""
    import torch
    with torch.no_grad():
        target.copy_(host)


def apply(stage_host: bool = False) -> None:
    """Patch ``torch.distributed``'s isend/irecv/send/recv (once per process) to stage CUDA tensors
    (and, with ``stage_host``, host tensors too) through host copies on gloo groups, and gloo's
    ``allreduce_coalesced`` to reduce such tensors one by one."""
    import torch
    import torch.distributed as dist
    if getattr(dist.isend, "_mzb_staged", False):
        return
    stage_host = stage_host or os.environ.get(STAGE_ENV) == "1"

    def staged(t, group) -> bool:
        return (t.is_cuda or stage_host) and _gloo(group)

    def host_copy(t):
        return t.detach().to("cpu", copy=True).contiguous()

    def host_empty(t):
        return torch.empty(tuple(t.shape), dtype=t.dtype)

    orig_isend, orig_irecv, orig_send, orig_recv = dist.isend, dist.irecv, dist.send, dist.recv

    @functools.wraps(orig_isend)
    def isend(tensor, dst=None, group=None, tag=0, **kw):
        if not staged(tensor, group):
            return orig_isend(tensor, dst, group=group, tag=tag, **kw)
        host = host_copy(tensor)
        return _HostSend(orig_isend(host, dst, group=group, tag=tag, **kw), host)

    @functools.wraps(orig_irecv)
    def irecv(tensor, src=None, group=None, tag=0, **kw):
        if not staged(tensor, group):
            return orig_irecv(tensor, src, group=group, tag=tag, **kw)
        host = host_empty(tensor)
        return _HostRecv(orig_irecv(host, src, group=group, tag=tag, **kw), host, tensor)

    @functools.wraps(orig_send)
    def send(tensor, dst=None, group=None, tag=0, **kw):
        return orig_send(host_copy(tensor) if staged(tensor, group) else tensor, dst, group=group, tag=tag, **kw)

    @functools.wraps(orig_recv)
    def recv(tensor, src=None, group=None, tag=0, **kw):
        if not staged(tensor, group):
            return orig_recv(tensor, src, group=group, tag=tag, **kw)
        host = host_empty(tensor)
        out = orig_recv(host, src, group=group, tag=tag, **kw)
        _fill(tensor, host)
        return out

    orig_coalesced = dist.ProcessGroup.allreduce_coalesced

    @functools.wraps(orig_coalesced)
    def allreduce_coalesced(group, tensors, *args, **kw):
        if not (tensors and _gloo(group) and any(t.is_cuda or stage_host for t in tensors)):
            return orig_coalesced(group, tensors, *args, **kw)
        opts = args[0] if args else kw.get("opts")
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for t in tensors:
            dist.all_reduce(t, op=op, group=group)
        return _Done()

    for fn in (isend, irecv, send, recv):
        fn._mzb_staged = True
    dist.isend, dist.irecv, dist.send, dist.recv = isend, irecv, send, recv
    dist.ProcessGroup.allreduce_coalesced = allreduce_coalesced
