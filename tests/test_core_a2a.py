"""MoE's all-to-all in the simulator (issue 27, item 3, the model): ``--cost-a2a T`` is one
microbatch's dispatch + combine in an F, B or fused BW of a whole stage, serial with the pass's
compute; inside an overlapped F&B pair (dualpipe-v's OVERLAP_F_B) each pass's all-to-all hides
behind the other's compute; ``--no-overlap`` keeps it serial there too."""
from __future__ import annotations

import json

import pytest

from megatron_zb.cli import main
from megatron_zb.core.ir import Action, Placement, Schedule, ScheduleError, Setting
from megatron_zb.core.schedules import generate
from megatron_zb.core.sim.simulate import simulate


def test_all_to_all_is_part_of_every_f_b_and_bw_but_not_w():
    st = Setting(4, 8, cost_f=1, cost_b=2, cost_w=1, cost_a2a=0.5)
    assert [st.pass_cost(k, 0) for k in ("F", "B", "W", "BW")] == [1.5, 2.5, 1.0, 3.5]
    assert [st.pass_a2a(k, 0) for k in ("F", "B", "W", "BW")] == [0.5, 0.5, 0.0, 0.5]
    plain = simulate(generate("1f1b", Setting(4, 8, cost_f=1.5, cost_b=3.5, cost_w=0)),
                     Setting(4, 8, cost_f=1.5, cost_b=3.5, cost_w=0))
    s = generate("1f1b", st)
    assert simulate(s, st).makespan == pytest.approx(plain.makespan)  # 1f1b: BW = B + W + a2a
    with pytest.raises(ScheduleError, match="cost-a2a"):
        Setting(4, 8, cost_a2a=-1)


def test_an_overlapped_pair_hides_each_all_to_all_behind_the_other_compute():
    # one rank, two stages of a V (P=1): F1.1 and B0.0 overlapped after F0.0, F1.0, F0.1
    pl = Placement.vshape(1)
    order = [Action("F", 0, 0), Action("F", 1, 0), Action("F", 0, 1),
             Action.overlap(Action("F", 1, 1), Action("B", 1, 0)),
             Action("W", 1, 0), Action("B", 0, 0), Action("W", 0, 0), Action("B", 1, 1), Action("W", 1, 1),
             Action("B", 0, 1), Action("W", 0, 1)]
    sched = Schedule("pair", pl, 2, [order])
    cost = dict(cost_f=2.0, cost_b=2.0, cost_w=1.0)  # per chunk (2 chunks): F 1, B 1, W 0.5
    for a2a, hidden in ((0.6, True), (0.6, False), (3.0, True)):
        st = Setting(1, 2, cost_a2a=a2a, a2a_overlap=hidden, **cost)
        tl = {str(t.action): t.end - t.start for t in simulate(sched, st).timeline[0]}
        own = a2a / 2
        if hidden:  # each exposes only what the other's compute (1.0) does not cover
            assert tl["F1.1"] == pytest.approx(1.0 + max(0.0, own - 1.0))
            assert tl["B1.0"] == pytest.approx(1.0 + max(0.0, own - 1.0))
        else:
            assert tl["F1.1"] == pytest.approx(1.0 + own) and tl["B1.0"] == pytest.approx(1.0 + own)
        assert tl["F0.0"] == pytest.approx(1.0 + own) and tl["W1.0"] == pytest.approx(0.5)


def test_dualpipe_v_gains_from_hiding_and_compare_ranks_by_it(capsys):
    st = dict(cost_f=1, cost_b=1, cost_w=1, cost_a2a=0.5)
    s = generate("dualpipe-v", Setting(4, 16, **st))
    on, off = (simulate(s, Setting(4, 16, a2a_overlap=o, **st)).makespan for o in (True, False))
    assert on < off
    assert main(["compare", "--stages", "4", "--microbatches", "16", "--cost-a2a", "0.5", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows[0]["schedule"] == "dualpipe-v"
    assert main(["simulate", "--schedule", "dualpipe-v", "--stages", "4", "--microbatches", "16", "--cost-a2a", "0.5",
                 "--no-overlap", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["makespan"] == pytest.approx(off) and d["cost_a2a"] == [0.5] * 4 and d["a2a_overlap"] is False
