"""Uneven model layouts (issue 32): Megatron's layout grammar in pipeline order, the layout search,
the layout flags under every schedule family (flags, verify) and exactness against the reference."""
import argparse
import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_zb.core.ir import Placement, ScheduleError
from megatron_zb.core.costs.layout import Layout, from_counts, from_megatron_flags, parse
from megatron_zb.core.costs.layout_search import balanced, rank_loads
from megatron_zb.megatron.errors import ZeroBubbleArgumentError
from megatron_zb.megatron.launch.flags import validate_zero_bubble_args


# -- the grammar ------------------------------------------------------------------------------

def test_megatrons_examples_parse():
    assert parse("E|(tt|)*3,m|L").stages == ("E", "tt", "tt", "tt", "m", "L")
    assert parse("Ettt|(tt|)*29,m|L").num_stages == 32
    assert parse("Et*3|(t*4|)*6t*3L").layers() == [3] + [4] * 6 + [3]
    assert parse("E|t|t|L", 2).num_stages == 4


@pytest.mark.parametrize("text, match", [
    ("tE|L", "must open the first stage"), ("E|t|tLt", "must close the last stage"), ("E|t|L|L", "exactly once"),
    ("E|x|L", "unknown layer letter"), ("E|(tt|*2|L", "followed by"), ("E|m|t|L", "after every transformer"),
    ("E|m|m|L", "in one stage"), ("", "empty"),
])
def test_bad_layouts_are_named(text, match):
    with pytest.raises(ScheduleError, match=match):
        parse(text)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=12), st.integers(0, 2))
def test_printing_reads_back(counts, mtp):
    lay = from_counts(counts, mtp)
    assert parse(str(lay)).stages == lay.stages


def test_megatron_flags_mean_what_megatron_means():
    v = lambda s: s if s < 4 else 7 - s  # noqa: E731 - the V's rank of stage s, P=4
    assert from_megatron_flags(14, 4, 2, v, account_for_embedding=True, account_for_loss=True).layers() == \
        [1, 2, 2, 2, 2, 2, 2, 1]
    assert from_megatron_flags(10, 4, 1, lambda s: s, first=1, last=3).layers() == [1, 3, 3, 3]
    looped = from_megatron_flags(12, 2, 2, lambda s: s % 2, first=4, last=8)
    assert looped.layers() == [2, 4, 2, 4]  # each rank's layers spread over its chunks
    with pytest.raises(ScheduleError, match="does not divide evenly"):
        from_megatron_flags(10, 4, 1, lambda s: s, first=1, last=2)


def test_megatrons_own_parser_agrees():
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout as P
    names = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
    for text in ("E|(tt|)*3,m|L", "Ettt|(tt|)*29,m|L", "Et*3|(t*4|)*6t*3L", "E|tt|tt|L"):
        ref = ["".join(names[x.name] for x in stage) for stage in P.parse_str_to_list(text)]
        assert list(parse(text).stages) == ref
        assert list(parse(str(parse(text))).stages) == ref


# -- the search -------------------------------------------------------------------------------

def test_balanced_layout_lightens_the_v_rank_with_the_output_layer():
    """Llama-3-8B's shape in layer units (issue 32): 32 layers, the output layer 2.24 layers on the V's
    rank 0: the best integral layout has no rank above 5 layers' work (an even split puts 6.24 there)."""
    pl = Placement.vshape(8)
    lay = balanced([1.0] * 32, pl, 0.0, 2.24)[0]
    loads = rank_loads(lay.layers(), [1.0] * 32, 0.0, 2.24, pl)
    assert max(loads) == pytest.approx(5.0)
    assert loads[0] == pytest.approx(4.24)
    assert lay.num_layers == 32 and lay.stages[0].startswith("E") and lay.stages[-1].endswith("L")


def test_balanced_layout_weights_each_layer():
    """Dense first layers of a MoE model weigh less: the chunks holding them take more of them."""
    pl = Placement.single(4)
    work = [1.0] * 4 + [3.0] * 12
    lay = balanced(work, pl, 0.0, 0.0)[0]
    # the best integral cut: 4 dense + 2 MoE layers (10), then 4, 3, 3 MoE layers (12, 9, 9)
    assert max(rank_loads(lay.layers(), work, 0.0, 0.0, pl)) == pytest.approx(12.0)
    assert lay.layers()[0] >= 5 and lay.layers()[0] > lay.layers()[-1]


# -- the flags (no megatron needed) -------------------------------------------------------------

def _args(**kw):
    base = dict(zero_bubble_schedule=None, pipeline_model_parallel_size=2, num_layers=4, hidden_size=64,
                num_attention_heads=4, seq_length=32, micro_batch_size=1, vocab_size=128)
    base.update(kw)
    return argparse.Namespace(**base)


def test_a_v_layout_is_taken_over_before_megatron_reads_it():
    a = _args(zero_bubble_schedule="zb-v", pipeline_model_parallel_layout="E|ttt|t|L")
    kw = validate_zero_bubble_args(a, before_megatron_validation=True)
    assert a.zero_bubble_layers_per_stage == [0, 3, 1, 0]
    assert a.pipeline_model_parallel_layout is None and a.num_virtual_stages_per_pipeline_rank == 2
    assert len(kw["cost_f"]) == 4 and kw["cost_f"][1] > kw["cost_f"][2]  # each chunk's own share
    assert max(kw["mem_f"][0] + kw["mem_f"][3], kw["mem_f"][1] + kw["mem_f"][2]) == pytest.approx(1.0)
    # a second call (the launcher's, after Megatron) keeps what the first took
    assert validate_zero_bubble_args(a, before_megatron_validation=True)["schedule"] == "zb-v"
    assert a.zero_bubble_layers_per_stage == [0, 3, 1, 0]


def test_single_and_interleaved_layouts_stay_megatrons():
    a = _args(zero_bubble_schedule="zb-h1", pipeline_model_parallel_layout="Et|tttL")
    validate_zero_bubble_args(a, before_megatron_validation=True)
    assert a.zero_bubble_layers_per_stage == [1, 3] and a.pipeline_model_parallel_layout == "Et|tttL"
    b = _args(zero_bubble_schedule="interleaved-zb", pipeline_model_parallel_layout="E|tt|t|tL",
              num_layers_per_virtual_pipeline_stage=None, num_virtual_stages_per_pipeline_rank=None)
    kw = validate_zero_bubble_args(b, before_megatron_validation=True)
    assert kw["chunks"] == 2 and b.zero_bubble_layers_per_stage == [0, 2, 1, 1]
    c = _args(zero_bubble_schedule="zb-h1", pipeline_model_parallel_size=4, num_layers=6,
              decoder_first_pipeline_num_layers=0, decoder_last_pipeline_num_layers=2)
    validate_zero_bubble_args(c, before_megatron_validation=True)
    assert c.zero_bubble_layers_per_stage == [0, 2, 2, 2]


@pytest.mark.parametrize("kw, match", [
    (dict(zero_bubble_schedule="zb-v", pipeline_model_parallel_layout="E|t|t|t|tL"), "has 5 stages; schedule"),
    (dict(zero_bubble_schedule="zb-v", pipeline_model_parallel_layout="E|tttt|L"), "has 3 stages"),
    (dict(zero_bubble_schedule="zb-v", pipeline_model_parallel_layout="E|tt|t|L"), "holds 3 transformer layer"),
    (dict(zero_bubble_schedule="zb-v", pipeline_model_parallel_layout="E|tttt||L"), "holds no layer"),
    (dict(zero_bubble_schedule="zb-v", pipeline_model_parallel_layout="E|tt|tt|L",
          decoder_first_pipeline_num_layers=1), "cannot be combined with --decoder-first"),
    (dict(zero_bubble_schedule="zb-v", mtp_num_layers=1, pipeline_model_parallel_layout="E|tt|ttm|L"),
     "MTP layers"),
])
def test_bad_layout_flags_are_one_line(kw, match):
    with pytest.raises(ZeroBubbleArgumentError, match=match):
        validate_zero_bubble_args(_args(**kw), before_megatron_validation=True)


def test_a_v_layout_after_megatron_validated_is_refused():
    a = _args(zero_bubble_schedule="zb-v", pipeline_model_parallel_layout="E|ttt|t|L",
              virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ZeroBubbleArgumentError, match="megatron_zb.run"):
        validate_zero_bubble_args(a, before_megatron_validation=False)


def test_plan_prints_a_layout_that_reads_back():
    from megatron_zb.core import plan as P
    spec = P.ModelSpec(num_layers=16, hidden_size=1024, num_attention_heads=16, seq_length=2048, vocab_size=128256)
    rows = P.plan(P.PlanRequest(spec, 4, 8, 80, schedules=["1f1b", "zb-h1"]), jobs=1)
    for r in rows:
        assert parse(r["layout"]).layers() == r["layers_per_stage"]
        if "--pipeline-model-parallel-layout" in r["flags"]:
            text = r["flags"].split("--pipeline-model-parallel-layout '")[1].split("'")[0]
            assert parse(text).layers() == r["layers_per_stage"]
    even = P.plan(P.PlanRequest(spec, 4, 8, 80, schedules=["zb-h1"], layout_search=False), jobs=1)[0]
    assert rows[-1]["iteration_time_s"] <= even["iteration_time_s"] + 1e-12
    fixed = P.plan(P.PlanRequest(spec, 4, 8, 80, schedules=["zb-h1", "zb-v"], layout="Et*3|t*4|t*5|t*4L"), jobs=1)
    assert fixed[0]["layers_per_stage"] == [3, 4, 5, 4]
    assert "8 model chunks" in fixed[-1]["error"] or "4 stages" in fixed[-1]["error"]


# -- exact against the reference (real processes, both megatron-core versions) -----------------

LAYOUT_CASES = [  # (schedule, P, layout, extra)
    ("1f1b", 2, "Et|tttL", {}),
    ("zb-h1", 2, "E|ttttL", {}),  # the embedding alone on rank 0
    ("zb-v", 2, "E|ttt|t|L", {}),  # a V whose rank 0 holds the embedding alone and the loss alone
    ("zb-v", 2, "Et|tt|t|L", {"untied": True}),
    ("v-half", 2, "Et|tt|t|L", {}),
    ("interleaved-zb", 2, "E|tt|t|tL", {}),
    ("bitpipe", 2, "E|tt|tt|L", {}),
]


@pytest.mark.megatron
@pytest.mark.dist
def test_layouts_train_like_the_reference(mcore_path, mcore_version):
    from megatron_zb import verify as V
    cases = []
    for name, p, text, extra in LAYOUT_CASES:
        lay = parse(text)
        cases.append(V.make_case(name, p, num_microbatches=4, iterations=2, num_layers=lay.num_layers,
                                 layers_per_stage=lay.layers(), tie_embeddings=not extra.get("untied"),
                                 label=f"layout {text}"))
    results = V.run_verify_many(cases, timeout=900, mcore_path=mcore_path)
    bad = [f"{r['case']}: {r.get('error') or r.get('problems')}" for r in results if not r["passed"]]
    assert not bad, "\n".join(bad)
    for r in results:
        assert not mcore_version or r["megatron_core"].startswith(mcore_version)


@pytest.mark.megatron
@pytest.mark.dist
def test_verify_takes_megatrons_layout_flags_and_refuses_a_bad_model_in_one_line(mcore_path):
    env_mcore = ["--mcore-path", mcore_path] if mcore_path else []
    run = lambda *a: subprocess.run([sys.executable, "-m", "megatron_zb.cli", "verify", *a, *env_mcore],  # noqa: E731
                                    capture_output=True, text=True, timeout=600)
    ok = run("--schedule", "zb-v", "-p", "4", "-m", "8", "--num-layers", "8", "--iterations", "2",
             "--pipeline-model-parallel-layout", "Et|t|t|tt|t|t|t|L", "--search-effort", "quick", "--json")
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-2000:]
    assert "layers=1,1,1,2,1,1,1,0" in ok.stdout and "search-effort=quick" in ok.stdout  # (a plan row's ~ flags)
    assert json.loads(ok.stdout.strip().splitlines()[-1])["passed"]
    bad = run("--schedule", "zb-h1", "-p", "2", "-d", "2", "--num-experts", "4", "--moe-router-topk", "1",
              "--iterations", "1")
    assert bad.returncode == 2
    err = bad.stderr.strip().splitlines()
    assert len(err) == 1 and "pre-softmax" in err[0] and "Traceback" not in bad.stderr + bad.stdout
