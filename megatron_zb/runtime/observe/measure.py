"""What this device can do, measured (for ``--auto-offload-time``): the host link's copy bandwidth
and dense matmul throughput. On a CPU both are stand-ins and say so."""
from __future__ import annotations

import time
from typing import Optional

import torch

__all__ = ["measure_host_link", "measure_matmul"]


def measure_host_link(device, nbytes: Optional[int] = None, repeats: int = 5) -> dict:
    """One-way copy bandwidth between the device and (pinned) host memory, in GB/s (median).
    On a CPU this is a memcpy between two CPU tensors, and is labelled so."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    nbytes = nbytes or ((256 << 20) if cuda else (32 << 20))
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    d2h, h2d = [], []
    for _ in range(repeats):
        for out, fn in ((d2h, lambda: host.copy_(src, non_blocking=cuda)), (h2d, lambda: src.copy_(host, non_blocking=cuda))):
            if cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize(device)
            out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"d2h_gbps": med(d2h), "h2d_gbps": med(h2d), "bytes": nbytes,
            "what": "pinned host <-> GPU copies" if cuda else "CPU memcpy (no GPU: a stand-in, not a host link)"}


def measure_matmul(device, dtype=None, n: Optional[int] = None, repeats: int = 5) -> dict:
    """Dense matmul throughput in TFLOPS (median): bf16 n=8192 on a GPU, fp32 n=1024 on a CPU."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    dtype = dtype or (torch.bfloat16 if cuda else torch.float32)
    n = n or (8192 if cuda else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for _ in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    t = sorted(times[1:])[len(times[1:]) // 2]
    return {"tflops": 2.0 * n ** 3 / t / 1e12, "n": n, "dtype": str(dtype).replace("torch.", ""),
            "what": "GPU matmul" if cuda else "CPU matmul (no GPU: a stand-in)"}
