"""Model placement: layer assignment, first/last-stage flags, global names, V placement.

The pure-Python part needs no megatron. The megatron part builds every rank's chunks of several
placements (V included) inside one process, runs them back to back in stage order and checks
they are the reference model: same layers (megatron's own layer numbers), same initial weights
(by global name), same losses and gradients (tied embedding copies summed as finalize does).
"""
from __future__ import annotations

import pytest

from megatron_zb.core.ir import Placement, ScheduleError
from megatron_zb.megatron.layout import placement as P
from megatron_zb.verify.model import tinygpt as M


# -- pure Python -------------------------------------------------------------------------------

def test_stage_layer_counts_even_padded_explicit():
    assert P.stage_layer_counts(8, 4) == [2, 2, 2, 2]
    assert P.stage_layer_counts(6, 4, allow_padding_num_layers=True) == [1, 2, 2, 1]
    assert P.stage_layer_counts(4, 2, allow_padding_num_layers=True) == [2, 2]  # even: no padding
    assert P.stage_layer_counts(14, 8, allow_padding_num_layers=True) == [1, 2, 2, 2, 2, 2, 2, 1]
    assert P.stage_layer_counts(5, 3, layers_per_stage=[1, 3, 1]) == [1, 3, 1]
    assert [list(r) for r in P.stage_layer_ranges(6, 4, allow_padding_num_layers=True)] == [[0], [1, 2], [3, 4], [5]]


@pytest.mark.parametrize("kw, msg", [
    (dict(num_layers=6, num_stages=4), "allow_padding_num_layers"),
    (dict(num_layers=7, num_stages=4, allow_padding_num_layers=True), "+ 2"),
    (dict(num_layers=5, num_stages=3, layers_per_stage=[1, 1, 1]), "sum"),
    (dict(num_layers=5, num_stages=3, layers_per_stage=[5]), "one per stage"),
])
def test_stage_layer_counts_errors(kw, msg):
    with pytest.raises(ScheduleError, match=msg.replace("+", r"\+")):
        P.stage_layer_counts(**kw)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_v_chunks(p):
    pl = P.make_placement("v", p)
    assert pl.stage_to_rank == Placement.vshape(p).stage_to_rank
    layers_seen = []
    for r in range(p):
        infos = P.chunk_infos(pl, 4 * p, r)
        assert [i.stage for i in infos] == [r, 2 * p - 1 - r]
        assert [i.vp_stage for i in infos] == [0, 1]
        # rank 0 holds both the embedding (stage 0) and the loss (stage 2p-1), in two chunks
        assert [i.pre_process for i in infos] == [r == 0, False]
        assert [i.post_process for i in infos] == [False, r == 0]
        for i in infos:
            assert list(i.layers) == list(range(2 * i.stage, 2 * i.stage + 2))
            layers_seen += list(i.layers)
    assert sorted(layers_seen) == list(range(4 * p))


def test_looped_and_single_chunks():
    pl = P.make_placement("looped", 2, 3)
    assert [i.stage for i in P.chunk_infos(pl, 6, 1)] == [1, 3, 5]
    assert [i.post_process for i in P.chunk_infos(pl, 6, 1)] == [False, False, True]
    assert [i.pre_process for i in P.chunk_infos(pl, 6, 0)] == [True, False, False]
    single = P.make_placement("single", 3)
    assert [(i.stage, list(i.layers)) for i in P.chunk_infos(single, 7, 1, layers_per_stage=[2, 3, 2])] == [(1, [2, 3, 4])]
    with pytest.raises(ScheduleError):
        P.make_placement("v", 2, chunks=3)
    with pytest.raises(ScheduleError):
        P.make_placement("zigzag", 2)


def test_global_param_names():
    info = P.ChunkInfo(stage=2, vp_stage=1, rank=1, layers=(5, 6), pre_process=False, post_process=True, num_stages=3)
    assert P.global_param_name("decoder.layers.1.mlp.linear_fc1.weight", info, True) == "decoder.layers.6.mlp.linear_fc1.weight"
    assert P.global_param_name("module.decoder.layers.0.input_layernorm.bias", info, True) == "decoder.layers.5.input_layernorm.bias"
    # the output layer of a tied model is a copy of the word embedding
    assert P.global_param_name("output_layer.weight", info, True) == "embedding.word_embeddings.weight"
    assert P.global_param_name("output_layer.weight", info, False) == "output_layer.weight"
    assert P.global_param_name("decoder.final_layernorm.weight", info, True) == "decoder.final_layernorm.weight"


def test_init_depends_only_on_global_name():
    import torch
    a = P.init_tensor("decoder.layers.3.mlp.linear_fc1.weight", (8, 4))
    b = P.init_tensor("decoder.layers.3.mlp.linear_fc1.weight", (8, 4))
    c = P.init_tensor("decoder.layers.4.mlp.linear_fc1.weight", (8, 4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert abs(float(P.init_tensor("decoder.final_layernorm.weight", (64,)).mean()) - 1.0) < 0.1


def test_batches_are_deterministic():
    import torch
    cfg = M.TinyGPTConfig(variable_seq_lengths=True)
    a, b = M.make_batches(cfg, 4, 2), M.make_batches(cfg, 4, 2)
    for x, y in zip(a, b):
        for k in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(x[k], y[k])
    assert all(x["tokens"].shape[1] % 4 == 0 for x in a)
    assert torch.equal(a[0]["labels"][:, :-1], a[0]["tokens"][:, 1:])
    assert not torch.equal(M.make_batches(cfg, 1, 0)[0]["tokens"][:, :8], M.make_batches(cfg, 1, 1)[0]["tokens"][:, :8])


# -- megatron, one process --------------------------------------------------------------------

@pytest.fixture(scope="module")
def report(rank_pool):
    from tests import _harness_fns
    return rank_pool(_harness_fns.placement_report, [None], 1, timeout=240)[0][0]


@pytest.mark.megatron
def test_reports_requested_megatron(report, mcore_version):
    if mcore_version:
        assert report["megatron_version"].startswith(mcore_version)


@pytest.mark.megatron
def test_placements_equal_reference(report):
    for pl in report["placements"]:
        name = pl["spec"]
        assert not pl["missing"] and not pl["extra"], name
        assert pl["init_max_abs_diff"] == 0.0, name  # identical weights by global name
        assert [n for _, n in pl["losses"]] == [n for _, n in pl["ref_losses"]], name
        assert [l for l, _ in pl["losses"]] == pytest.approx([l for l, _ in pl["ref_losses"]], rel=1e-6), name
        assert pl["max_rel_grad_diff"] < 1e-5, name


@pytest.mark.megatron
def test_v_layer_numbers_and_pre_post(report):
    v4 = next(pl for pl in report["placements"] if pl["spec"] == dict(style="v", p=4, num_layers=8))
    assert v4["stage_to_rank"] == [0, 1, 2, 3, 3, 2, 1, 0]
    for st in v4["stages"]:
        s = st["stage"]
        assert st["layers"] == [s]
        assert st["layer_numbers"] == [s + 1]  # megatron's 1-based global layer_number, not looped
        assert st["has_embedding"] == (s == 0) and st["pre"] == (s == 0)
        assert st["has_output_layer"] == (s == 7) and st["post"] == (s == 7)
        assert st["has_final_norm"] == (s == 7)
        assert st["rank"] == (s if s < 4 else 7 - s)
    # rank 0 holds the embedding in chunk 0 and the tied output copy in chunk 1
    first, last = v4["stages"][0], v4["stages"][7]
    assert (first["rank"], first["vp_stage"], last["rank"], last["vp_stage"]) == (0, 0, 0, 1)
    assert "embedding.word_embeddings.weight" in first["params"] and "embedding.word_embeddings.weight" in last["params"]
    assert v4["copies"] == {"embedding.word_embeddings.weight": 2}


@pytest.mark.megatron
def test_uneven_layers(report):
    pad = next(pl for pl in report["placements"] if pl["spec"].get("allow_padding_num_layers"))
    assert [st["layers"] for st in pad["stages"]] == [[0], [1, 2], [3, 4], [5]]
    assert [st["layer_numbers"] for st in pad["stages"]] == [[1], [2, 3], [4, 5], [6]]
    looped = next(pl for pl in report["placements"] if pl["spec"]["style"] == "looped")
    assert [st["layers"] for st in looped["stages"]] == [[0], [1, 2], [3, 4], [5], [6, 7], [8]]
    assert [st["rank"] for st in looped["stages"]] == [0, 1, 0, 1, 0, 1]


@pytest.mark.megatron
def test_untied_v_has_separate_output_weight(report):
    untied = next(pl for pl in report["placements"] if pl["spec"].get("tie_embeddings") is False)
    assert "output_layer.weight" in untied["stages"][-1]["params"]
    assert untied["copies"] == {}


@pytest.mark.megatron
def test_other_configs_keep_megatrons_layer_offsets(report):
    ft = report["fallthrough"]
    assert ft["wrapped"]
    assert ft["offsets"] == [0, 2, 4, 6] and ft["counts"] == [2, 2, 2, 2]
