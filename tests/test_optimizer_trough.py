"""Optimizer states in the troughs, the parts without a launch: the core's trough plan in a rank's
pass order (``core.optimizer.trough``) and the host-resident states' moves, commits and rollbacks
(``runtime.features.optim_trough``; host and device are one memory on a CPU-only torch, the copies real).
The run with Megatron's optimizer under every schedule is tests/test_optimizer_offload_megatron.py."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_zb.core.build import ScheduleRequest, build
from megatron_zb.core.ir import ScheduleError
from megatron_zb.core.optimizer.offload import HostCosts, RankShare, memory_curve
from megatron_zb.core.optimizer.trough import rank_trough_plan, split_evenly
from megatron_zb.runtime.features.optim_trough import TroughHook, TroughStates

MB = 1e6


def test_split_evenly_keeps_order_and_sizes():
    assert split_evenly([4, 4, 4, 4], 2) == [[0, 1], [2, 3]]
    assert split_evenly([5], 3) == [[0]]
    groups = split_evenly(list(range(1, 21)), 4)
    assert [i for g in groups for i in g] == list(range(20)) and len(groups) == 4
    with pytest.raises(ScheduleError):
        split_evenly([1], 0)


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v", "zb-h2"])
def test_plan_points_are_passes_of_the_rank(schedule):
    built = build(ScheduleRequest(schedule), 4, 8)
    res = built.result
    for r in range(4):
        tl = res.timeline[r]
        keys = [(t.action.kind, t.action.stage, t.action.mb) for t in tl]
        state = 16 * 12 * MB  # 16 subgroups of 12 MB, room for half of them at the end of the iteration
        peak = max(x for _, x in memory_curve(tl, r, built.setting))
        plan = rank_trough_plan(tl, built.setting, RankShare(r, state / 12, 0.0, 0.0, state / 2),
                                0.75 * state / 2 / peak, 1e-3, HostCosts(subgroups=16))
        assert 0 < len(plan.on_gpu) <= 8, plan.describe()  # the room decides
        for k in plan.on_gpu:
            assert plan.prefetch_after[k] is None or plan.prefetch_after[k] in keys
            assert plan.release_before[k] is None or plan.release_before[k] in keys
        # the trough opens as the activations fall: a prefetch after the rank's last F
        last_f = max(i for i, key in enumerate(keys) if key[0] == "F")
        assert any(plan.prefetch_after[k] is not None and keys.index(plan.prefetch_after[k]) > last_f
                   for k in plan.on_gpu), plan.describe()
        assert plan.first == keys[0]
    # no room at all: every subgroup on the CPU; room for everything: every subgroup visits
    tl = res.timeline[0]
    none = rank_trough_plan(tl, built.setting, RankShare(0, 1e6, 0.0, 0.0, 0.0), 1.0, 1e-3, HostCosts(subgroups=4))
    assert none.on_gpu == () and none.step.on_cpu == 4
    every = rank_trough_plan(tl, built.setting, RankShare(0, 1e6, 0.0, 0.0, math.inf), 1.0, 1e-3,
                             HostCosts(subgroups=4))
    assert len(every.on_gpu) == 4


def _group(n=3):
    return [torch.arange(6, dtype=torch.float32) + 10 * i for i in range(n)]


def test_visit_write_back_release_without_post_validation():
    s = TroughStates(torch.device("cpu"))
    ts = _group()
    homes = [t.data for t in ts]
    s.prefetch(0, ts)
    s.visit(0, ts)
    assert all(t.data.data_ptr() != h.data_ptr() for t, h in zip(ts, homes))  # on the "device" copy
    for t in ts:
        t.add_(1.0)  # the update
    s.write_back(0, ts)
    s.release(0)
    assert all(t.data.data_ptr() == h.data_ptr() for t, h in zip(ts, homes))  # home again, updated
    assert torch.equal(ts[0], torch.arange(6, dtype=torch.float32) + 1)
    assert s.stats["synchronous_visits"] == 0 and s.stats["bytes_h2d"] == s.stats["bytes_d2h"] == 3 * 24


def test_staged_write_back_rolls_back_from_the_untouched_host_copy():
    s = TroughStates(torch.device("cpu"), staged=True)
    ts = _group()
    before = [t.clone() for t in ts]
    s.visit(0, ts)  # no prefetch: copied at the step
    born = torch.zeros(4)  # state a first update creates on the device
    s.write_back(0, ts)  # a step that did nothing yet is written back ...
    for t in ts:
        t.add_(5.0)  # ... (values changed after the write-back are the device copy's)
    s.release(0)
    assert torch.equal(ts[1], before[1])  # the staged copy: the values written back
    s.visit(0, ts)
    for t in ts:
        t.mul_(2.0)
    s.write_back(0, ts + [born])
    s.release(0)
    assert torch.equal(ts[2], before[2] * 2)
    s.rollback()  # the step is not validated: the host copy from before it
    assert all(torch.equal(t, b) for t, b in zip(ts, before))
    assert id(born) not in s.managed()  # state the rolled-back step created is forgotten
    s.visit(0, ts)
    for t in ts:
        t.sub_(1.0)
    s.write_back(0, ts)
    s.commit()  # validated: the written-back values are the host copy now, the device copy stays
    s.rollback()  # a later rollback goes back to the committed values
    assert all(torch.equal(t, b - 1.0) for t, b in zip(ts, before))


def test_the_hook_prefetches_and_releases_at_the_plans_passes():
    class A:
        def __init__(self, kind, stage, mb):
            self.kind, self.stage, self.mb = kind, stage, mb
    s = TroughStates(torch.device("cpu"))
    ts = [_group(1), _group(2)]
    hook = TroughHook([(s, lambda k: ts[k], {0: ("W", 0, 3), 1: None}, {0: ("F", 0, 1), 1: ("F", 0, 0)},
                        ("F", 0, 0))])
    order = [A("F", 0, 0), A("F", 0, 1), A("B", 0, 0), A("W", 0, 3)]
    for step in range(2):
        for a in order:
            hook.begin(a)
            hook.end(a)
        for k in (0, 1):
            s.visit(k, ts[k])
            s.write_back(k, ts[k])
    assert s.stats["prefetched"] == 4 and s.stats["synchronous_visits"] == 0
    assert s.stats["released"] == 2  # the first step's, in the second iteration
