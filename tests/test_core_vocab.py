"""Vocabulary parallelism in the schedule core (issue 33): the vocabulary passes VS, VT, VW placed
into every family's order, their barriers in the simulator, memory per rank."""
import json
import subprocess
import sys

import pytest

from megatron_zb.core.build import ScheduleRequest, build
from megatron_zb.core.ir import B, F, VS, VT, VW, Action, Placement, Schedule, ScheduleError, Setting
from megatron_zb.core.simulate import simulate
from megatron_zb.core.validate import validate
from megatron_zb.core.vocab import VocabSetting, delay_backwards


def _vs(barriers=1, comm=0.1):
    return VocabSetting(barriers=barriers, cost_s=0.25, cost_t=0.25, cost_w=0.25, cost_comm=comm, mem_s=0.5,
                        mem_w=0.25)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "zb-auto", "zb-v", "v-half", "v-min", "v-auto",
                                  "interleaved-1f1b", "interleaved-zb", "gpipe", "dualpipe-v"])
@pytest.mark.parametrize("barriers", [1, 2])
def test_every_family_gets_its_vocabulary_passes(name, barriers):
    b = build(ScheduleRequest(name, vocab=_vs(barriers)), 4, 8)
    validate(b.schedule, b.setting, memory_limit=float("inf"))
    p = 4
    for r, o in enumerate(b.schedule.orders):
        for k in (VS, VT, VW):
            assert sorted(a.mb for a in o if a.kind == k) == list(range(8)), (name, r, k)
    res = b.result
    ends = {(t.action.kind, t.action.stage, t.action.mb): t.end for tl in res.timeline for t in tl}
    starts = {(t.action.kind, t.action.stage, t.action.mb): t.start for tl in res.timeline for t in tl}
    last = b.schedule.placement.num_stages - 1
    for j in range(8):  # the loss stage's backward waits for the last barrier
        c0 = max(ends[(VS, r, j)] for r in range(p)) + 0.1
        after = c0 if barriers == 1 else max(c0, max(ends[(VT, r, j)] for r in range(p))) + (barriers - 1) * 0.1
        bk = next(k for k in (("B", last, j), ("BW", last, j)) if k in starts)
        assert starts[bk] >= after - 1e-9
        for r in range(p):
            assert starts[(VT, r, j)] >= c0 - 1e-9 and starts[(VW, r, j)] >= ends[(VT, r, j)] - 1e-9
            assert starts[(VS, r, j)] >= ends[(F, last, j)] - 1e-9


def test_balanced_vocabulary_fills_the_v():
    """Llama-3-8B's shape in layer units (issue 33): even layout, the 2.24-layer output layer spread over
    8 ranks: zb-v reaches the balanced pipeline's 410.88 (0% bubble)."""
    out = subprocess.run([sys.executable, "-m", "megatron_zb.cli", "simulate", "--schedule", "zb-v", "-p", "8", "-m",
                          "32", "--layout", "Ett|(tt|)*14,ttL", "--output-layer-cost", "2.24",
                          "--enable-vocab-parallel", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["makespan"] == pytest.approx(410.88, abs=1e-6) and d["bubble_rate"] < 1e-6
    bad = subprocess.run([sys.executable, "-m", "megatron_zb.cli", "simulate", "--schedule", "zb-v", "-p", "8", "-m",
                          "32", "--enable-vocab-parallel"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "give --layout" in bad.stderr


def test_delaying_backwards_keeps_each_kind_in_order():
    base = build(ScheduleRequest("1f1b"), 4, 8).schedule
    for k in (1, 2):
        d = delay_backwards(base, k)
        for o, o0 in zip(d.orders, base.orders):
            for kind in ("F", "BW"):
                assert [a for a in o if a.kind == kind] == [a for a in o0 if a.kind == kind]
        validate(d)  # still deadlock-free


def test_bad_vocabulary_settings_are_named():
    with pytest.raises(ScheduleError, match="one or two barriers"):
        VocabSetting(barriers=3)
    with pytest.raises(ScheduleError, match="cannot exceed mem-s"):
        VocabSetting(mem_s=0.1, mem_w=0.2)
    with pytest.raises(ScheduleError, match="replicated stages"):
        build(ScheduleRequest("bitpipe", vocab=_vs()), 4, 8)
    orders = [[Action(F, 0, 0), Action(VS, 0, 0), Action(B, 0, 0), Action("W", 0, 0)]]
    with pytest.raises(ScheduleError, match="vocabulary passes: its setting needs"):
        simulate(Schedule("x", Placement.single(1), 1, orders), Setting(1, 1))
    with pytest.raises(ScheduleError, match="missing vocabulary pass VT"):
        validate(Schedule("x", Placement.single(1), 1, orders), Setting(1, 1, vocab=_vs()))
