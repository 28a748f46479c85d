"""A guard for restructuring (issue 54): every schedule's order, simulated times and peak memory on
bench_schedules' settings and the ZB paper's Table-5 1.5B cell, and plan's JSON rows for the
Llama-3-8B shape of bench_plan_speed (P=8) and Llama-3.2-1B (P=4, post-validated), are what
tests/data/golden.json records, byte for byte. ``MZB_GOLDEN_WRITE=1`` records them anew (only where a
change of behaviour is meant to change them: say so in the commit)."""
import dataclasses
import hashlib
import json
import os

import pytest

from megatron_zb.core import plan as P
from megatron_zb.core.build import ScheduleRequest, build
from megatron_zb.core.sim.iteration import iteration_times
from megatron_zb.core.costs.model import ModelSpec
from megatron_zb.core.schedules import get, names

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "golden.json")

SETTINGS = {
    "P=4 M=16 unit": dict(p=4, m=16),
    "P=8 M=32 F=1 B=1.1 W=0.9 comm 0.05": dict(p=8, m=32, cost_f=[1], cost_b=[1.1], cost_w=[0.9], cost_comm=0.05),
    "P=8 M=32 heavy loss stage": dict(p=8, m=32, cost_f=[1.2] + [1] * 6 + [1.5], cost_b=[1.2] + [1] * 6 + [1.8],
                                      cost_w=[0.9] * 8, cost_comm=0.05, mem_w=[0.6] * 8),
    "P=8 M=32 H100 layer, fused backward dearer": dict(p=8, m=32, cost_f=[43.8], cost_b=[59.2], cost_w=[32.0],
                                                       cost_bw=[88.0], cost_comm=0.5),
    # the ZB paper's Table 5, 1.5B (mem-w = M_W / M_B at h 2304, 24 heads, s 1024; limit 2p)
    "Table-5 1.5B p=8 m=24": dict(p=8, m=24, cost_f=[18.522], cost_b=[18.086], cost_w=[9.337], cost_comm=0.601,
                                  mem_w=[32 * 2304 / (34 * 2304 + 5 * 24 * 1024)], memory_limit=16.0),
}

PLANS = {
    "llama-3-8b shape P=8 M=32": dict(spec=dict(num_layers=32, hidden_size=4096, num_attention_heads=32,
                                                seq_length=4096, vocab_size=128256, ffn_hidden_size=14336,
                                                split_overhead_s=0.4e-3), p=8, m=32, kw={}),
    "llama-3.2-1b P=4 M=16 post-validated": dict(spec=dict(num_layers=16, hidden_size=2048, num_attention_heads=32,
                                                           seq_length=4096, vocab_size=128256, ffn_hidden_size=8192,
                                                           num_query_groups=8, swiglu=True),
                                                 p=4, m=16, kw=dict(post_validation=True, cost_optimizer=0.01)),
}


def _schedule_record(name: str, kw: dict) -> dict:
    kw = dict(kw)
    p, m = kw.pop("p"), kw.pop("m")
    spec = get(name)
    req = ScheduleRequest(name, chunks=None, **kw)
    try:
        built = build(req, p, m, enforce_limit=False)
    except Exception as e:  # noqa: BLE001 (a refusal is recorded as it is)
        return {"error": str(e)}
    it = iteration_times(built.schedule, built.setting, 0.5)
    orders = "\n".join(" ".join(map(str, o)) for o in built.schedule.orders)
    res = built.result
    return {"orders_sha1": hashlib.sha1(orders.encode()).hexdigest(), "chunks": spec.resolve_chunks(None),
            "makespan": res.makespan, "bubble_rate": res.bubble_rate, "peak_memory": res.peak_memory,
            "iteration_time": it.iteration_time, "iteration_time_post_validated": it.iteration_time_post_validated}


def _plan_record(case: dict) -> list:
    rows = P.plan(P.PlanRequest(ModelSpec(**case["spec"]), case["p"], case["m"], 80.0, **case["kw"]), jobs=1)
    return json.loads(json.dumps(rows))


def record() -> dict:
    return {"schedules": {title: {name: _schedule_record(name, kw) for name in names()} for title, kw in SETTINGS.items()},
            "plans": {title: _plan_record(case) for title, case in PLANS.items()}}


@pytest.fixture(scope="module")
def golden():
    if os.environ.get("MZB_GOLDEN_WRITE") == "1":
        with open(PATH, "w") as f:
            json.dump(record(), f, indent=0, sort_keys=True)
    with open(PATH) as f:
        return json.load(f)


@pytest.mark.parametrize("title", list(SETTINGS))
def test_every_schedule_as_recorded(golden, title):
    got = json.loads(json.dumps({name: _schedule_record(name, SETTINGS[title]) for name in names()}))
    assert got == golden["schedules"][title]


@pytest.mark.parametrize("title", list(PLANS))
def test_plan_rows_as_recorded(golden, title):
    assert _plan_record(PLANS[title]) == golden["plans"][title]
