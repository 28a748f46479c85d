"""Megatron's optimizer CPU offload (``--optimizer-cpu-offload --optimizer-offload-fraction F``,
``megatron.core.optimizer.cpu_offloading.HybridDeviceOptimizer``) with megatron-zb.

Megatron splits each rank's optimizer parameters (its main parameters, or the distributed
optimizer's shards) in order: the first ``F`` of the elements on the GPU go to the host, where a
CPU copy of each parameter, its gradient's host copy and its Adam state live and a torch CPU
optimizer updates them; the rest stay with the GPU optimizer. After each CPU step the updated copy
goes back to the GPU parameter. megatron-zb's schedules leave all of this to Megatron; what this
module adds:

* ``use_cpu_as_device()``: on a CPU-only torch every tensor is a host tensor, so Megatron's split
  (``param.is_cuda``) would offload nothing. Here the parameters handed to a
  ``HybridDeviceOptimizer`` count as device parameters while it splits them, so the fraction, the
  CPU copies, the gradient copies, the per-parameter CPU optimizers and the copy back all run as on
  a GPU (host and "device" are the same memory; page-locking is skipped without a GPU). On a
  machine with CUDA it does nothing.
* ``offload_tensors(optimizer)``: what a post-validated step changes besides the main parameters
  and ``optimizer.state``: the CPU copies (and fp32 copies) of the parameters and the state of each
  sub-optimizer (keyed by those copies). ``features.optimizer`` saves and restores them so a
  rolled-back eager step leaves no trace on the host either.
* ``use_rank_shares(shares)``: ``--zero-bubble-optimizer-offload S0,S1,...`` (what ``megatron-zb
  plan --optimizer-offload`` prints; the core's ``optimizer_offload.auto_fractions``): each
  pipeline rank's ``HybridDeviceOptimizer`` takes its own share as ``offload_fraction``.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Tuple

import torch

__all__ = ["use_cpu_as_device", "is_hybrid", "offload_tensors", "sub_optimizers", "offloaded_numel", "use_rank_shares",
           "auto_shares"]

_PATCHED = False


def use_cpu_as_device() -> bool:
    """On a CPU-only torch, make ``HybridDeviceOptimizer`` split its parameters by the fraction as
    if they were on a GPU. Returns True if the adjustment is active (idempotent)."""
    global _PATCHED
    if torch.cuda.is_available():
        return False
    if _PATCHED:
        return True
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer as H
    cls = H.HybridDeviceOptimizer
    orig = cls._get_sub_optimizer_param_groups

    def split(self, offload_fraction):
        with _cpu_as_device():
            return orig(self, offload_fraction)
    split.__wrapped__ = orig
    cls._get_sub_optimizer_param_groups = split
    init = cls.__init__

    def unpinned(self, *a, **k):  # no page-locked memory without a GPU
        k["pin_cpu_grads"] = k["pin_cpu_params"] = False
        init(self, *a, **k)
    unpinned.__wrapped__ = init
    cls.__init__ = unpinned
    from megatron.core.optimizer import optimizer_config as C
    te_min = C.is_te_min_version

    def is_te_min_version(*a, **k):  # the precision-aware config asks; no TE is no version
        from megatron.core.utils import get_te_version
        return False if get_te_version() is None else te_min(*a, **k)
    C.is_te_min_version = is_te_min_version
    _PATCHED = True
    return True


@contextlib.contextmanager
def _cpu_as_device() -> Iterator[None]:
    """While Megatron splits: every tensor reports ``is_cuda`` (the CPU is the device here) except
    the host copies ``.cpu()`` makes and what is made from them (``detach``, ``clone``, ``float``:
    the fp32 copy of a bf16 host copy is a host tensor, updated by the CPU optimizer), and
    ``pin_memory()`` keeps the tensor (no GPU to page-lock for)."""
    host = {}
    base = torch._C.TensorBase

    def cpu(t, *a, **k):
        out = base.cpu(t, *a, **k)
        if out is t:  # already in host memory: a host copy is its own tensor
            out = base.clone(base.detach(t))
        host[id(out)] = out
        return out

    def derived(name):  # what is made from a host copy is in host memory too (its fp32 copy: .detach().clone().float())
        orig = getattr(base, name)

        def op(t, *a, **k):
            out = orig(t, *a, **k)
            if id(t) in host:
                host[id(out)] = out
            return out
        return op
    torch.Tensor.is_cuda = property(lambda t: id(t) not in host)
    torch.Tensor.cpu = cpu
    torch.Tensor.pin_memory = lambda t, *a, **k: t
    for name in ("detach", "clone", "float"):
        setattr(torch.Tensor, name, derived(name))
    try:
        yield
    finally:
        del torch.Tensor.is_cuda, torch.Tensor.pin_memory, torch.Tensor.cpu
        del torch.Tensor.detach, torch.Tensor.clone, torch.Tensor.float


def is_hybrid(opt) -> bool:
    try:
        from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer
    except ImportError:  # pragma: no cover - every supported megatron-core has it
        return False
    return isinstance(opt, HybridDeviceOptimizer)


def sub_optimizers(opt) -> List:
    """The torch optimizers that hold state: a ``HybridDeviceOptimizer``'s CPU and GPU ones, or
    the optimizer itself."""
    return list(opt.sub_optimizers) if is_hybrid(opt) else [opt]


def offload_tensors(opt) -> List[torch.Tensor]:
    """The parameter copies a ``HybridDeviceOptimizer`` steps besides its own parameters: the
    host copies of the offloaded ones and the fp32 copies (empty for another optimizer)."""
    if not is_hybrid(opt):
        return []
    return list(opt.gpu_params_map_cpu_copy.values()) + list(opt.param_to_fp32_param.values())


def offloaded_numel(opt) -> Tuple[int, int]:
    """(elements whose optimizer state lives on the host, all elements) of one optimizer."""
    total = sum(p.numel() for g in opt.param_groups for p in g["params"])
    if not is_hybrid(opt):
        return 0, total
    return sum(p.numel() for p in opt.gpu_params_map_cpu_copy), total


def use_rank_shares(shares: List[float]):
    """Every ``HybridDeviceOptimizer`` built from now on takes this pipeline rank's share as its
    ``offload_fraction`` (Megatron's ``--optimizer-offload-fraction``, one value for all ranks,
    is what it replaces). Returns a function that undoes it."""
    from megatron.core import parallel_state
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer as H
    cls = H.HybridDeviceOptimizer
    init = cls.__init__

    def per_rank(self, *a, **k):
        k["offload_fraction"] = float(shares[parallel_state.get_pipeline_model_parallel_rank()])
        if len(a) > 1:  # (params, offload_fraction, ...) given by position
            a = (a[0],) + a[2:]
        init(self, *a, **k)
    per_rank.__wrapped__ = init
    cls.__init__ = per_rank

    def undo():
        if cls.__init__ is per_rank:
            cls.__init__ = init
    return undo


def auto_shares(args, peaks: List[float], placement, budget_bytes: float) -> List[float]:
    """``--zero-bubble-optimizer-offload auto``: each pipeline rank's share from its own need
    (``core.optimizer.offload.auto_fractions``): its parameters (plan's model of the run: the layers
    split evenly, the embedding and the output layer where they sit) at 6 bytes that stay and 12
    (over the data-parallel ranks with the distributed optimizer) that may go, and the schedule's
    activation peak on the rank (``peaks``, in microbatch activations of the fullest rank).
    Raises ValueError where a rank does not fit even with every state on the host."""
    from ...core.optimizer.offload import ADAM_STATE_BYTES, RESIDENT_BYTES, auto_fractions
    from ..layout.model_args import memory_limit_in_microbatches, model_spec
    spec = model_spec(args)
    p = placement.num_ranks
    layers = sum(spec.params_per_layer(i) for i in range(spec.num_layers)) / p
    params = [layers] * p
    params[placement.rank_of(0)] += spec.embedding_params()
    params[placement.loss_rank] += spec.output_params()
    dp = int(getattr(args, "data_parallel_size", 1) or 1) if getattr(args, "use_distributed_optimizer", False) else 1
    unit = 1e9 / memory_limit_in_microbatches(1.0, args)  # bytes of one microbatch's activation
    shares = auto_fractions([n * ADAM_STATE_BYTES / dp for n in params], [n * RESIDENT_BYTES for n in params],
                            [x * unit for x in peaks], budget_bytes)
    if any(s is None for s in shares):
        bad = [r for r, s in enumerate(shares) if s is None]
        raise ValueError(f"--zero-bubble-optimizer-offload auto: pipeline rank(s) {bad} do not fit "
                         f"{budget_bytes / 2 ** 30:.1f} GiB even with every optimizer state on the host")
    return [float(s) for s in shares]
