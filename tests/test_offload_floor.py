"""``offload_floor``: no offload the policy makes of a schedule peaks below it, on any rank, under a
memory limit or a ratio, over host links from fast to the bottleneck (the offload search and plan's
lever variants skip what it proves cannot fit)."""
import random

import pytest

from megatron_zb.core.build import ScheduleRequest, build
from megatron_zb.core.passes.offload import offload_simulated
from megatron_zb.core.passes.offload_floor import offload_floor
from megatron_zb.core.sim.hostlink import OffloadOptions


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "interleaved-1f1b", "zb-v", "v-half", "interleaved-zb"])
def test_no_offload_peaks_below_the_floor(name):
    rng = random.Random(name)
    p, m = 4, 12
    cf = [rng.uniform(0.8, 1.2) for _ in range(p)]
    req = ScheduleRequest(name, cost_f=cf, cost_b=[2 * x for x in cf], cost_w=cf, mem_f=[1.0] * p, mem_w=[0.5] * p)
    b = build(req, p, m)
    peak = max(b.result.peak_memory)
    for k in (0.2, 1.0, 2.0):
        for opts in [OffloadOptions(ratio=None, time=k, memory_limit=f * peak) for f in (0.3, 0.6, 0.9)] + \
                [OffloadOptions(ratio=1.0, time=k)]:
            floor = offload_floor(b.schedule, b.setting, opts)
            _, res = offload_simulated(b.schedule, b.setting, opts)
            assert floor is not None
            assert all(f <= x + 1e-9 for f, x in zip(floor, res.peak_memory)), (k, opts, floor, res.peak_memory)
