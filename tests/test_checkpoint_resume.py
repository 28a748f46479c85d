"""A megatron-core checkpoint saved mid-run and resumed gives the same losses as the uninterrupted run.

Real megatron-core distributed checkpointing (``dist_checkpointing.save``/``load`` of each chunk's
``sharded_state_dict()``, ``model0``/``model1`` per chunk as megatron.training does) on gloo CPU
ranks, with megatron-zb schedules installed into ``get_forward_backward_func()``. The resumed model
is rebuilt with different initial weights before loading, so the checkpoint must carry every
parameter (including V placement's two chunks per rank and the tied output-layer copy) under its
global name. One case also checkpoints megatron's own optimizer (Adam: its moments and step must
come back). Rank code: ``tests/_ckpt_fns.py``.
"""
from __future__ import annotations

import os
import tempfile

import pytest

from tests import _ckpt_fns

pytestmark = [pytest.mark.megatron, pytest.mark.dist]

ITERATIONS, SPLIT = 4, 2
# losses: exact in practice (same CPU kernels, same order); the tolerance only guards reordering.
LOSS_ATOL, PARAM_ATOL = 1e-6, 1e-6


def _case(label, schedule, pp, placement, tp=1, chunks=None, ddp=False, optimizer=False):
    return {"label": label, "schedule": schedule, "pp": pp, "tp": tp, "placement": placement, "chunks": chunks,
            "ddp": ddp, "optimizer": optimizer, "num_microbatches": 4, "iterations": ITERATIONS, "split": SPLIT,
            "lr": 0.1, "adam_lr": 1e-2}


def _run(rank_pool, cases, world_size):
    """[(case, results per rank)] of one launch."""
    with tempfile.TemporaryDirectory(prefix="mzb-ckpt-") as tmp:
        for i, c in enumerate(cases):
            c["ckpt_dir"] = os.path.join(tmp, f"case{i}")
            c["last"] = i == len(cases) - 1  # the writer's Manager lives from the first save to the last case
        results = rank_pool(_ckpt_fns.resume_case, cases, world_size, timeout=600)
    return list(zip(cases, results))


def _check(case, ranks, mcore_version):
    tag = case["label"]
    if mcore_version:
        assert {r["megatron_version"].split("+")[0] for r in ranks} == {mcore_version}, tag  # 0.19.2+<sha>
    reporters = [r for r in ranks if r["full_losses"]]
    assert len(reporters) == 1, f"{tag}: expected one rank reporting losses"
    rep = reporters[0]
    full = rep["full_losses"]
    assert sorted(full) == list(range(ITERATIONS)), tag
    assert sorted(rep["first_losses"]) == list(range(SPLIT)), tag
    assert sorted(rep["resumed_losses"]) == list(range(SPLIT, ITERATIONS)), tag
    # the loss must move, or equal losses prove nothing
    assert abs(full[ITERATIONS - 1] - full[0]) > 1e-3, f"{tag}: training does not change the loss {full}"
    for it in range(SPLIT):
        assert rep["first_losses"][it] == pytest.approx(full[it], abs=LOSS_ATOL), f"{tag} iteration {it}"
    for it in range(SPLIT, ITERATIONS):
        assert rep["resumed_losses"][it] == pytest.approx(full[it], abs=LOSS_ATOL), \
            f"{tag} iteration {it}: resumed {rep['resumed_losses'][it]!r} vs uninterrupted {full[it]!r}"
    assert any(f.endswith(".distcp") for f in ranks[0]["ckpt_files"]), f"{tag}: {ranks[0]['ckpt_files']}"
    # megatron's checkpoint writer keeps a spawn Manager process per rank: it runs from the launch's
    # first save on (as in one training), and the launch's last case stops it on every rank
    writers = [r for r in ranks if r["writer_processes"]]
    assert writers, f"{tag}: no checkpoint writer process"
    if case["last"]:
        for r in ranks:
            assert r["children_after_stop"] == [], f"{tag}: still running {r['children_after_stop']}"
        assert all(r["writer_stopped"] == 1 for r in writers), tag
    else:
        assert all(r["writer_stopped"] == 0 and r["children_after_stop"] == r["writer_processes"]
                   for r in ranks), tag
    holders = [r for r in ranks if r["num_params"]]  # TP rank 0 of each pipeline rank
    names = set()
    for r in holders:
        names.update(r["param_names"])
        # the rebuilt model really started elsewhere, and the load put the saved weights back exactly
        assert r["diff_before_load"] > 1e-3, f"{tag} rank {r['rank']}: rebuilt weights equal the saved ones"
        assert r["diff_after_load"] == 0.0, f"{tag} rank {r['rank']}: loaded weights differ by {r['diff_after_load']}"
        tol = case.get("param_atol", PARAM_ATOL)
        assert r["diff_final"] <= tol, f"{tag} rank {r['rank']}: final params differ by {r['diff_final']}"
        if case["optimizer"] and r["diff_opt_state"] is not None:  # Adam's moments and step came back exactly
            assert r["opt_state_abs"] > 0.0, f"{tag} rank {r['rank']}: empty optimizer state"
            assert r["diff_opt_state"] == 0.0, f"{tag} rank {r['rank']}: optimizer state differs after load"
    assert "embedding.word_embeddings.weight" in names and "decoder.final_layernorm.weight" in names, tag
    assert {n for n in names if n.startswith("decoder.layers.")} >= {f"decoder.layers.{i}.mlp.linear_fc1.weight"
                                                                     for i in range(4)}, tag


def _vp(label, vocab, resume_vocab, untied=True, emb=False, resume_emb=False, **kw):
    c = _case(label, "zb-v", 2, "v", chunks=2, **kw)
    c.update(vocab=vocab, resume_vocab=resume_vocab, untied=untied, emb=emb, resume_emb=resume_emb)
    return c


PP2 = [
    _case("zb-h1 pp2", "zb-h1", 2, "single"),
    _case("zb-v pp2", "zb-v", 2, "v", chunks=2),
    # DDP's buffers in the checkpoint, and megatron's optimizer state on top (this case asserts
    # everything a DDP case without the optimizer did: it replaced one, a checkpoint save and
    # load per rank less)
    _case("zb-v pp2 ddp + megatron adam", "zb-v", 2, "v", chunks=2, ddp=True, optimizer=True),
]
# --enable-vocab-parallel (issue 33): saved with it, resumed with it (tied, Adam); saved with it, resumed
# without it and the other way round (untied: the shards are the output layer's rows, torch_dist reshards them)
VOCAB = [_vp("zb-v pp2 vocab-parallel tied + adam", 1, 1, untied=False, ddp=True, optimizer=True),
         _vp("zb-v pp2 vocab-parallel -> without, tied", 2, None, untied=False),
         # the resumed half computes the output layer as shards: Adam magnifies its rounding differences
         # (the loaded weights are equal exactly; every loss within LOSS_ATOL)
         dict(_vp("zb-v pp2 without -> vocab-parallel, untied + adam", None, 1, ddp=True, optimizer=True),
              param_atol=1e-4),
         # --split-vocab-embedding: its input rows saved as the embedding's (tied: the shard under both names)
         _vp("zb-v pp2 split embedding -> whole, untied", 1, 1, emb=True),
         _vp("zb-v pp2 vocab-parallel -> split embedding, tied", 1, 1, untied=False, resume_emb=True)]


@pytest.fixture(scope="module")
def pp2_runs(rank_pool):
    """Every PP=2 case (world size 2) in one launch: {label: (the case as launched, results per rank)}."""
    return {c["label"]: (c, ranks) for c, ranks in _run(rank_pool, [dict(c) for c in PP2 + VOCAB], 2)}


@pytest.mark.parametrize("case", PP2, ids=lambda c: c["label"])
def test_resume_from_megatron_checkpoint_pp2(pp2_runs, case, mcore_version):
    _check(*pp2_runs[case["label"]], mcore_version)


@pytest.mark.parametrize("case", VOCAB, ids=lambda c: c["label"])
def test_resume_across_vocabulary_parallelism(pp2_runs, case, mcore_version):
    _check(*pp2_runs[case["label"]], mcore_version)


def test_resume_from_megatron_checkpoint_tp2_pp2(rank_pool, mcore_version):
    for case, ranks in _run(rank_pool, [_case("zb-h1 tp2 pp2", "zb-h1", 2, "single", tp=2)], 4):
        _check(case, ranks, mcore_version)
