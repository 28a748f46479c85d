"""Variable-length batches in the schedule core: per-microbatch costs in the setting and the
simulator, the length cost model and its fit, the balancer, the list scheduler, the per-batch
planner (Megatron's sequential path and the balanced one) and the lengths file. No torch."""
from __future__ import annotations

import dataclasses
import math
import random

import pytest

from megatron_zb.core.varlen.balance import karmarkar_karp, microbatches, refine, sequential, split_replicas
from megatron_zb.core.build import ScheduleRequest, build
from megatron_zb.core.ir import B, BW, F, W, ScheduleError, Setting
from megatron_zb.core.varlen.mb_schedule import end_time, list_schedule, per_microbatch, template_caps, within
from megatron_zb.core.costs.microbatch_costs import LengthModel, MicrobatchCosts, fit, fit_stages, microbatch_shape
from megatron_zb.core.varlen.seqlens import format_seq_lengths, parse_seq_lengths
from megatron_zb.core.sim.simulate import simulate
from megatron_zb.core.sim.validate import validate
from megatron_zb.core.varlen.batch import Templates, VarlenConfig, plan_batch

H100 = dict(cost_f=[43.8], cost_b=[59.2], cost_w=[32.0])


def _lengths(n, seed=0, median=700, sigma=1.0, top=8192):
    rng = random.Random(seed)
    return [max(16, min(top, int(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def _costs(lens, model=None):
    return (model or LengthModel.simple(4096, attention=0.2)).costs([[s] for s in lens])


# -- the setting and the simulator --------------------------------------------------------------

def test_pass_cost_scales_per_microbatch_and_stays_put_without_mb():
    mc = MicrobatchCosts({F: [1.0, 2.0], B: [1.0, 3.0], W: [1.0, 0.5], "tokens": [1.0, 2.0], "mem": [1.0, 2.0]})
    st = Setting(2, 2, cost_f=[2.0], cost_b=[4.0], cost_w=[1.0], cost_a2a=[1.0], microbatch_costs=mc)
    assert st.pass_cost(F, 0, 0) == 3.0  # no microbatch: the reference one (compute + all-to-all)
    assert st.pass_cost(F, 0, 0, 1) == 2.0 * 2.0 + 1.0 * 2.0
    assert st.pass_cost(B, 1, 1, 1) == 4.0 * 3.0 + 2.0
    assert st.pass_cost(W, 1, 1, 1) == 0.5
    assert st.pass_cost(BW, 1, 1, 1) == 4.0 * 3.0 + 1.0 * 0.5 + 2.0
    assert st.pass_mem(F, 0, 0, 1) == 2.0 and st.pass_mem(B, 0, 0, 1) == -1.0 and st.pass_mem(W, 0, 0, 1) == -1.0
    with pytest.raises(ScheduleError, match="2 microbatches, but the setting has 3"):
        Setting(2, 3, microbatch_costs=mc)


def test_simulator_times_each_microbatch_with_its_own_cost():
    # 1F1B, P=2, M=2, F=B=W=1 per stage, microbatch 1 three times as long as microbatch 0
    mc = MicrobatchCosts({k: [1.0, 3.0] for k in (F, B, W, "tokens", "mem")})
    sched = build(ScheduleRequest("1f1b"), 2, 2).schedule
    res = simulate(sched, Setting(2, 2, microbatch_costs=mc))
    # rank 0: F0 [0,1] F1 [1,4]; rank 1: F0 [1,2] BW0 [2,4] F1 [4,7] BW1 [7,13]; rank 0: BW0 [4,6] BW1 [13,19]
    assert res.makespan == 19.0
    assert res.peak_memory == [4.0, 3.0]


# -- the length model ---------------------------------------------------------------------------

def test_length_model_factors_and_shapes():
    m = LengthModel.simple(1000, attention=0.3, overhead=0.1)
    assert m.factor(F, 1000, 1000 ** 2) == pytest.approx(1.0)
    assert m.factor(W, 1000, 1000 ** 2) == pytest.approx(1.0)
    assert m.factor(F, 500, 500 ** 2) == pytest.approx(0.1 + 0.6 * 0.5 + 0.3 * 0.25)
    assert microbatch_shape([100, 300], packed=True) == (400, 100 ** 2 + 300 ** 2)
    assert microbatch_shape([100, 300], packed=False) == (600, 2 * 300 ** 2)
    mc = m.costs([[1000], [250, 250]], packed=True)
    assert mc.factor("mem", 1) == 0.5 and mc.factor(W, 1) == pytest.approx(0.1 + 0.9 * 0.5)
    with pytest.raises(ScheduleError, match="W has no attention"):
        LengthModel(1000, {W: 0.1})
    with pytest.raises(ScheduleError, match="more than the whole pass"):
        LengthModel.simple(1000, attention=0.8, overhead=0.3)


def test_fit_recovers_the_linear_and_attention_terms():
    c = {F: (2e-3, 1e-5, 3e-9), B: (4e-3, 2e-5, 6e-9), W: (1e-3, 1.5e-5, 0.0)}
    samples = {k: [(s, s * s, c0 + c1 * s + c2 * s * s) for s in (256, 1024, 2048, 4096, 8192)]
               for k, (c0, c1, c2) in c.items()}
    model, ref = fit(samples, 4096)
    for k, (c0, c1, c2) in c.items():
        t = c0 + c1 * 4096 + c2 * 4096 ** 2
        assert ref[k] == pytest.approx(t, rel=1e-9)
        assert model.attention.get(k, 0.0) == pytest.approx(c2 * 4096 ** 2 / t, abs=1e-9)
        assert model.overhead.get(k, 0.0) == pytest.approx(c0 / t, abs=1e-9)
        for s in (300, 5000):  # the model predicts other lengths
            assert ref[k] * model.factor(k, s, s * s) == pytest.approx(c0 + c1 * s + c2 * s * s, rel=1e-9)


def test_fit_stages_takes_a_whole_pipeline_and_needs_several_lengths():
    """Per stage the reference times of its own fit; the shares those of the stages' sum (a profile
    window's passes of padded microbatches, rows x longest); one length only: no fit."""
    c = {F: (1e-3, 1e-5, 2e-9), B: (2e-3, 2e-5, 5e-9), W: (5e-4, 1e-5, 0.0)}
    scale = (1.0, 1.5)  # stage 1 is half as dear again
    shapes = [microbatch_shape([s] * n, packed=False) for s, n in ((64, 1), (256, 2), (1024, 1), (700, 3), (2048, 1))]
    samples = {k: {st: [(t, q, x * (c0 + c1 * t + c2 * q)) for t, q in shapes] for st, x in enumerate(scale)}
               for k, (c0, c1, c2) in c.items()}
    model, ref = fit_stages(samples, 1024)
    for k, (c0, c1, c2) in c.items():
        t = c0 + c1 * 1024 + c2 * 1024 ** 2
        assert ref[k] == pytest.approx([t * x for x in scale], rel=1e-9)
        assert model.attention.get(k, 0.0) == pytest.approx(c2 * 1024 ** 2 / t, abs=1e-9)
        assert model.overhead.get(k, 0.0) == pytest.approx(c0 / t, abs=1e-9)
    one = {k: {0: [(512, 512 ** 2, 1.0)] * 4} for k in (F, B, W)}
    assert fit_stages(one, 1024) is None


# -- the balancer -------------------------------------------------------------------------------

def test_karmarkar_karp_and_refine():
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2)
    assert sorted(i for p in parts for i in p) == list(range(5))
    assert sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts) == [14, 16]  # the method's known answer
    costs = [8, 7, 6, 5, 4]
    better = refine(parts, costs)
    assert sorted(sum(costs[i] for i in p) for p in better) == [15, 15]  # the optimum, by one swap
    rng = random.Random(3)
    costs = [rng.lognormvariate(0, 1) for _ in range(200)]
    parts = split_replicas(costs, 4)
    sums = [sum(costs[i] for i in p) for p in parts]
    assert max(sums) - min(sums) < 0.01 * sum(sums) / 4
    assert sorted(i for p in parts for i in p) == list(range(200))


def test_refine_keeps_work_away_from_a_long_sequence():
    costs = [10.0] + [1.0] * 20
    extra = [70.0] + [7.0] * 20  # the pipeline fill/drain of each: the long one's dominates its replica
    plain = split_replicas(costs, 2)
    aware = split_replicas(costs, 2, extra)
    holder = next(p for p in aware if 0 in p)
    assert len(holder) < len(next(p for p in plain if 0 in p))
    t = [sum(costs[i] for i in p) + max(extra[i] for i in p) for p in aware]
    assert max(t) <= 10.0 + 70.0 + 1.0 + 1e-9


def test_sequential_is_megatrons_sampler_order():
    assert sequential(8, 2, 2) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    with pytest.raises(ScheduleError, match="multiple of 4"):
        sequential(10, 2, 2)


def test_microbatches_padded_and_packed():
    lengths = [100, 900, 120, 880, 500, 40]
    padded = microbatches(range(6), lengths, packed=False, micro_batch_size=2)
    assert padded == [[1, 3], [4, 2], [0, 5]]  # similar lengths together
    packed = microbatches(range(6), lengths, packed=True, max_tokens=1000, estimate=len)
    assert sorted(i for mb in packed for i in mb) == list(range(6))
    assert all(sum(lengths[i] for i in mb) <= 1000 for mb in packed) and len(packed) == 3


# -- schedules ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v", "gpipe-v"])
def test_end_time_is_the_simulators(name):
    b = build(ScheduleRequest(name, cost_comm=0.7, cost_a2a=[2.0], **H100), 4, 12, enforce_limit=False)
    st = dataclasses.replace(b.setting, microbatch_costs=_costs(_lengths(12, seed=5)))
    res = simulate(b.schedule, st)
    assert end_time(b.schedule, st) == max(tl[-1].end for tl in res.timeline)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "interleaved-1f1b"])
def test_list_schedule_is_valid_in_order_and_within_the_templates_memory(name):
    m = 16
    b = build(ScheduleRequest(name, cost_comm=0.3, **H100), 4, m, enforce_limit=False)
    st = dataclasses.replace(b.setting, microbatch_costs=_costs(_lengths(m, seed=2)))
    caps = template_caps(b.schedule, b.setting)
    sched, end = list_schedule(name, b.schedule.placement, st, caps, split=b.schedule.uses_split_backward())
    res = validate(sched, st, memory_limit=float("inf"))
    assert end == max(tl[-1].end for tl in res.timeline)
    from megatron_zb.core.sim.simulate import peak_memory
    unit, top = dataclasses.replace(st, microbatch_costs=None), max(st.microbatch_costs.factors["mem"])
    for r, o in enumerate(sched.orders):  # each microbatch's activation its own size: never above the template's
        # peak with every one the reference, but where one microbatch alone is larger
        alone = top * sum(unit.pass_mem(F, r, s) for s in b.schedule.placement.stages_of(r))
        assert peak_memory(o, r, st) <= max(caps[r], alone) + 1e-9
        for s in b.schedule.placement.stages_of(r):  # each stage's forwards in microbatch order (data iterators)
            assert [a.mb for a in o if a.kind == F and a.stage == s] == list(range(m))
    best, t = per_microbatch(st, caps, template=b.schedule)
    kept = [end] + ([end_time(b.schedule, st)] if within(b.schedule, st, caps) else [])
    assert t <= min(kept) + 1e-9  # the template only where it keeps within the caps


def test_balanced_replicas_keep_within_an_activation_limit():
    """VarlenConfig.activation_limit (plan: the GPU's memory less the model states) bounds every
    balanced replica's activations, pending W's included, but where one microbatch alone is more."""
    lengths = _lengths(64, seed=3, median=1500)
    req = ScheduleRequest("zb-h1", **H100)
    limit = (3.0, 2.5, 2.0, 1.5)
    cfg = VarlenConfig(replicas=2, model=LengthModel.simple(4096, attention=0.15), activation_limit=limit)
    plan = plan_batch(lengths, req, 4, cfg, True)
    for rp in plan.replicas:
        top = max(rp.setting.microbatch_costs.factors["mem"])
        for r, o in enumerate(rp.schedule.orders):
            from megatron_zb.core.sim.simulate import peak_memory
            assert peak_memory([a for a in o if a.is_compute], r, rp.setting) <= max(limit[r], top) + 1e-9


def test_list_schedule_matches_the_templates_at_equal_costs():
    for name in ("zb-h1", "zb-v"):
        b = build(ScheduleRequest(name), 4, 8)
        st = dataclasses.replace(b.setting, microbatch_costs=_costs([4096] * 8))
        sched, end = list_schedule(name, b.schedule.placement, st, template_caps(b.schedule, b.setting))
        assert end == pytest.approx(end_time(b.schedule, st))


# -- the planner --------------------------------------------------------------------------------

def test_plan_batch_balanced_beats_megatrons_order_and_keeps_every_sequence():
    lengths = _lengths(64, seed=11)
    cfg = VarlenConfig(replicas=2, model=LengthModel.simple(4096, attention=0.15))
    times = {}
    for name in ("1f1b", "zb-h1"):
        req = ScheduleRequest(name, **H100)
        tp = Templates(req, 4, 32)
        for balanced in (False, True):
            plan = plan_batch(lengths, req, 4, cfg, balanced, tp)
            seen = sorted(i for r in plan.replicas for mb in r.microbatches for i in mb)
            assert seen == list(range(64))
            for r in plan.replicas:
                validate(r.schedule, r.setting, memory_limit=float("inf"))
                assert r.end == pytest.approx(end_time(r.schedule, r.setting))
            times[(name, balanced)] = plan.iteration_time
    assert times[("zb-h1", True)] < times[("zb-h1", False)] < times[("1f1b", False)]
    assert times[("1f1b", True)] < times[("1f1b", False)]


def test_plan_batch_lets_replicas_run_different_microbatch_counts():
    lengths = [8000] + [300] * 31
    cfg = VarlenConfig(replicas=2, model=LengthModel.simple(8000, attention=0.2))
    plan = plan_batch(lengths, ScheduleRequest("zb-h1", **H100), 4, cfg, True)
    counts = sorted(r.num_microbatches for r in plan.replicas)
    assert counts[0] < counts[1]
    holder = next(r for r in plan.replicas if any(0 in mb for mb in r.microbatches))
    assert holder.num_microbatches == counts[0]


def test_plan_batch_refuses_what_it_does_not_model():
    cfg = VarlenConfig(replicas=2, model=LengthModel.simple(100))
    with pytest.raises(ScheduleError, match="multiple of 2"):
        plan_batch([10, 20, 30], ScheduleRequest("1f1b"), 2, cfg, False)
    with pytest.raises(ScheduleError, match="integers >= 1"):
        plan_batch([10, 0], ScheduleRequest("1f1b"), 2, cfg, True)


def test_lengths_file():
    text = "# lengths\n12\n7\n\n\n3\n 5 \n"
    assert parse_seq_lengths(text) == [[12, 7], [3, 5]]
    assert parse_seq_lengths(format_seq_lengths([[12, 7], [3, 5]])) == [[12, 7], [3, 5]]
    with pytest.raises(ScheduleError, match="line 2: 'x7' is not a sequence length"):
        parse_seq_lengths("12\nx7\n")
    with pytest.raises(ScheduleError, match="no sequence lengths"):
        parse_seq_lengths("# nothing\n\n")
