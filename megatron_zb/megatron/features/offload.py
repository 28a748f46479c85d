"""Megatron wiring of activation offload (docs/offload.md): this rank's offload manager, pointed at
the model's W queues, and ``--auto-offload-time``'s measurement of K. Functions that return what
they make; the forward-backward function keeps it.

The schedule with its OFFLOAD/RELOAD actions comes from ``core.build`` (the policy in
``core.passes.offload``); the executor reaches the manager through ``runtime.features.offload.OffloadHook``, and the
W queue reports the tensors its deferred weight-gradient closures keep, so they can travel between
B and W too.
"""
from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from ...core.costs.model import ModelSpec
from ...runtime.observe.measure import measure_host_link, measure_matmul
from ...runtime.features.offload import OffloadError, OffloadManager
from ..errors import ZeroBubbleConfigError

__all__ = ["make_manager", "point_manager", "measure_offload_time", "estimate_offload_time"]


def make_manager(options, device) -> OffloadManager:
    """This rank's offload manager for ``options`` (``megatron.execution.options.ScheduleOptions``)."""
    try:
        return OffloadManager(device, overlap=options.offload_overlap, cpu_test=options.offload_cpu_test,
                              min_elements=options.offload_min_elements)
    except OffloadError as e:
        raise ZeroBubbleConfigError(str(e)) from None


def point_manager(manager: OffloadManager, models, queues, chunk_of: Dict[int, int]) -> None:
    """Point ``manager`` at this call's W queues (what W needs between B and W) and tell it to
    leave the model's weights, and megatron DDP's contiguous parameter and gradient buffers, alone."""
    manager.w_tensors = lambda stage, mb: queues[chunk_of[stage]].held_tensors(mb)
    manager.ignore(p for m in models for p in m.parameters())
    for m in models:
        bufs = getattr(m, "buffers", None)  # (a plain module's .buffers is a method)
        for buf in bufs if isinstance(bufs, (list, tuple)) else []:
            for name in ("param_data", "grad_data"):
                t = getattr(buf, name, None)
                if isinstance(t, torch.Tensor):
                    manager.ignore([t])


def estimate_offload_time(layer: ModelSpec, device=None) -> dict:
    """K = one-way transfer time of one layer's activation / its F + B time, from this device's
    measured matmul speed and host-link bandwidth (not a table of GPU names). The layer's FLOPs
    and activation bytes follow the zero-bubble paper's counts (``layer``: the model's shape, its
    sequence length per context-parallel rank; its layer count is not read); per layer both scale
    alike, so the ratio holds for a whole stage. On a CPU both measurements are CPU stand-ins and say so."""
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    f, b, _ = layer.layer_flops()
    act, _ = layer.layer_activation_bytes()
    link = measure_host_link(device)
    mm = measure_matmul(device)
    compute_s = (f + b) / (mm["tflops"] * 1e12)
    transfer_s = 0.5 * (act / (link["d2h_gbps"] * 1e9) + act / (link["h2d_gbps"] * 1e9))
    return {"offload_time": transfer_s / compute_s, "activation_bytes_per_layer": act, "fb_flops_per_layer": f + b,
            "transfer_s": transfer_s, "compute_s": compute_s, "host_link": link, "matmul": mm}


def measure_offload_time(config, seq_length: int, micro_batch_size: int, tp_group, cp_group) -> dict:
    """--auto-offload-time: K measured on this rank and agreed with every rank (the largest: every
    rank must build the same schedule). Returns the estimate with ``offload_time`` the agreed K and
    ``offload_time_local`` this rank's own."""
    tp = tp_group.size() if tp_group is not None else 1
    cp = cp_group.size() if cp_group is not None else 1
    est = estimate_offload_time(ModelSpec(
        num_layers=1, hidden_size=int(config.hidden_size), num_attention_heads=int(config.num_attention_heads),
        seq_length=max(1, seq_length // cp), micro_batch_size=int(micro_batch_size),
        ffn_hidden_size=getattr(config, "ffn_hidden_size", None), tensor_parallel_size=int(tp),
        sequence_parallel=bool(getattr(config, "sequence_parallel", False)), flash_attention=torch.cuda.is_available()))
    if dist.is_available() and dist.is_initialized():
        nccl = torch.cuda.is_available() and "nccl" in str(dist.get_backend())
        k = torch.tensor([est["offload_time"]], dtype=torch.float64, device="cuda" if nccl else "cpu")
        dist.all_reduce(k, op=dist.ReduceOp.MAX)
    else:
        k = torch.tensor([est["offload_time"]], dtype=torch.float64)
    est["offload_time_local"] = est["offload_time"]
    est["offload_time"] = float(k.item())
    return est
