"""Recompute per model chunk (issue 55 item 2): ``--zero-bubble-recompute-num-layers`` (one count per
pipeline rank or one per model chunk in pipeline order, with Megatron's ``--recompute-granularity
full --recompute-method block``) in training's flags (checked before any process starts, carried
by the model the flags describe, so training builds the schedule plan timed), in the chunks each
rank builds (each recomputes its own first layers in B: ``megatron.features.recompute``), and in
verify (exact, loss and every gradient, against the non-pipelined reference; both megatron-core
versions)."""
from __future__ import annotations

import argparse
import dataclasses
import re
import shlex

import pytest

from megatron_zb import verify as V
from megatron_zb.verify.case import reference_overrides
from megatron_zb.core.costs.chunk_costs import unit_costs
from megatron_zb.core.ir import Placement
from megatron_zb.megatron.errors import ZeroBubbleArgumentError
from megatron_zb.megatron.launch.args import add_zero_bubble_args
from megatron_zb.megatron.launch.flags import validate_zero_bubble_args
from megatron_zb.megatron.layout.model_args import model_spec

MODEL = "--num-layers 16 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048"
BLOCK = "--recompute-granularity full --recompute-method block"
FLAG = "--zero-bubble-recompute-num-layers"


def _parse(flags: str):
    """Megatron's flags validation reads (its recompute flags among them) and megatron-zb's."""
    ap = argparse.ArgumentParser(allow_abbrev=False)
    add_zero_bubble_args(ap)
    for flag, kind in (("--pipeline-model-parallel-size", int), ("--num-layers", int), ("--hidden-size", int),
                       ("--num-attention-heads", int), ("--seq-length", int),
                       ("--num-virtual-stages-per-pipeline-rank", int), ("--recompute-granularity", str),
                       ("--recompute-method", str), ("--recompute-num-layers", int)):
        ap.add_argument(flag, type=kind)
    return argparse.Namespace(micro_batch_size=1, bf16=True, transformer_impl="local",
                              **vars(ap.parse_args(shlex.split(flags))))


def _validate(flags: str):
    args = _parse(flags)
    return args, validate_zero_bubble_args(args, before_megatron_validation=True)


def test_counts_reach_the_model_and_the_schedule_costs():
    """Per chunk (pipeline order) and per rank (a V rank r: chunks r and 2P-1-r) say the same; the model
    the flags describe carries them, and each chunk is costed with its own recompute."""
    per_chunk, kw = _validate(f"{MODEL} --pipeline-model-parallel-size 4 --zero-bubble-schedule zb-v {BLOCK} "
                              f"{FLAG} 2,1,0,0,0,0,1,2")
    per_rank, kw_rank = _validate(f"{MODEL} --pipeline-model-parallel-size 4 --zero-bubble-schedule zb-v {BLOCK} "
                                  f"--recompute-num-layers 2 {FLAG} 2,1,0,0")
    assert per_chunk.recompute_num_layers == 2  # Megatron's count where not given: the largest
    spec = model_spec(per_chunk)
    assert (spec.recompute, spec.recompute_method, spec.recompute_counts) == ("full", "block", (2, 1, 0, 0, 0, 0, 1, 2))
    assert model_spec(per_rank).recompute_counts == (2, 1, 0, 0)
    costs = unit_costs(spec, None, Placement.vshape(4))
    assert kw["mem_f"] == costs.mem_f and kw["cost_b"] == costs.cost_b
    assert {k: kw_rank[k] for k in ("cost_f", "cost_b", "cost_w", "mem_f")} == \
        {k: kw[k] for k in ("cost_f", "cost_b", "cost_w", "mem_f")}
    plain = unit_costs(dataclasses.replace(spec, recompute=None, recompute_method=None, recompute_counts=None), None,
                       Placement.vshape(4))
    # a recomputing chunk keeps less from F to B and runs its forward again in B; the others as without
    assert kw["mem_f"][0] / kw["mem_f"][2] < plain.mem_f[0] / plain.mem_f[2]
    assert kw["cost_b"][0] / kw["cost_b"][2] > plain.cost_b[0] / plain.cost_b[2]
    # Megatron's own block method: every chunk its first N
    args, _ = _validate(f"{MODEL} --pipeline-model-parallel-size 4 --zero-bubble-schedule zb-h1 {BLOCK} "
                        "--recompute-num-layers 3")
    assert (model_spec(args).recompute_method, model_spec(args).recompute_num_layers) == ("block", 3)


@pytest.mark.parametrize("flags, msg", [
    (f"--zero-bubble-schedule zb-v {FLAG} 1,1,1,1", "add --recompute-granularity full --recompute-method block"),
    (f"--zero-bubble-schedule zb-v --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
     f"{FLAG} 1,1,1,1", "add --recompute-granularity full --recompute-method block"),
    (f"--zero-bubble-schedule zb-v {BLOCK} {FLAG} 1,1,1",
     f"{FLAG} has 3 values: give one per pipeline rank (4) or one per model chunk in pipeline order (8)"),
    (f"--zero-bubble-schedule zb-h1 {BLOCK} {FLAG} 1,1,1,1,1,1,1,1", "give one per pipeline rank (4)"),
    (f"--zero-bubble-schedule zb-v {BLOCK} {FLAG} 0,3,0,0",
     "asks 3 recomputed layers of model chunk 1 (pipeline rank 1), which holds 2"),
    (f"--zero-bubble-schedule zb-v {BLOCK} {FLAG} 1,-1,0,0", "takes layer counts >= 0"),
    (f"--zero-bubble-schedule zb-h1 {BLOCK} --allow-padding-num-layers --num-layers 14 {FLAG} 4,4,4,4",
     "model chunk 0 (pipeline rank 0), which holds 3"),  # the padded layout: 3, 4, 4, 3
    (f"--zero-bubble-schedule bitpipe {BLOCK} {FLAG} 1,1,1,1", "replicated stages (bitpipe)"),
    (f"{BLOCK} {FLAG} 1,1,1,1", f"{FLAG} needs a megatron-zb schedule"),
])
def test_bad_counts_one_line(flags, msg):
    with pytest.raises(ZeroBubbleArgumentError, match=re.escape(msg)) as ei:
        _validate(f"{MODEL} --pipeline-model-parallel-size 4 {flags}")
    assert "\n" not in str(ei.value)


def test_counts_that_are_not_integers_fail_at_parse(capsys):
    with pytest.raises(SystemExit):
        _parse(f"{MODEL} {FLAG} 1,a")
    assert f"{FLAG} takes layer counts" in capsys.readouterr().err


def test_verify_flag_and_bad_input(capsys):
    """verify takes the flag with Megatron's; a case holds one count per model chunk; what cannot apply is one
    line, exit 2."""
    from megatron_zb.verify.command import main_verify
    c = V.make_case("zb-v", 2, num_layers=8, recompute_granularity="full", recompute_method="block",
                    recompute_counts=[2, 0])
    assert c.recompute_counts == [2, 0, 0, 2] and "per-chunk=2,0,0,2" in c.describe()
    assert c.run_overrides()["recompute_method"] == "block" and "recompute_method" not in reference_overrides(c)
    base = ["--schedule", "zb-v", "-p", "2", "--num-layers", "8"]
    for argv, msg in [([FLAG, "1,1"], "add --recompute-granularity full --recompute-method block"),
                      (["--recompute-granularity", "full", "--recompute-method", "block", FLAG, "1,1,1"],
                       "has 3 values: give one per pipeline rank (2) or one per model chunk in pipeline order (4)"),
                      (["--recompute-granularity", "full", "--recompute-method", "block", FLAG, "0,0,3,0"],
                       "asks 3 recomputed layers of model chunk 2 (pipeline rank 1), which holds 2"),
                      (["--recompute-granularity", "full", "--recompute-method", "block", FLAG + "=-1,0"], ">= 0"),
                      (["--recompute-granularity", "full", "--recompute-method", "block", FLAG, "1,1", "--optimizer",
                        "adam"], "not covered with Megatron's optimizer")]:
        assert main_verify(base + argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert msg in err and len(err.splitlines()) == 1, err
    with pytest.raises(V.VerifyUsageError, match="replicated stages"):
        V.make_case("bitpipe", 2, num_layers=8, recompute_granularity="full", recompute_method="block",
                    recompute_counts=[1, 1])


# -- megatron: the chunks recompute, and verify is exact ---------------------------------------------

@pytest.mark.megatron
@pytest.mark.dist
def test_each_chunk_recomputes_its_own_first_layers(rank_pool, mcore_version):
    """Each chunk's first N layers run their forward twice (F, then again in B), the rest once; the
    gradients are those without recompute; a chunk with 0 runs as without recompute."""
    from tests import _recompute_fns
    cases = [("v", 2, None, 12, (3, 0, 1, 2)), ("looped", 2, 2, 8, (1, 2, 1, 2))]
    out = rank_pool(_recompute_fns.layer_calls_report, cases, 1, timeout=300)
    for case, ranks in zip(cases, out):
        rep = ranks[0]
        if mcore_version:
            assert rep["megatron_version"].startswith(mcore_version)
        counts = case[-1]
        assert [c["recomputed"] for c in rep["chunks"]] == list(counts), rep["chunks"]
        for c in rep["chunks"]:
            want = [2 if k < counts[c["stage"]] else 1 for k in range(len(c["layers"]))]
            assert [rep["calls"][layer] for layer in c["layers"]] == want, (case, c)
            assert not c["shares_config"]
        assert set(rep["plain_calls"].values()) == {1}
        assert rep["same_params"] and rep["max_abs_grad_diff"] <= 1e-6, rep["max_abs_grad_diff"]


@pytest.mark.megatron
@pytest.mark.dist
def test_verify_recompute_per_chunk_is_exact(mcore_path, mcore_version):
    """World size 2 (PP=2): counts per model chunk under zb-v and interleaved-zb, per rank under zb-v and
    zb-h1, and Megatron's own block method under zb-v and zb-h1 (its uniform method:
    tests/test_moe_recompute.py); loss and every gradient equal to the non-pipelined reference."""
    block = dict(recompute_granularity="full", recompute_method="block", num_microbatches=4, iterations=2)
    cases = [V.make_case("zb-v", 2, num_layers=8, recompute_counts=[2, 1, 0, 2], label="per chunk", **block),
             V.make_case("interleaved-zb", 2, num_layers=8, recompute_counts=[1, 2, 0, 2], label="per chunk",
                         **block),
             V.make_case("zb-v", 2, num_layers=8, recompute_counts=[1, 0], label="per rank", **block),
             V.make_case("zb-h1", 2, num_layers=4, recompute_counts=[2, 1], label="per rank", **block),
             V.make_case("zb-v", 2, num_layers=8, recompute_num_layers=1, label="megatron's block", **block),
             V.make_case("zb-h1", 2, num_layers=4, recompute_num_layers=1, label="megatron's block", **block)]
    results = V.run_verify_many(cases, timeout=900, mcore_path=mcore_path)
    bad = [f"{r['case']}: {r.get('error') or r.get('problems')} rel={r.get('max_rel_grad_diff')} "
           f"loss={r.get('max_abs_loss_diff')}" for r in results if not r["passed"]]
    assert not bad, "\n".join(bad)
    for r in results:
        assert r["max_rel_grad_diff"] <= 1e-5, r["case"]
        assert not mcore_version or r["megatron_core"].startswith(mcore_version), (r["case"], r["megatron_core"])
