"""The training-iteration model (core/sim/iteration.py): synchronous optimizer step vs post-validation,
and how simulate/compare/plan/plot show it."""
import json

import pytest

from megatron_zb.cli import main
from megatron_zb.cli.plan import post_validation_advice
from megatron_zb.core import plan as P
from megatron_zb.core import schedules
from megatron_zb.core.ir import ScheduleError, Setting
from megatron_zb.core.sim.iteration import (POSTVAL_STEP_FACTOR, back_to_back, iteration_times, simulate_iterations,
                                        validation_points, validation_times)
from megatron_zb.core.sim.simulate import simulate


def _it(name, p=4, m=8, cost_optimizer=0.0, **kw):
    c = schedules.get(name).resolve_chunks(None)
    st = Setting(p, m, chunks=c, **kw)
    sched = schedules.generate(name, st)
    return sched, st, iteration_times(sched, st, cost_optimizer)


@pytest.mark.parametrize("name, sync, post", [("1f1b", 33, 33), ("zb-h1", 27, 27), ("zb-h2", 27, 24),
                                              ("zb-v", 25.5, 24)])
def test_reference_values_unit_costs(name, sync, post):
    _, _, it = _it(name)
    assert (it.iteration_time, it.iteration_time_post_validated) == (sync, post)


def test_optimizer_cost_is_paid_once_per_iteration():
    sched, st, it = _it("zb-h2", cost_optimizer=2.0)
    # the post-validated step costs POSTVAL_STEP_FACTOR x Megatron's (its rollback copy, its validation)
    assert it.iteration_time == 29 and it.iteration_time_post_validated == pytest.approx(24 + 2 * POSTVAL_STEP_FACTOR)
    assert it.to_dict()["cost_optimizer_post_validated"] == pytest.approx(2 * POSTVAL_STEP_FACTOR)
    same = iteration_times(sched, st, 2.0, cost_postval=2.0)  # as measured
    assert (same.iteration_time, same.iteration_time_post_validated) == (29, 26)


@pytest.mark.parametrize("kw", [{}, dict(cost_f=1.3, cost_b=2.1, cost_w=0.7, cost_comm=0.1),
                                dict(cost_f=[1, 1.2, 1, 1.5], cost_b=2, cost_w=1, cost_comm=0.3)])
@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "interleaved-1f1b"])
def test_bounds_and_steady_state(name, kw):
    sched, st, it = _it(name, cost_optimizer=0.5, **kw)
    res = simulate(sched, st)
    # post-validation loses at most its dearer step, and no iteration is shorter than the busiest rank's work
    post = 0.5 * POSTVAL_STEP_FACTOR
    assert it.iteration_time_post_validated <= it.iteration_time + (post - 0.5) + 1e-9
    assert it.iteration_time_post_validated >= max(res.busy) + post - 1e-9
    assert it.iteration_time >= res.makespan + 0.5 - 1e-9
    runs, validated = simulate_iterations(sched, st, 8, post)  # (the post-validated step's time)
    ends = [max(tl[-1].end for tl in r.timeline) for r in runs]
    periods = [b - a for a, b in zip(ends, ends[1:])]
    assert periods[-1] == pytest.approx(it.iteration_time_post_validated)
    # every rank's first backward of iteration k+1 waits for the validation of iteration k's step
    points = validation_points(sched)
    for k in range(1, len(runs)):
        for r, tl in enumerate(runs[k].timeline):
            assert tl[points[r]].start >= validated[k - 1][r] - 1e-9
            assert tl[0].start >= runs[k - 1].timeline[r][-1].end + post - 1e-9


def test_validation_times_chain():
    # partials 0 -> 3 (a rank adds its part when done), the full result back 3 -> 0, 1 per hop
    assert validation_times([10, 5, 20, 12], 1.0) == [24, 23, 22, 21]
    assert validation_times([0, 0, 0, 30], 0.0) == [30, 30, 30, 30]
    assert validation_times([7], 1.0) == [7]


def test_validation_point_is_the_first_backward():
    sched, _, _ = _it("zb-v")
    pts = validation_points(sched)
    for r, order in enumerate(sched.flat().orders):
        passes = [a for a in order if a.is_compute]
        assert passes[pts[r]].kind in ("B", "BW") and all(a.kind == "F" for a in passes[:pts[r]])


def test_back_to_back_picture_data():
    sched, st, it = _it("zb-h2")
    res = back_to_back(sched, st, 3, post_validated=False)
    assert res.makespan == pytest.approx(3 * it.iteration_time - (it.iteration_time - 27))
    assert len(res.timeline[0]) == 3 * len(simulate(sched, st).timeline[0])
    with pytest.raises(ScheduleError, match="cost-optimizer"):
        iteration_times(sched, st, -1)


def test_cli_simulate_json_and_text(capsys):
    assert main(["simulate", "--schedule", "zb-h2", "-p", "4", "-m", "8", "--json", "--cost-optimizer", "1"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["makespan"], d["iteration_time"], d["cost_optimizer"]) == (24, 28, 1)
    assert d["iteration_time_post_validated"] == pytest.approx(24 + POSTVAL_STEP_FACTOR)  # its dearer step
    assert main(["simulate", "--schedule", "zb-h2", "-p", "4", "-m", "8", "--json", "--cost-optimizer", "1",
                 "--cost-optimizer-post-validated", "1"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["iteration_time_post_validated"], d["cost_optimizer_post_validated"]) == (25, 1)
    assert main(["simulate", "--schedule", "zb-h2", "-p", "4", "-m", "8"]) == 0
    assert "27 with Megatron's synchronous optimizer step, 24 with optimizer post-validation" in capsys.readouterr().out


def test_cli_compare_ranks_by_what_the_user_gets(capsys):
    assert main(["compare", "-p", "4", "-m", "8", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)["rows"] if "error" not in r]
    by = {r["schedule"]: r for r in rows}
    assert by["zb-h2"]["speedup_vs_1f1b"] == by["zb-h1"]["speedup_vs_1f1b"] == round(33 / 27, 4)
    assert [r["iteration_time"] for r in rows] == sorted(r["iteration_time"] for r in rows)
    assert main(["compare", "-p", "4", "-m", "8", "--json", "--optimizer-post-validation"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)["rows"] if "error" not in r]
    by = {r["schedule"]: r for r in rows}
    assert by["zb-h2"]["speedup_vs_1f1b"] == round(33 / 24, 4) and by["zb-h1"]["speedup_vs_1f1b"] == round(33 / 27, 4)
    assert [r["iteration_time_post_validated"] for r in rows] == sorted(r["iteration_time_post_validated"] for r in rows)
    assert main(["compare", "-p", "4", "-m", "8"]) == 0
    assert "iter postval" in capsys.readouterr().out


def test_plan_both_times_and_advice(capsys):
    spec = P.ModelSpec(num_layers=16, hidden_size=2048, num_attention_heads=16, seq_length=2048)
    rows = P.plan(P.PlanRequest(spec, 4, 8, 80, schedules=["1f1b", "zb-h1", "zb-h2"]))
    by = {r["schedule"]: r for r in rows}
    assert by["zb-h2"]["iteration_time_post_validated_s"] < by["zb-h2"]["iteration_time_s"]
    assert by["zb-h1"]["iteration_time_post_validated_s"] <= by["zb-h1"]["iteration_time_s"]
    assert (by["zb-h2"]["iteration_time_s"] - by["zb-h2"]["iteration_time_post_validated_s"]
            > by["zb-h1"]["iteration_time_s"] - by["zb-h1"]["iteration_time_post_validated_s"])
    advice = post_validation_advice(rows, False)
    assert advice and "--enable-optimizer-post-validation with zb-h2" in advice
    rows = P.plan(P.PlanRequest(spec, 4, 8, 80, schedules=["1f1b", "zb-h1", "zb-h2"], post_validation=True))
    assert rows[0]["schedule"] == "zb-h2" and rows[0]["flags"].endswith("--enable-optimizer-post-validation")
    assert main(["plan", "--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16",
                 "--seq-length", "2048", "--pipeline-parallel-size", "4", "--num-microbatches", "8", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert all("iteration_time_s" in r for r in d["rows"] if "error" not in r) and "post_validation_advice" in d


def test_cli_plot_iterations(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["plot", "--schedule", "zb-h2", "-p", "4", "-m", "8", "--iterations", "3",
                 "--optimizer-post-validation", "--out", str(out)]) == 0
    events = [e for e in json.loads(out.read_text())["traceEvents"] if e.get("ph") == "X"]
    assert len(events) == 3 * 4 * 8 * 3
    assert main(["plot", "--schedule", "zb-h2", "-p", "4", "-m", "8", "--iterations", "4", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "1 to 3" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["1f1b", "zb-h2", "zb-v", "interleaved-zb", "dualpipe-v"])
def test_iterations_stop_once_they_repeat_with_the_averaged_period(name, monkeypatch):
    """Issue 32 item 6: once every rank's end moved by the same time twice, the iterations repeat
    (``steady_shift``): the period is that shift, the 16-iteration average to float noise."""
    import megatron_zb.core.sim.iteration as it
    from megatron_zb.core.build import ScheduleRequest, build
    b = build(ScheduleRequest(name, cost_f=[1.0, 1.2, 1.1, 1.3], cost_b=[2.0], cost_w=[0.7], cost_comm=0.05), 4, 8)
    for cost in (0.0, 0.4, [0.1, 0.9, 0.2, 0.3]):
        quick = iteration_times(b.schedule, b.setting, cost)
        with monkeypatch.context() as mp:
            mp.setattr(it, "steady_shift", lambda ends: None)
            full = iteration_times(b.schedule, b.setting, cost)
        assert len(quick.windows) < len(full.windows) == it.ITERATIONS
        assert quick.iteration_time == full.iteration_time
        assert quick.iteration_time_post_validated == pytest.approx(full.iteration_time_post_validated, rel=1e-12)
        assert quick.windows == full.windows[:len(quick.windows)]
