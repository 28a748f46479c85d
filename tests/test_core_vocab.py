"""Vocabulary parallelism in the schedule core (issue 33): the vocabulary passes VS, VT, VW placed
into every family's order, their barriers in the simulator, memory per rank."""
import json
import subprocess
import sys

import pytest

from megatron_zb.core.build import ScheduleRequest, build
from megatron_zb.core.ir import B, F, VG, VI, VS, VT, VW, Action, Placement, Schedule, ScheduleError, Setting
from megatron_zb.core.sim.simulate import simulate
from megatron_zb.core.sim.validate import validate
from megatron_zb.core.ir.vocab import VocabSetting
from megatron_zb.core.passes.vocab import delay_backwards


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
    # the input embedding split too: its lookups and gradients on every rank (the spans now start at VI)
    out = subprocess.run([sys.executable, "-m", "megatron_zb.cli", "simulate", "--schedule", "zb-v", "-p", "8", "-m",
                          "32", "--layout", "Ett|(tt|)*14,ttL", "--output-layer-cost", "2.24", "--embedding-cost", "0.1",
                          "--enable-vocab-parallel", "--split-vocab-embedding", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["makespan"] >= 410.88 - 1e-6


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


def _vse(barriers=1):
    return VocabSetting(barriers=barriers, cost_s=0.25, cost_t=0.25, cost_w=0.25, cost_comm=0.1, mem_s=0.5, mem_w=0.25,
                        embedding=True, cost_i=0.05, cost_g=0.05, cost_ci=0.2, cost_cg=0.3, mem_i=0.125)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-auto", "zb-v", "v-half", "v-auto", "interleaved-1f1b"])
def test_the_split_embedding_gets_its_passes_and_barriers(name):
    """The input embedding split too: every rank's VI and VG of every microbatch; the first stage's
    forward after the sum of the lookups (CI), every VG after the gradient's broadcast (CG)."""
    p, m = 4, 8
    b = build(ScheduleRequest(name, vocab=_vse()), p, m)
    validate(b.schedule, b.setting, memory_limit=float("inf"))
    for r, o in enumerate(b.schedule.orders):
        for k in (VS, VT, VW, VI, VG):
            assert sorted(a.mb for a in o if a.kind == k) == list(range(m)), (name, r, k)
    tl = [t for x in b.result.timeline for t in x]
    ends = {(t.action.kind, t.action.stage, t.action.mb): t.end for t in tl}
    starts = {(t.action.kind, t.action.stage, t.action.mb): t.start for t in tl}
    ci = cg = 0.0
    for j in range(m):
        ci = max(ci, max(ends[(VI, r, j)] for r in range(p))) + 0.2  # one collective at a time
        assert starts[(F, 0, j)] >= ci - 1e-9
        bk = ends.get(("B", 0, j), ends.get(("BW", 0, j)))
        cg = max(cg, bk) + 0.3
        for r in range(p):
            assert starts[(VG, r, j)] >= cg - 1e-9
            if r:
                assert starts[(VI, r, j)] >= ends[(VI, 0, j)] - 1e-9  # the tokens from the first stage's rank
    # memory: the first stage's rank holds the summed output until F and the gradient until VG
    o0 = [a for a in b.schedule.orders[0] if a.is_compute]
    trace0 = [b.setting.pass_mem(a.kind, 0, a.stage, a.mb) for a in o0]
    assert o0[0] == Action(VI, 0, 0) and trace0[0] == 0.125 and sum(trace0) == pytest.approx(0.0, abs=1e-9)
    f0 = o0.index(Action(F, 0, 0))  # F of the first stage takes the summed output over
    assert trace0[f0] == pytest.approx(b.setting.pass_mem(F, 0, 0, 0)) and \
        b.setting.pass_mem(F, 0, 0, 0) == pytest.approx(Setting(p, m, chunks=b.setting.chunks).pass_mem(F, 0, 0, 0) - 0.125)


def test_the_split_embedding_leaves_no_whole_embedding_on_the_first_rank():
    """plan's parameters per rank: with the split the first stage's rank holds V / P rows, not V; tied,
    the input shard is the output shard; untied, every rank holds one of each."""
    from megatron_zb.core.costs.chunk_costs import chunk_costs, vocab_setting
    from megatron_zb.core.costs.layout import parse
    from megatron_zb.core.costs.model import ModelSpec
    pl = Placement.single(4)
    lay = parse("Et*2|(t*2|)*2,t*2L", 4)
    for untied in (False, True):
        spec = ModelSpec(num_layers=8, hidden_size=256, num_attention_heads=4, seq_length=128, vocab_size=4096,
                         untie_embeddings_and_output_weights=untied)
        whole = chunk_costs(spec, lay, pl, 1e12, 0.0, vocab=True)
        split = chunk_costs(spec, lay, pl, 1e12, 0.0, vocab=True, vocab_embedding=True)
        emb = spec.embedding_params()
        assert split.params[0] == pytest.approx(whole.params[0] - emb + (emb / 4 if untied else 0.0))
        for r in range(1, 4):
            assert split.params[r] == pytest.approx(whole.params[r] + (emb / 4 if untied else 0.0))
    vs = vocab_setting(spec, 4, 1e12, 50e9, embedding=True)
    assert vs.embedding and vs.mem_i == spec.activation_bytes * 128 * 256 and vs.cost_ci > 0
    assert VocabSetting.from_dict(vs.to_dict()) == vs
    assert "embedding" not in vocab_setting(spec, 4, 1e12, 50e9).to_dict()


@pytest.mark.parametrize("untied", [False, True])
def test_plan_rows_with_the_split_embedding(untied):
    """plan's '+vocab' rows with the input embedding split: the first stage's rank keeps no whole
    embedding (tied: its output shard is the input shard; untied: every rank holds V / P input rows
    more), and the flags say so."""
    from megatron_zb.core.costs.model import ModelSpec
    from megatron_zb.core.plan import PlanRequest, VocabLever, plan
    spec = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=8, seq_length=1024, vocab_size=65536,
                     untie_embeddings_and_output_weights=untied)
    req = PlanRequest(spec, 4, 8, 80.0, schedules=["1f1b", "zb-v"], layout_search=False)
    rows = {e: {r["schedule"]: r for r in plan(req.replace(vocab=VocabLever("on", embedding=e)))}
            for e in (False, True)}
    emb = spec.state_bytes(spec.embedding_params())
    shard = emb / 4 if untied else 0.0
    for name in ("1f1b", "zb-v"):
        whole, split = rows[False][name], rows[True][name]
        assert split["vocab_embedding"] and "--split-vocab-embedding" in split["flags"]
        assert "--split-vocab-embedding" not in whole["flags"]
        assert split["state_bytes"][0] == pytest.approx(whole["state_bytes"][0] - emb + shard)
        assert split["state_bytes"][1:] == pytest.approx([x + shard for x in whole["state_bytes"][1:]])
        assert max(split["peak_bytes"]) < max(whole["peak_bytes"])
