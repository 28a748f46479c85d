"""The placement record checkpoints carry, and its check on load (pure functions; the end-to-end
runs are in tests/test_pretrain_faults.py)."""
from __future__ import annotations

from argparse import Namespace

import pytest

from megatron_zb.megatron.layout import checkpoint_placement as CP
from megatron_zb.megatron.convert_checkpoint import ConvertError, convert
from megatron_zb.megatron.layout.placement import make_placement


def _rec(style, p=2, chunks=None, layers=4, schedule="x"):
    return CP.record(make_placement(style, p, chunks), layers, schedule)


def test_the_record_lists_each_stage_with_its_rank_chunk_and_global_layers():
    r = _rec("v", schedule="zb-v")
    assert r["stages"] == [[0, 0, [0]], [1, 0, [1]], [1, 1, [2]], [0, 1, [3]]]
    assert (r["schedule"], r["style"], r["pipeline_size"], r["chunks"], r["num_layers"]) == ("zb-v", "v", 2, 2, 4)
    assert CP.describe(r) == "zb-v, v placement, PP=2 (rank 0: layers 0 + 3, rank 1: layers 1 + 2)"
    assert _rec("looped", chunks=2, schedule="interleaved-1f1b")["stages"] == \
        [[0, 0, [0]], [1, 0, [1]], [0, 1, [2]], [1, 1, [3]]]


def test_same_placement_loads_silently_even_under_another_schedule_name():
    assert CP.check(_rec("single", schedule="zb-h1"), _rec("single", schedule="1f1b"), "torch") is None
    assert CP.check(None, _rec("single"), "torch") is None  # nothing known about the checkpoint


def test_torch_dist_maps_another_placement_with_a_note():
    note = CP.check(_rec("v", schedule="zb-v"), _rec("single", schedule="1f1b"), "torch_dist", where="checkpoint c")
    assert note.startswith("megatron-zb: checkpoint c was saved with zb-v, v placement")
    assert "maps layers by their global names" in note and "\n" not in note


def test_a_per_rank_format_with_another_placement_is_refused_naming_both_and_the_ways_out():
    with pytest.raises(CP.CheckpointPlacementError) as info:
        CP.check(_rec("v", schedule="zb-v"), _rec("looped", chunks=2, schedule="interleaved-1f1b"), "torch")
    msg = str(info.value)
    assert "saved with zb-v, v placement" in msg and "this run uses interleaved-1f1b, looped placement" in msg
    assert "--ckpt-format torch_dist" in msg and "--to-schedule interleaved-1f1b --chunks 2" in msg
    assert "\n" not in msg
    with pytest.raises(CP.CheckpointPlacementError, match="with the saving run's pipeline size"):
        CP.check(_rec("single", p=4, layers=8), _rec("single", p=2, layers=8), "torch")


def test_vocabulary_parallelism_on_one_side_only():
    """torch_dist maps the shards to the output layer's rows both ways, except into shards from a
    tied run without it (it saved no output layer); a per-rank format maps nothing. One line each."""
    vp = lambda tied: CP.record(make_placement("v", 2), 4, "zb-v", vocab_parallel={"barriers": 1, "tied": tied})  # noqa
    plain = _rec("v", schedule="zb-v")
    for saved, current in ((vp(True), plain), (vp(False), plain), (plain, vp(False)), (vp(True), vp(True))):
        assert CP.check(saved, current, "torch_dist") is None
    with pytest.raises(CP.CheckpointPlacementError, match="saved without --enable-vocab-parallel and with tied "
                                                          "embeddings") as info:
        CP.check(plain, vp(True), "torch_dist")
    assert "\n" not in str(info.value)
    with pytest.raises(CP.CheckpointPlacementError, match="per-rank 'torch' format.*resume with --enable-vocab"):
        CP.check(vp(False), plain, "torch")
    args = Namespace(pipeline_model_parallel_size=2, num_layers=4, virtual_pipeline_model_parallel_size=None,
                     enable_vocab_parallel=True, zero_bubble_resolved_schedule="1f1b",
                     untie_embeddings_and_output_weights=True, disable_backward_fusion=True)
    assert CP.record_from_args(args)["vocab_parallel"] == {"barriers": 2, "tied": False}


def test_checkpoints_without_a_record_get_the_placement_their_arguments_imply():
    args = Namespace(pipeline_model_parallel_size=2, num_layers=4, virtual_pipeline_model_parallel_size=None)
    assert CP.record_from_args(args)["style"] == "single"
    args.virtual_pipeline_model_parallel_size = 2
    assert CP.record_from_args(args)["style"] == "looped"
    args.zero_bubble_placement, args.zero_bubble_resolved_schedule = "v", "zb-v"  # megatron-zb before records
    assert CP.same_placement(CP.record_from_args(args), _rec("v"))
    assert CP.record_from_args(Namespace()) is None


def test_the_conversion_refuses_what_it_cannot_convert(tmp_path):
    with pytest.raises(ConvertError, match="no latest_checkpointed_iteration.txt"):
        convert(str(tmp_path), str(tmp_path / "out"), "1f1b")
    it = tmp_path / "iter_0000002"
    it.mkdir()
    (it / "common.pt").write_bytes(b"")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    with pytest.raises(ConvertError, match="torch_dist checkpoint: it maps layers by global names"):
        convert(str(tmp_path), str(tmp_path / "out"), "1f1b")
