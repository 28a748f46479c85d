"""One gloo transport device per process (``megatron_zb.megatron.cpu.gloo_device``, applied with
the CPU shims): Megatron's few dozen groups per rank would otherwise each run a loop thread that
wakes a hundred times a second."""
from __future__ import annotations

import os

import pytest


def _loop_threads() -> int:
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += f.read().strip() == "gloo_tcp_loop"
        except OSError:  # the thread ended
            pass
    return n


def groups_and_threads(share):
    """Rank code: five more groups over both ranks, one all-reduce on the fourth."""
    import torch
    import torch.distributed as dist
    if share:
        from megatron_zb.megatron.cpu import gloo_device
        gloo_device.apply()
    before = _loop_threads()
    groups = [dist.new_group([0, 1], backend="gloo") for _ in range(5)]
    x = torch.full((3,), dist.get_rank() + 1.0)
    dist.all_reduce(x, group=groups[3])
    return before, _loop_threads(), x.tolist()


@pytest.mark.dist
def test_groups_share_one_loop_thread_and_still_reduce():
    from megatron_zb.verify.processes.launch import LaunchOptions, run_cases
    # torch's default first (the patch, once applied, stays for the rank's life)
    own, shared = run_cases(groups_and_threads, [False, True], 2, LaunchOptions(cpu_shims=False, timeout=120))
    for before, after, x in own:  # a device, and its thread, per group
        assert x == [3.0] * 3 and after >= before + 5, (before, after)
    for before, after, x in shared:  # one device for the five
        assert x == [3.0] * 3 and after == before + 1, (before, after)
