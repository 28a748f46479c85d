"""megatron_zb.plot: timeline pictures, Chrome traces and the save() dispatcher."""
import json
import subprocess
import sys

import pytest

from megatron_zb.core.ir import B, BW, F, W, Action, Placement, Schedule, Setting
from megatron_zb.core.sim.simulate import simulate
from megatron_zb import plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def one_f_one_b(p: int, m: int, split: bool) -> Schedule:
    """1F1B on Placement.single(p); with ``split`` each BW becomes B then W right after it."""
    orders = []
    for r in range(p):
        warm = min(p - r - 1, m)
        order = [Action(F, r, i) for i in range(warm)]
        nf, nb = warm, 0
        while nb < m:
            if nf < m:
                order.append(Action(F, r, nf))
                nf += 1
            order += [Action(B, r, nb), Action(W, r, nb)] if split else [Action(BW, r, nb)]
            nb += 1
        orders.append(order)
    return Schedule("1f1b-split" if split else "1f1b", Placement.single(p), m, orders)


def v_gpipe(p: int, m: int) -> Schedule:
    """A V placement with F/B/W: every rank follows one global topological order."""
    pl = Placement.vshape(p)
    s_count = pl.num_stages
    glob = [Action(F, s, mb) for mb in range(m) for s in range(s_count)]
    for mb in range(m):
        glob += [Action(B, s, mb) for s in reversed(range(s_count))]
        glob += [Action(W, s, mb) for s in reversed(range(s_count))]
    orders = [[a for a in glob if pl.rank_of(a.stage) == r] for r in range(p)]
    return Schedule("v-gpipe", pl, m, orders)


@pytest.fixture(scope="module")
def res_1f1b():
    return simulate(one_f_one_b(2, 4, split=False), Setting(stages=2, microbatches=4))


@pytest.fixture(scope="module")
def res_v():
    return simulate(v_gpipe(2, 3), Setting(stages=2, microbatches=3, cost_comm=0.25))


def test_fixtures_simulate_as_expected(res_1f1b, res_v):
    # 1F1B with unit costs: (m + p - 1) * (f + b + w)
    assert res_1f1b.makespan == pytest.approx(15.0)
    assert res_v.chunks == 2
    assert sum(len(tl) for tl in res_v.timeline) == 2 * 2 * 3 * 3  # stages * mbs * (F, B, W)


@pytest.mark.parametrize("which", ["res_1f1b", "res_v"])
def test_png_and_svg_written(which, tmp_path, request):
    pytest.importorskip("matplotlib")
    res = request.getfixturevalue(which)
    png, svg = tmp_path / "t.png", tmp_path / "t.svg"
    plot.plot_timeline(res, str(png))
    plot.save(res, str(svg))
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    assert res.schedule in text  # default title names the schedule


def test_custom_title(res_1f1b, tmp_path):
    pytest.importorskip("matplotlib")
    svg = tmp_path / "t.svg"
    plot.plot_timeline(res_1f1b, str(svg), title="my own title")
    assert "my own title" in svg.read_text()


def test_plot_timeline_rejects_json(res_1f1b, tmp_path):
    with pytest.raises(ValueError):
        plot.plot_timeline(res_1f1b, str(tmp_path / "t.json"))


@pytest.mark.parametrize("which", ["res_1f1b", "res_v"])
def test_chrome_trace_events(which, request):
    res = request.getfixturevalue(which)
    trace = plot.chrome_trace(res)
    events = trace["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    passes = [t for tl in res.timeline for t in tl]
    assert len(xs) == len(passes)
    by_key = {(e["pid"], e["cat"], e["args"]["stage"], e["args"]["microbatch"]): e for e in xs}
    assert len(by_key) == len(xs)
    for t in passes:
        a = t.action
        e = by_key[(t.rank, a.kind, a.stage, a.mb)]
        assert e["name"] == f"{a.kind}{a.mb}"
        assert e["ts"] == pytest.approx(t.start * 1000)
        assert e["dur"] == pytest.approx((t.end - t.start) * 1000)
        assert e["tid"] == 0
    names = {e["pid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(res.stages)}
    threads = {e["pid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads == set(range(res.stages))


def test_chrome_trace_v_chunks(res_v):
    xs = [e for e in plot.chrome_trace(res_v)["traceEvents"] if e["ph"] == "X"]
    # V on 2 ranks: rank 0 holds stages 0 (chunk 0) and 3 (chunk 1); rank 1 holds 1 and 2.
    chunk = {(e["pid"], e["args"]["stage"]): e["args"]["chunk"] for e in xs}
    assert chunk == {(0, 0): 0, (0, 3): 1, (1, 1): 0, (1, 2): 1}


def test_write_chrome_trace_and_save_json(res_v, tmp_path):
    p1, p2 = tmp_path / "a.json", tmp_path / "b.JSON"
    plot.write_chrome_trace(res_v, str(p1))
    plot.save(res_v, str(p2))
    d1, d2 = json.loads(p1.read_text()), json.loads(p2.read_text())
    assert d1 == d2 == json.loads(json.dumps(plot.chrome_trace(res_v)))


@pytest.mark.parametrize("name", ["t.pdf", "t.txt", "t", "t.png.bak"])
def test_save_bad_extension(res_1f1b, tmp_path, name):
    with pytest.raises(ValueError, match=r"\.png.*\.svg.*\.json"):
        plot.save(res_1f1b, str(tmp_path / name))
    assert not (tmp_path / name).exists()


@pytest.mark.timing
def test_large_schedule_renders_quickly(tmp_path):
    pytest.importorskip("matplotlib")
    import time

    res = simulate(one_f_one_b(16, 64, split=True), Setting(stages=16, microbatches=64))
    t = time.process_time()  # CPU time (the rendering's work), not the wall clock of a busy host
    plot.save(res, str(tmp_path / "big.png"))
    assert time.process_time() - t < 8.0
    assert (tmp_path / "big.png").read_bytes().startswith(PNG_SIGNATURE)


def test_plot_module_imports_neither_torch_nor_megatron():
    code = ("import sys, megatron_zb.plot; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("unit,us", [("ms", 1e3), ("s", 1e6), ("us", 1.0)])
def test_chrome_trace_time_unit(res_1f1b, unit, us):
    trace = plot.chrome_trace(res_1f1b, time_unit=unit)
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    first = min(xs, key=lambda e: (e["ts"], e["pid"]))
    assert first["dur"] == pytest.approx(1.0 * us)  # a unit-cost F lasts 1 <unit>
    assert max(e["ts"] + e["dur"] for e in xs) == pytest.approx(res_1f1b.makespan * us)
    assert trace["otherData"]["time_unit"] == unit and "microseconds" in trace["otherData"]["note"]
    with pytest.raises(ValueError, match="time_unit"):
        plot.chrome_trace(res_1f1b, time_unit="minutes")


def test_picture_axis_says_its_unit_and_labels_b_and_w(tmp_path):
    pytest.importorskip("matplotlib")
    res = simulate(one_f_one_b(2, 3, split=True), Setting(stages=2, microbatches=3, cost_f=0.04,
                                                          cost_b=0.05, cost_w=0.02))
    svg = tmp_path / "t.svg"
    plot.plot_timeline(res, str(svg), time_unit="s")  # a profile's seconds are drawn in ms
    text = svg.read_text()
    assert "time (ms)" in text and f"makespan {res.makespan * 1e3:.4g} ms" in text
    # every box carries its microbatch number (matplotlib writes each text as an SVG comment):
    # microbatches 1 and 2 each label 2 ranks x (F, B, W) boxes; the ticks are 0, 50, 100...
    assert text.count("<!-- 1 -->") == 6 and text.count("<!-- 2 -->") == 6


def test_cli_plot_time_unit(tmp_path, capsys):
    from megatron_zb.cli import main
    out = tmp_path / "t.json"
    assert main(["plot", "--schedule", "1f1b", "-p", "2", "-m", "2", "--cost-f", "0.5", "--time-unit", "s",
                 "--out", str(out)]) == 0
    xs = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
    assert min(e["dur"] for e in xs) == pytest.approx(0.5e6)
