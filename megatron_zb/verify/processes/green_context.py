"""A share of one GPU's SMs for a pipeline rank that shares the GPU with the others: torch's CUDA
green contexts (``torch.cuda.green_contexts.GreenContext``, torch >= 2.10, a CUDA 12.8+ build and
driver), and a probe of what the share does (the GPU check's ``realpipe`` section,
``megatron_zb.verify.timing.realpipe``).

``GreenShare.enter(p)`` creates a green context of 1/p of the device's SMs (rounded down to the
partition granularity of the architecture) and makes it current for this thread: torch then runs
this thread's kernels on the context's own stream, on those SMs. The autograd engine would run a
backward's CUDA work on its own device thread, where the green context is not current (its kernels
would use every SM): ``single_threaded_backward()`` keeps the backward on the calling thread.

What the API gives and what it does not (written down, then measured by ``probe``):

* ``GreenContext.create`` splits the device's SMs and takes the first group: every process that
  calls it gets the same SMs. Processes of one GPU without MPS time-slice the GPU anyway (one
  context runs at a time), so whether P ranks in green contexts run at once is measured, not
  assumed: ``probe`` times a matmul workload per rank alone, then on every rank at once
  (``concurrency``: the sum of the ranks' times alone over the longest time together; P when the
  ranks ran at once, 1 when they took turns).
* ``api_problem()`` says, without touching CUDA, what this torch lacks; ``GreenShare.enter`` raises
  ``GreenContextUnavailable`` with one line when creating or entering one fails (driver too old,
  no device, a build without the driver API)."""
from __future__ import annotations

import contextlib
import importlib
import time
from typing import Optional

__all__ = ["GreenContextUnavailable", "GreenShare", "api_problem", "sm_share", "single_threaded_backward", "probe"]


class GreenContextUnavailable(RuntimeError):
    """Green contexts cannot be used here: the one line says what is missing."""


def api_problem() -> Optional[str]:
    """What this torch lacks for green contexts (None: the API is there; creating one may still fail)."""
    import torch
    try:
        mod = importlib.import_module("torch.cuda.green_contexts")
    except ImportError:
        return f"torch {torch.__version__} has no torch.cuda.green_contexts (torch >= 2.10 has it)"
    cls = getattr(mod, "GreenContext", None)
    if cls is None or not hasattr(cls, "create"):
        return f"torch {torch.__version__}'s torch.cuda.green_contexts has no GreenContext.create"
    if not getattr(mod, "SUPPORTED", True):
        return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) was built without green-context support "
                "(a CUDA 12.8+ build has it)")
    if not (hasattr(cls, "set_context") or hasattr(cls, "make_current")):
        return f"torch {torch.__version__}'s GreenContext can not be made current (no set_context)"
    return None


def sm_share(total_sms: int, p: int, major: int) -> int:
    """SMs per rank: 1/p of the device, down to the SM-partition granularity (8 on compute capability 9+,
    2 before); at least one granule."""
    if total_sms < 1 or p < 1:
        raise ValueError(f"need SMs and ranks, got {total_sms} SMs for {p} ranks")
    step = 8 if major >= 9 else 2
    return max(step, (total_sms // p) // step * step)


class GreenShare:
    """This thread's kernels on a green context of ``num_sms`` of the device's ``total_sms`` SMs."""

    def __init__(self, ctx, num_sms: int, total_sms: int, device_index: int):
        self.ctx, self.num_sms, self.total_sms, self.device_index = ctx, num_sms, total_sms, device_index
        self.active = False

    @classmethod
    def enter(cls, p: int, device_index: Optional[int] = None) -> "GreenShare":
        """Create a green context of 1/p of the SMs and make it current; ``GreenContextUnavailable``
        (one line) where that cannot be done."""
        import torch
        problem = api_problem()
        if problem is None and not torch.cuda.is_available():
            problem = "no CUDA device"
        if problem is not None:
            raise GreenContextUnavailable(problem)
        from torch.cuda.green_contexts import GreenContext
        dev = torch.cuda.current_device() if device_index is None else int(device_index)
        props = torch.cuda.get_device_properties(dev)
        total = int(props.multi_processor_count)
        n = sm_share(total, p, int(props.major))
        torch.cuda.synchronize(dev)  # the primary context exists and is idle
        try:
            ctx = GreenContext.create(num_sms=n, device_id=dev)
        except Exception as e:  # noqa: BLE001 - what the driver or torch said, in one line
            raise GreenContextUnavailable(f"creating a green context of {n} of {total} SMs failed (torch "
                                          f"{torch.__version__}, CUDA {torch.version.cuda}): "
                                          f"{_first_line(e)}") from None
        share = cls(ctx, n, total, dev)
        try:
            (ctx.set_context if hasattr(ctx, "set_context") else ctx.make_current)()
        except Exception as e:  # noqa: BLE001
            raise GreenContextUnavailable(f"making the green context current failed: {_first_line(e)}") from None
        share.active = True
        return share

    def exit(self) -> None:
        """Back to the primary context (after this context's work is done)."""
        if not self.active:
            return
        import torch
        torch.cuda.synchronize(self.device_index)
        (self.ctx.pop_context if hasattr(self.ctx, "pop_context") else self.ctx.pop_current)()
        self.active = False

    def describe(self) -> dict:
        return {"num_sms": self.num_sms, "total_sms": self.total_sms, "device": self.device_index}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


@contextlib.contextmanager
def single_threaded_backward():
    """Backwards run on the calling thread (where its green context is current), not on autograd's
    device threads."""
    import torch
    with torch.autograd.set_multithreading_enabled(False):
        yield


def _sync(cuda: bool) -> None:
    if cuda:
        import torch
        torch.cuda.synchronize()


def _workload(x, w, reps: int, cuda: bool):
    """(forward seconds, backward seconds): ``reps`` matmuls, then their backward (2 x reps matmuls)."""
    _sync(cuda)
    t0 = time.perf_counter()
    ys = [x @ w for _ in range(reps)]
    _sync(cuda)
    t1 = time.perf_counter()
    sum(y.float().sum() for y in ys).backward()
    _sync(cuda)
    return t1 - t0, time.perf_counter() - t1


def probe(n: int, reps: int, *, device, share: Optional[GreenShare] = None, whole_gpu: bool = False,
          full_fwd_s: Optional[float] = None) -> dict:
    """Every rank of the world: matmuls of n x n (bf16 on a GPU) alone, one rank after the other, then
    all ranks at once. ``whole_gpu``: only rank 0 times them (call it before the green context is
    entered), its ``full_fwd_s`` then given to the call in the share. Returns this rank's seconds;
    rank 0's dict also holds every rank's and the summary (``concurrency``, ``share_speed``,
    ``backward_ratio``)."""
    import torch
    import torch.distributed as dist
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device="cpu").manual_seed(7)
    x = torch.randn(n, n, generator=g, dtype=torch.float32).to(device=device, dtype=dtype).requires_grad_(True)
    w = torch.randn(n, n, generator=g, dtype=torch.float32).to(device=device, dtype=dtype).requires_grad_(True)
    rank, world = dist.get_rank(), dist.get_world_size()
    _workload(x, w, 1, cuda)  # kernels chosen and loaded
    out = {"n": n, "reps": reps, "dtype": str(dtype).replace("torch.", "")}
    if whole_gpu:
        if rank == 0:
            out["full_fwd_s"], out["full_bwd_s"] = _workload(x, w, reps, cuda)
        dist.barrier()
        return out
    alone = (0.0, 0.0)
    for r in range(world):
        dist.barrier()
        if r == rank:
            alone = _workload(x, w, reps, cuda)
    dist.barrier()
    together = _workload(x, w, reps, cuda)
    every = [None] * world
    dist.all_gather_object(every, {"alone": alone, "together": together})
    out.update(alone_fwd_s=alone[0], alone_bwd_s=alone[1], together_fwd_s=together[0], together_bwd_s=together[1])
    if rank == 0:
        out["ranks"] = every
        out.update(summarize(every, full_fwd_s), full_fwd_s=full_fwd_s)
        if share is not None:
            out["green"] = share.describe()
    return out


def summarize(every, full_fwd_s: Optional[float] = None) -> dict:
    """``concurrency``: the ranks' forward+backward times alone, summed, over the longest time with every
    rank at once (P: they ran at once, 1: one after the other); ``backward_ratio``: a backward matmul's
    time over a forward one's, alone (about 1 when both ran in the share; about the share when the
    backward left it); ``share_speed``: rank 0's forward on the whole GPU over in its share."""
    alone = [sum(e["alone"]) for e in every]
    together = max(sum(e["together"]) for e in every)
    f0, b0 = every[0]["alone"]
    out = {"concurrency": (sum(alone) / together) if together > 0 else None,
           "backward_ratio": (b0 / (2 * f0)) if f0 > 0 else None}
    if full_fwd_s is not None and f0 > 0:
        out["share_speed"] = full_fwd_s / f0
    return out
