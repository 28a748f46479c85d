"""The GPU check's ``trough`` section (``benchmarks/gpu_check.py``): the transfers and updates of
optimizer states visiting the GPU in the troughs (``--zero-bubble-optimizer-offload trough``),
measured with the runtime's own code (``runtime.features.optim_trough.TroughStates``) against what the
core's cost model assumes (``core.optimizer.offload.HostCosts``).

On the GPU: ``SUBGROUPS`` subgroups of Adam state (an fp32 parameter copy, ``exp_avg``,
``exp_avg_sq``: 12 bytes per parameter) in page-locked host memory:

* **prefetch** (H2D, side stream) of every subgroup alone: the host link's bandwidth one way;
* the same prefetch while the default stream runs matmuls: how much of the copy the compute hides
  (the trough plan starts prefetches while the rank's last passes run);
* **update** of one subgroup on the GPU (torch AdamW, fused, as the visiting update runs it) and on
  the CPU (the same, fused, on the host copy: the CPU subgroups' way), per parameter;
* **write-back** (D2H, the other side stream) of every subgroup; a staged write-back (post-
  validation) and a rollback;
* whether the GPU's update equals the CPU's bit for bit (it need not: the plan's exactness on a GPU
  is the same optimizer on the same values, its last bits the device's).

``--tiny`` runs the same on the CPU (host and device one memory) at tiny sizes."""
from __future__ import annotations

import time

import gpu_check_report as R

SUBGROUPS = 8
PARAMS_PER_SUBGROUP = 16 * 2 ** 20  # 192 MiB of state per subgroup, 1.5 GiB in all
TINY_PARAMS = 4096


def _adamw(p):
    """A fused AdamW of ``p`` with a gradient, stepped once (its state made), as the trough's
    update runs it (Megatron's CPU optimizer: torch's AdamW, fused)."""
    import torch
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True)
    p.grad = torch.full_like(p, 1e-3)
    opt.step()
    return opt


def trough(ctx) -> None:
    import torch
    from megatron_zb.core.optimizer.offload import HostCosts
    from megatron_zb.runtime.features.optim_trough import TroughStates
    gpu = ctx.device == "cuda"
    n = PARAMS_PER_SUBGROUP if gpu else TINY_PARAMS
    costs = HostCosts()
    state = 12 * n  # bytes of one subgroup's state
    ctx.plan.update(subgroups=SUBGROUPS, params_per_subgroup=n, state_bytes_per_subgroup=state,
                    function="runtime.features.optim_trough.TroughStates (prefetch, visit, write_back, release, rollback)",
                    cost_model={"link_gbps": costs.link_gbps, "gpu_update_gbps": costs.gpu_update_gbps,
                                "cpu_update_gbps": costs.cpu_update_gbps, "update_bytes": costs.update_bytes})
    predicted = {"link_GBps": costs.link_gbps, "gpu_update_ms": costs.gpu(n) * 1e3, "cpu_update_ms": costs.cpu(n) * 1e3}
    if not ctx.runs:
        ctx.row(f"H2D / D2H of {SUBGROUPS} subgroups x {state / 2 ** 20:.0f} MiB (pinned, side streams)", "(GPU run)",
                f"{costs.link_gbps:g} GB/s each way")
        ctx.row(f"Adam update of one subgroup ({n / 2 ** 20:.0f} Mi parameters): GPU / CPU", "(GPU run)",
                f"{R.ms(costs.gpu(n))} / {R.ms(costs.cpu(n))}")
        return
    ctx.need_cuda()
    dev = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")

    def sync():
        if gpu:
            torch.cuda.synchronize()

    # the host-resident subgroups: parameter copy, exp_avg, exp_avg_sq (page-locked on a GPU)
    groups = [[torch.randn(n, dtype=torch.float32, pin_memory=gpu) for _ in range(3)] for _ in range(SUBGROUPS)]
    states = TroughStates(dev)
    # prefetch alone
    sync()
    t0 = time.perf_counter()
    for k, g in enumerate(groups):
        states.prefetch(k, g)
    if gpu:
        states.h2d.synchronize()
    h2d_s = time.perf_counter() - t0
    for k, g in enumerate(groups):
        states.visit(k, g)
    sync()
    def write_back_all():  # every subgroup written back and released: the seconds it took
        t0 = time.perf_counter()
        for k, g in enumerate(groups):
            states.write_back(k, g)
        for k in range(SUBGROUPS):
            states.release(k)
        return time.perf_counter() - t0

    d2h_s = write_back_all()  # write-back alone
    total = SUBGROUPS * state
    # prefetch under compute: matmuls on the default stream, the copies on the side stream
    a = torch.randn(4096 if gpu else 64, 4096 if gpu else 64, device=dev, dtype=torch.bfloat16 if gpu else torch.float32)

    def compute(reps):
        for _ in range(reps):
            a @ a
    reps = 200 if gpu else 2
    compute(3)
    sync()
    t0 = time.perf_counter()
    compute(reps)
    sync()
    compute_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for k, g in enumerate(groups):
        states.prefetch(k, g)
    compute(reps)
    sync()
    if gpu:
        states.h2d.synchronize()
    both_s = time.perf_counter() - t0
    hidden = max(0.0, min(1.0, (compute_s + h2d_s - both_s) / h2d_s)) if h2d_s > 0 else None
    for k, g in enumerate(groups):
        states.visit(k, g)
    # one subgroup's update on the GPU and on the CPU (fused AdamW both), the same start values
    p0 = torch.randn(n, dtype=torch.float32)
    pg, pc = p0.clone().to(dev), p0.clone()
    og, oc = _adamw(pg), _adamw(pc)
    sync()
    t0 = time.perf_counter()
    for _ in range(3):
        og.step()
    sync()
    gpu_upd = (time.perf_counter() - t0) / 3
    t0 = time.perf_counter()
    for _ in range(3):
        oc.step()
    cpu_upd = (time.perf_counter() - t0) / 3
    diff = float((pg.cpu() - pc).abs().max())
    # post-validation: a staged write-back and its rollback
    states.staged = True
    staged_s = write_back_all()
    t0 = time.perf_counter()
    states.rollback()
    rollback_s = time.perf_counter() - t0
    link_h2d, link_d2h = total / h2d_s / 1e9, total / d2h_s / 1e9
    ctx.figures.update(h2d_s=h2d_s, d2h_s=d2h_s, h2d_GBps=link_h2d, d2h_GBps=link_d2h, compute_s=compute_s,
                       prefetch_under_compute_s=both_s, prefetch_hidden_share=hidden, gpu_update_s=gpu_upd,
                       cpu_update_s=cpu_upd, gpu_update_GBps=n * costs.update_bytes / gpu_upd / 1e9,
                       cpu_update_GBps=n * costs.update_bytes / cpu_upd / 1e9, gpu_vs_cpu_max_abs_diff=diff,
                       staged_write_back_s=staged_s, rollback_s=rollback_s, predicted=predicted, stats=states.stats)
    ctx.row(f"prefetch H2D, {SUBGROUPS} x {state / 2 ** 20:.0f} MiB", f"{link_h2d:.1f} GB/s", f"{costs.link_gbps:g} GB/s")
    ctx.row("write-back D2H", f"{link_d2h:.1f} GB/s (staged {total / staged_s / 1e9:.1f})", f"{costs.link_gbps:g} GB/s")
    ctx.row("prefetch hidden under matmuls", "-" if hidden is None else f"{hidden * 100:.0f}%",
            "all (the plan places it on the free link)")
    ctx.row(f"Adam update of {n / 2 ** 20:.2f} Mi parameters: GPU / CPU", f"{R.ms(gpu_upd)} / {R.ms(cpu_upd)}",
            f"{R.ms(costs.gpu(n))} / {R.ms(costs.cpu(n))}")
    ctx.row("GPU update vs CPU update, max abs difference", f"{diff:.3g}", "last bits at most")
    ctx.row("rollback (post-validation, no copy)", R.ms(rollback_s), "no copy: pointers back to the host copy")
    if states.stats["synchronous_visits"]:
        ctx.fail(f"{states.stats['synchronous_visits']} visit(s) copied at the step: the prefetch did not hold")
    if diff > 1e-5:
        ctx.fail(f"the GPU's Adam update differs from the CPU's by {diff:.3g}")
