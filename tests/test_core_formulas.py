"""Closed-form bubbles and memory over a grid of p, m and costs; property tests on random settings."""
import itertools

import pytest
from hypothesis import given, settings, strategies as st

from megatron_zb.core.ir import BW, ScheduleError, Setting
from megatron_zb.core.schedules import generate, get, names
from megatron_zb.core.sim.simulate import simulate
from megatron_zb.core.sim.validate import validate

COSTS = [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 0.5), (1.5, 2, 0.75), (1, 3, 1)]


@pytest.mark.parametrize("p,costs", list(itertools.product([2, 3, 4, 6, 8], COSTS)))
def test_closed_form_bubbles(p, costs):
    f, b, w = costs
    for m in (2 * p - 1, 2 * p, 3 * p + 1):
        st = Setting(p, m, cost_f=f, cost_b=b, cost_w=w)
        ideal = m * (f + b + w)
        mk = {n: simulate(generate(n, st), st).makespan - ideal for n in ("1f1b", "zb-h1", "zb-h2")}
        assert mk["1f1b"] == pytest.approx((p - 1) * (f + b + w))
        assert mk["zb-h1"] == pytest.approx((p - 1) * (f + b - w))
        assert mk["zb-h2"] == pytest.approx((p - 1) * max(0.0, f + b - 2 * w))


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (4, 3), (8, 2), (3, 4)])
def test_interleaved_closed_form(p, v):
    for m in (p, 2 * p, 3 * p):
        st = Setting(p, m, chunks=v)
        r = simulate(generate("interleaved-1f1b", st), st)
        ideal = m * 3
        assert (r.makespan - ideal) / ideal == pytest.approx((p - 1) / (v * m))


def _claim(name, p, m):
    sched = generate(name, Setting(p, m))
    return sched.meta.get("memory_claim")


settings_strategy = st.fixed_dictionaries({
    "p": st.integers(1, 9),
    "m": st.integers(1, 24),
    "f": st.floats(0.1, 4), "b": st.floats(0.1, 4), "w": st.floats(0.0, 4),
    "comm": st.sampled_from([0.0, 0.0, 0.1, 0.5]),
    "mem_w": st.floats(0.0, 1.0),
    "chunks": st.integers(2, 4),
    "hetero": st.booleans(),
})


@settings(max_examples=120, deadline=None)
@given(settings_strategy, st.sampled_from(names()))
def test_every_schedule_valid_deadlock_free_within_claim(s, name):
    p, m = s["p"], s["m"]
    cf = [s["f"] * (1.5 if s["hetero"] and r in (0, p - 1) else 1) for r in range(p)]
    spec = get(name)
    chunks = s["chunks"] if spec.chunks is None else spec.chunks
    setting = Setting(p, m, chunks=chunks, cost_f=cf, cost_b=s["b"], cost_w=s["w"], cost_comm=s["comm"],
                      mem_w=s["mem_w"])
    try:
        sched = generate(name, setting)
    except ScheduleError as e:  # only where Megatron's interleaved order deadlocks (Megatron refuses too)
        if name == "bitpipe":  # two directions pair rank r with p-1-r; microbatches in units of p
            assert p % 2 or m % p, str(e)
            return
        if name == "interleaved-zb":  # torch's rule: m splits into max(1, m // p) equal rounds
            assert m % max(1, m // p), str(e)
            return
        assert name == "interleaved-1f1b" and m > p and 0 < m % p < p and "deadlocks" in str(e), str(e)
        return
    setting = Setting(**{**setting.to_dict(), "chunks": sched.placement.chunks})
    validate(sched, setting)  # complete, placed right, no deadlock
    res = simulate(sched, setting)
    assert res.makespan >= max(res.busy) - 1e-9
    assert 0.0 <= res.bubble_rate < 1.0
    claim = sched.meta.get("memory_claim")
    if claim is not None:
        assert max(res.peak_memory) <= claim + 1e-9
    if not spec.split_backward:
        assert all(a.kind in ("F", BW) for o in sched.orders for a in o)
