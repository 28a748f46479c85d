"""``--enable-vocab-parallel`` and the VocabularyParallelism fork's flags in training (issue 33):
what they install (barriers, every chunk's costs without the output layer, the vocabulary passes'
costs from the model) and what they refuse, in one line each. No torch, no megatron."""
import pytest

from megatron_zb.megatron.launch.flags import ZeroBubbleArgumentError
from megatron_zb.megatron.execution.options import ScheduleOptions, preview
from tests.test_args import BASE, validate

LLAMA = ("--pipeline-model-parallel-size 4 --num-layers 16 --hidden-size 2048 --num-attention-heads 32 "
         "--seq-length 4096 --vocab-size 128256")


def test_the_flag_alone_runs_the_forks_1f1b_with_one_barrier():
    args, kw = validate(LLAMA + " --enable-vocab-parallel")
    assert kw["schedule"] == "1f1b" and kw["vocab_parallel"] == 1
    vc = kw["vocab_costs"]
    assert set(vc) == {"cost_s", "cost_t", "cost_w", "cost_comm", "mem_s", "mem_w"}
    # the loss's chunk lost its output layer: every stage's F equal up to the embedding's share
    assert max(kw["cost_f"]) == pytest.approx(1.0) and min(kw["cost_f"]) > 0.95
    # the output layer is about a sixth of the FLOPs here: over 4 ranks a VS (its F and B) about half a stage's F
    assert 0.3 < vc["cost_s"][0] < 1.0
    _, kw2 = validate(LLAMA + " --enable-vocab-parallel --disable-backward-fusion")
    assert kw2["vocab_parallel"] == 2
    # the input embedding split too: VI/VG and their collectives in the costs, the flag to install()
    _, kw3 = validate(LLAMA + " --enable-vocab-parallel --split-vocab-embedding")
    assert kw3["vocab_embedding"] and kw3["vocab_costs"]["embedding"] and kw3["vocab_costs"]["mem_i"] > 0
    built, _ = preview(ScheduleOptions(**kw3), 4, 16)
    assert {"VI", "VG"} <= {a.kind for o in built.schedule.orders for a in o}


def test_any_family_with_it_simulates_with_the_passes():
    for name in ("zb-h1", "zb-v", "v-half", "zb-auto"):
        _, kw = validate(LLAMA + f" --zero-bubble-schedule {name} --enable-vocab-parallel")
        built, base = preview(ScheduleOptions(**kw), 4, 16)
        kinds = {a.kind for o in built.schedule.orders for a in o}
        assert {"VS", "VT", "VW"} <= kinds, name
        if name != "v-half":  # (half of 1F1B's activation memory may cost time)
            assert base is not None and built.result.bubble_rate <= base.bubble_rate + 1e-9, name


def test_with_activation_offload_the_passes_and_the_copies_are_placed_together():
    for extra in ("--cpu-offload", "--zero-bubble-offload-ratio 0.5", "--split-vocab-embedding --cpu-offload"):
        _, kw = validate(LLAMA + f" --zero-bubble-schedule zb-v --enable-vocab-parallel --offload-time 0.5 {extra}")
        assert kw["vocab_parallel"] == 1 and kw["offload_ratio"] in (1.0, 0.5), extra
        built, _ = preview(ScheduleOptions(**kw), 4, 16)
        kinds = {a.kind for o in built.schedule.orders for a in o}
        assert {"VS", "VT", "VW", "OFFLOAD", "RELOAD"} <= kinds, (extra, kinds)


@pytest.mark.parametrize("extra,message", [
    ("--disable-backward-fusion", "--disable-backward-fusion is a setting of vocabulary parallelism"),
    ("--split-vocab-embedding", "--split-vocab-embedding is a setting of vocabulary parallelism"),
    ("--use-interlaced-schedule", "--use-interlaced-schedule is not available in megatron-zb"),
    ("--enable-vocab-parallel --sequence-parallel", "cannot be combined with --sequence-parallel"),
    ("--enable-vocab-parallel --zero-bubble-schedule bitpipe", "replicated stages"),
])
def test_what_it_cannot_run_is_refused_in_one_line(extra, message):
    with pytest.raises(ZeroBubbleArgumentError, match=message) as e:
        validate(BASE + " " + extra)
    assert "\n" not in str(e.value)


def test_a_padded_vocabulary_that_cannot_split_is_refused():
    args_line = BASE.replace("--pipeline-model-parallel-size 4", "--pipeline-model-parallel-size 3").replace(
        "--num-layers 16", "--num-layers 18")
    with pytest.raises(ZeroBubbleArgumentError, match="multiple of 3 .*e.g. 384"):
        validate(args_line + " --enable-vocab-parallel")
