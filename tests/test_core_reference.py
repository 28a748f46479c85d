"""The simulator reproduces the product brief's public reference values exactly."""
import pytest

from megatron_zb.core.ir import Setting
from megatron_zb.core.schedules import generate
from megatron_zb.core.sim.simulate import simulate


def sim(name, p, m, **kw):
    st = Setting(p, m, **kw)
    return simulate(generate(name, st), st)


@pytest.mark.parametrize("name,makespan,bubble", [("1f1b", 33, 0.2727), ("zb-h1", 27, 0.1111), ("zb-h2", 24, 0.0)])
def test_p4_m8(name, makespan, bubble):
    r = sim(name, 4, 8)
    assert r.makespan == makespan
    assert round(r.bubble_rate, 4) == bubble


@pytest.mark.parametrize("name,bubble", [("1f1b", 0.3043), ("zb-h1", 0.1273), ("zb-h2", 0.0)])
def test_p8_m16(name, bubble):
    assert round(sim(name, 8, 16).bubble_rate, 4) == bubble


@pytest.mark.parametrize("name,bubble_time", [("1f1b", 12), ("zb-h1", 6), ("zb-h2", 3)])
def test_unequal_costs_bubble_time(name, bubble_time):
    r = sim(name, 4, 8, cost_f=1, cost_b=2, cost_w=1)
    assert r.makespan - 8 * (1 + 2 + 1) == bubble_time


def test_fewer_microbatches_than_stages():
    assert sim("1f1b", 4, 2).makespan == 15 == (2 + 4 - 1) * 3
    assert sim("zb-h1", 4, 2).makespan == 11 == (2 + 4 - 1) * 2 + 1
    assert sim("zb-h2", 4, 2).makespan == 11


def test_interleaved_bubble_over_ideal():
    r = sim("interleaved-1f1b", 4, 8, chunks=2)
    ideal = 8 * 3
    assert (r.makespan - ideal) / ideal == pytest.approx((4 - 1) / (2 * 8))
    assert r.to_dict()["bubble_over_ideal"] == pytest.approx(0.1875)


@pytest.mark.parametrize("name,claim", [("1f1b", lambda p: p), ("zb-h1", lambda p: p), ("zb-h2", lambda p: 2 * p - 1)])
@pytest.mark.parametrize("mem_w", [0.0, 0.3, 1.0])
def test_peak_activation_claims(name, claim, mem_w):
    for p in (2, 4, 8):
        r = sim(name, p, 4 * p, mem_w=mem_w)
        assert max(r.peak_memory) == pytest.approx(claim(p))
        assert r.peak_memory[0] == pytest.approx(claim(p))


def test_comm_is_charged_between_ranks_only():
    # 2 ranks, 1 microbatch, GPipe: F0 -> hop -> F1 -> BW1 -> hop -> BW0
    r = sim("gpipe", 2, 1, cost_comm=0.5)
    assert r.makespan == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)
    # V turn-around on rank p-1 is local: stages p-1 and p on the same rank
    r = sim("gpipe-v", 2, 1, cost_comm=0.5)
    # 4 stages, chunk cost 1/2: F hops 0->1 (0.5), 1->2 local, 2->3 (0.5); same for backward
    assert r.makespan == pytest.approx(4 * 0.5 + 2 * 0.5 + 4 * 1.0 + 2 * 0.5)


def test_per_stage_costs():
    # heavier first and last stage (embedding, loss): rank 0 and rank 3 cost more
    r = sim("1f1b", 4, 8, cost_f=[1.5, 1, 1, 1.5], cost_b=[1.5, 1, 1, 2], cost_w=1)
    assert r.busy[0] == pytest.approx(8 * (1.5 + 1.5 + 1))
    assert r.busy[3] == pytest.approx(8 * (1.5 + 2 + 1))
    assert r.makespan >= max(r.busy)
