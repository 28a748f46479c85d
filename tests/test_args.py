"""megatron-zb's command-line flags (ours and the ZB authors' fork's): parsing, validation, errors.

Most tests use a bare argparse parser with a few Megatron-like arguments (no torch, no megatron);
the last ones (marked ``megatron``) check the flags inside Megatron's own parser.
"""
import argparse
import re

import pytest

from megatron_zb.core import schedules as core_schedules
from megatron_zb.megatron.launch.args import NOT_AVAILABLE_FLAGS, add_zero_bubble_args, chain_providers
from megatron_zb.megatron.errors import ZeroBubbleArgumentError
from megatron_zb.megatron.launch.flags import memory_limit_in_microbatches, optimizer_offload_flags, validate_zero_bubble_args
from megatron_zb.megatron.execution.options import ScheduleOptions, preview


def preview_schedule(kwargs, p, m):
    """The simulated preview of what the flags install, and 1F1B's."""
    built, base = preview(ScheduleOptions(**kwargs), p, m)
    return built.result, base


def _megatron_like(parser):
    """The Megatron arguments validation looks at (names and defaults as in megatron.training)."""
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--hidden-size", type=int, default=None)
    parser.add_argument("--num-attention-heads", type=int, default=None)
    parser.add_argument("--seq-length", type=int, default=None)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--transformer-impl", default="transformer_engine")
    parser.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    parser.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None)
    parser.add_argument("--pipeline-model-parallel-layout", default=None)
    parser.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None)
    parser.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None)
    parser.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm")
    parser.add_argument("--overlap-moe-expert-parallel-comm", action="store_true")
    parser.add_argument("--defer-embedding-wgrad-compute", action="store_true")
    parser.add_argument("--cuda-graph-impl", default="none")
    parser.add_argument("--save", default=None)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--hidden-dropout", type=float, default=0.1)
    parser.add_argument("--attention-dropout", type=float, default=0.1)
    parser.add_argument("--vocab-size", type=int, default=None)
    return parser


def parse(cmd):
    parser = argparse.ArgumentParser(allow_abbrev=False)
    chain_providers(_megatron_like, add_zero_bubble_args)(parser)
    return parser.parse_args(cmd.split())


def validate(cmd, **kw):
    args = parse(cmd)
    return args, validate_zero_bubble_args(args, before_megatron_validation=kw.pop("before", True), **kw)


BASE = "--pipeline-model-parallel-size 4 --num-layers 16 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048"


# -- chaining -----------------------------------------------------------------------------------

def test_chain_providers_applies_in_order_and_skips_none():
    calls = []

    def a(parser):
        calls.append("a")
        parser.add_argument("--a", default=1)
        return parser

    def b(parser):  # modifies in place, returns None
        calls.append("b")
        parser.add_argument("--b", default=2)

    provider = chain_providers(None, a, None, b, add_zero_bubble_args)
    parser = provider(argparse.ArgumentParser())
    assert calls == ["a", "b"]
    args = parser.parse_args(["--zero-bubble-schedule", "zb-h1"])
    assert (args.a, args.b, args.zero_bubble_schedule) == (1, 2, "zb-h1")


# -- our flags ----------------------------------------------------------------------------------

def test_no_flag_means_megatron_schedules():
    args, kw = validate(BASE)
    assert kw is None and args.zero_bubble_resolved_schedule is None


def test_our_schedule_flag_gives_install_kwargs():
    _, kw = validate(BASE + " --zero-bubble-schedule zb-h1 --zero-bubble-timeout 60 --zero-bubble-cost-b 2 "
                            "--zero-bubble-cost-f 1,1,1,2 --zero-bubble-mem-w 0.3")
    assert kw == {"schedule": "zb-h1", "chunks": 1, "memory_limit": None, "timeout_s": 60.0, "cost_b": 2.0,
                  "cost_f": [1.0, 1.0, 1.0, 2.0], "mem_w": 0.3}


def test_unknown_schedule_fails_at_parse_with_the_known_list(capsys):
    with pytest.raises(SystemExit):
        parse(BASE + " --zero-bubble-schedule zb-x")
    err = capsys.readouterr().err
    assert "unknown schedule 'zb-x'; known schedules: " in err
    for name in ("1f1b", "zb-h1", "zb-v"):
        assert name in err


def test_memory_limit_microbatches_and_gb(monkeypatch):
    import megatron_zb.megatron.layout.model_args as model_args
    monkeypatch.setattr(model_args, "fused_attention", lambda args: True)  # as where TE is installed
    _, kw = validate(BASE + " --zero-bubble-schedule zb-auto --zero-bubble-memory-limit 6")
    # microbatches of the fullest rank's activation; each model chunk's own share (the even split:
    # the embedding beside the first stage's layers, the output layer and loss beside the last's)
    assert kw["memory_limit"] == 6 and max(kw["mem_f"]) == 1.0 and len(kw["mem_w"]) == 4
    args, kw = validate(BASE + " --bf16 --vocab-size 32000 --zero-bubble-schedule zb-auto --zero-bubble-memory-limit 20GB")
    # bf16: 4 layers per rank x s b (34 h + 5 a s) bytes (TE: flash attention drops the 5 a s term);
    # the fullest rank is the last: its layers and the loss's softmax and final norm (4 s b V + 4 s b h)
    s, h, v = 2048, 1024, 32000
    per_mb = 4 * s * 34 * h + 4 * s * v + 4 * s * h
    assert kw["memory_limit"] == pytest.approx(20e9 / per_mb)
    assert kw["mem_f"][3] == 1.0 and kw["mem_f"][0] < 1.0
    # a byte budget: W's share from the same model (each layer's 32 h of 34 h)
    assert kw["mem_w"][1] / kw["mem_f"][1] == pytest.approx(32 / 34)
    monkeypatch.undo()  # TE is not installed here: the local implementation keeps the attention scores
    args, kw = validate(BASE + " --hidden-dropout 0 --attention-dropout 0 --vocab-size 32000"
                        " --zero-bubble-schedule zb-auto --zero-bubble-memory-limit 4GiB")
    # fp32 (no --bf16), no dropout, local: scores stored (4 a s bytes), no SP: 16 e h + 4 a s per token
    per_mb = 4 * s * (64 * h + 4 * 16 * s) + 4 * s * v + 8 * s * h
    assert kw["memory_limit"] == pytest.approx(4 * 2 ** 30 / per_mb)
    assert memory_limit_in_microbatches(1, args, gib=True) == pytest.approx(2 ** 30 / per_mb)
    with pytest.raises(ZeroBubbleArgumentError, match="holds 0.0.* microbatches"):
        validate(BASE + " --zero-bubble-schedule zb-auto --zero-bubble-memory-limit 0.01GB")


@pytest.mark.parametrize("bad", ["abc", "-3", "0", "5TB"])
def test_memory_limit_syntax(bad, capsys):
    with pytest.raises(SystemExit):
        parse(BASE + f" --zero-bubble-memory-limit {bad}")
    assert "--zero-bubble-memory-limit" in capsys.readouterr().err


def test_profile_window_and_path():
    _, kw = validate(BASE + " --zero-bubble-schedule zb-auto --zero-bubble-profile-window 5 8 --save /ck")
    assert kw["profile_window"] == (5, 8) and kw["profile_path"] == "/ck/zero_bubble_profile.json"
    _, kw = validate(BASE + " --zero-bubble-schedule zb-h1 --zero-bubble-profile-window 1 2 "
                            "--zero-bubble-profile-path /tmp/p.json")
    assert kw["profile_path"] == "/tmp/p.json"
    with pytest.raises(ZeroBubbleArgumentError, match="need 1 <= START <= END"):
        validate(BASE + " --zero-bubble-schedule zb-h1 --zero-bubble-profile-window 9 3")
    with pytest.raises(ZeroBubbleArgumentError, match="needs a profiling window"):
        validate(BASE + " --zero-bubble-schedule zb-h1 --zero-bubble-profile-path /tmp/p.json")


def test_options_without_a_schedule_are_refused():
    with pytest.raises(ZeroBubbleArgumentError, match="--zero-bubble-memory-limit needs a megatron-zb schedule"):
        validate(BASE + " --zero-bubble-memory-limit 4")


# -- the fork's flags ---------------------------------------------------------------------------

def test_fork_enable_zero_bubble_is_zb_auto_with_max_pending_backward():
    args, kw = validate(BASE + " --enable-zero-bubble --zero-bubble-max-pending-backward 8 --enable-zb-runtime "
                               "--no-pre-communication-optimization")
    assert kw["schedule"] == "zb-auto" and kw["memory_limit"] == 8.0 and kw["chunks"] == 1
    _, kw = validate(BASE + " --enable-zero-bubble --zero-bubble-max-pending-backward auto")
    assert kw["schedule"] == "zb-auto" and kw["memory_limit"] is None


def test_fork_enable_zero_bubble_falls_back_to_zb_h1(monkeypatch):
    reg = dict(core_schedules.REGISTRY)
    reg.pop("zb-auto")
    monkeypatch.setattr(core_schedules, "REGISTRY", reg)
    _, kw = validate(BASE + " --enable-zero-bubble")
    assert kw["schedule"] == "zb-h1"


@pytest.mark.parametrize("setup,name", [(None, "zb-v"), ("zb", "zb-v"), ("half", "v-half"), ("min", "v-min")])
def test_fork_v_schedule_and_mem_setup(setup, name):
    cmd = BASE + " --enable-zero-bubble --zero-bubble-v-schedule --zero-bubble-max-pending-backward 3"
    if setup:
        cmd += f" --zero-bubble-v-schedule-mem-setup {setup}"
    args, kw = validate(cmd)
    assert kw["schedule"] == name and kw["chunks"] == 2
    assert kw["memory_limit"] is None  # ignored by V schedules, as in the fork
    assert args.num_virtual_stages_per_pipeline_rank == 2 and args.zero_bubble_placement == "v"


def test_fork_mem_setup_without_v_schedule():
    with pytest.raises(ZeroBubbleArgumentError, match="only applies with --zero-bubble-v-schedule"):
        validate(BASE + " --enable-zero-bubble --zero-bubble-v-schedule-mem-setup half")


def test_fork_schedule_the_core_does_not_have_yet(monkeypatch):
    reg = dict(core_schedules.REGISTRY)
    reg.pop("zb-v")
    monkeypatch.setattr(core_schedules, "REGISTRY", reg)
    with pytest.raises(ZeroBubbleArgumentError) as e:
        validate(BASE + " --zero-bubble-v-schedule")
    msg = str(e.value)
    assert "--zero-bubble-v-schedule selects schedule 'zb-v'" in msg and "known schedules: " in msg
    assert "zb-h1" in msg


def test_fork_timers_are_the_profiling_window():
    _, kw = validate(BASE + " --enable-zero-bubble --zero-bubble-pipeline-timers-start-iter 20 "
                            "--zero-bubble-pipeline-timers-end-iter 30")
    assert kw["profile_window"] == (20, 30)
    _, kw = validate(BASE + " --enable-zero-bubble --zero-bubble-pipeline-timers-start-iter 20")
    assert kw["profile_window"] == (20, 30)
    with pytest.raises(ZeroBubbleArgumentError, match="either --zero-bubble-profile-window or the fork"):
        validate(BASE + " --enable-zero-bubble --zero-bubble-pipeline-timers-end-iter 30 "
                        "--zero-bubble-profile-window 1 2")


def test_ours_and_fork_must_agree():
    _, kw = validate(BASE + " --zero-bubble-schedule zb-v --zero-bubble-v-schedule")
    assert kw["schedule"] == "zb-v"
    with pytest.raises(ZeroBubbleArgumentError, match="--zero-bubble-schedule zb-h1 conflicts with the fork's flags, "
                                                       "which select zb-v"):
        validate(BASE + " --zero-bubble-schedule zb-h1 --zero-bubble-v-schedule")
    with pytest.raises(ZeroBubbleArgumentError, match="disagree"):
        validate(BASE + " --enable-zero-bubble --zero-bubble-memory-limit 4 --zero-bubble-max-pending-backward 6")


@pytest.mark.parametrize("dest", sorted(NOT_AVAILABLE_FLAGS))
def test_features_not_built_yet_parse_and_then_fail(dest):
    flag, _ = NOT_AVAILABLE_FLAGS[dest]
    value = {"offload_chunk_num": " 2", "offload_time": " 0.2", "interleave_group_size": " 4",
             "num_seq_splits": " 2", "profile_memory_iter": " 3",
             "zero_bubble_adaptive_memory_limit_percentile": " 85"}.get(dest, "")
    args = parse(BASE + " --enable-zero-bubble " + flag + value)  # argparse accepts it
    with pytest.raises(ZeroBubbleArgumentError, match=f"{flag} is not available yet in megatron-zb"):
        validate_zero_bubble_args(args, before_megatron_validation=True)


def test_optimizer_post_validation_flag():
    _, kw = validate(BASE + " --enable-zero-bubble --enable-optimizer-post-validation")
    assert kw["post_validation"] is True
    _, kw = validate(BASE + " --zero-bubble-schedule zb-h2")
    assert "post_validation" not in kw
    with pytest.raises(ZeroBubbleArgumentError, match="--enable-optimizer-post-validation needs a megatron-zb "
                                                       "schedule"):
        validate(BASE + " --enable-optimizer-post-validation")
    parser = argparse.ArgumentParser(allow_abbrev=False)
    chain_providers(_megatron_like, add_zero_bubble_args)(parser)
    parser.add_argument("--overlap-param-gather", action="store_true")
    args = parser.parse_args((BASE + " --zero-bubble-schedule zb-v --enable-optimizer-post-validation "
                                     "--overlap-param-gather").split())
    with pytest.raises(ZeroBubbleArgumentError, match="cannot be combined with --overlap-param-gather"):
        validate_zero_bubble_args(args, before_megatron_validation=True)


def test_harmless_values_of_not_built_flags_pass():
    _, kw = validate(BASE + " --zero-bubble-schedule zb-h1 --num-seq-splits 1 --interleave-group-size 0 "
                            "--offload-chunk-num 0")
    assert kw["schedule"] == "zb-h1"


def test_fork_example_command_line_parses_unchanged():
    """The flags of the fork's examples/pretrain_zero_bubble.sh (ZB-V run), minus Megatron's own."""
    args, kw = validate(BASE + " --enable-zb-runtime --zero-bubble-v-schedule --enable-zero-bubble "
                               "--zero-bubble-pipeline-timers-start-iter 100 --zero-bubble-pipeline-timers-end-iter 110 "
                               "--zero-bubble-max-pending-backward 8 --allow-padding-num-layers")
    assert kw["schedule"] == "zb-v" and kw["profile_window"] == (100, 110)


# -- combinations -------------------------------------------------------------------------------

def test_pipeline_size_one_is_refused():
    with pytest.raises(ZeroBubbleArgumentError, match="needs pipeline parallelism: --pipeline-model-parallel-size is 1"):
        validate("--num-layers 4 --zero-bubble-schedule zb-h1")


def test_v_needs_even_layers_per_stage_unless_padding():
    with pytest.raises(ZeroBubbleArgumentError, match="V schedule zb-v needs an even number of layers per pipeline "
                                                       "stage: --num-layers 12 is not divisible by 2 x"):
        validate("--pipeline-model-parallel-size 4 --num-layers 12 --zero-bubble-schedule zb-v")
    args, kw = validate("--pipeline-model-parallel-size 4 --num-layers 14 --zero-bubble-schedule zb-v "
                        "--allow-padding-num-layers")
    assert kw["chunks"] == 2 and args.num_virtual_stages_per_pipeline_rank == 2
    with pytest.raises(ZeroBubbleArgumentError, match="needs --num-layers = k x 8 - 2"):
        validate("--pipeline-model-parallel-size 4 --num-layers 12 --zero-bubble-schedule zb-v "
                 "--allow-padding-num-layers")


def test_v_refuses_user_virtual_pipeline_and_reads_layouts_in_v_order():
    for extra in ("--num-layers-per-virtual-pipeline-stage 2", "--num-virtual-stages-per-pipeline-rank 4"):
        with pytest.raises(ZeroBubbleArgumentError, match="places 2 model chunks per rank in V order itself"):
            validate(BASE + " --zero-bubble-schedule v-half " + extra)
    # Megatron's layout flags: read per pipeline rank (first/last) or in pipeline order (the layout string)
    args, _ = validate(BASE + " --zero-bubble-schedule zb-v --decoder-first-pipeline-num-layers 2 "
                              "--decoder-last-pipeline-num-layers 6")
    assert args.zero_bubble_layers_per_stage == [1, 2, 2, 3, 3, 2, 2, 1]  # each rank's layers over its 2 chunks
    assert args.decoder_first_pipeline_num_layers is None  # taken over: Megatron would read it interleaved
    with pytest.raises(ZeroBubbleArgumentError, match="does not divide evenly"):
        validate(BASE + " --zero-bubble-schedule zb-v --decoder-first-pipeline-num-layers 3")
    with pytest.raises(ZeroBubbleArgumentError, match="has 4 stages; schedule zb-v runs 8 model chunks"):
        validate(BASE + " --zero-bubble-schedule zb-v --pipeline-model-parallel-layout E|t*8|t*8|L")


def test_v_after_megatron_validation_points_to_the_launcher():
    args = parse(BASE + " --zero-bubble-schedule zb-v")
    args.virtual_pipeline_model_parallel_size = None  # Megatron's validate_args has run
    with pytest.raises(ZeroBubbleArgumentError, match="python -m megatron_zb.run"):
        validate_zero_bubble_args(args)
    args = parse(BASE + " --zero-bubble-schedule zb-h1")
    args.virtual_pipeline_model_parallel_size = None
    assert validate_zero_bubble_args(args)["schedule"] == "zb-h1"  # detected: after Megatron


def test_padding_one_chunk_per_rank_sets_megatron_first_last_layers():
    args, kw = validate("--pipeline-model-parallel-size 4 --num-layers 14 --zero-bubble-schedule zb-h1 "
                        "--allow-padding-num-layers")
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == (3, 3)
    args, _ = validate("--pipeline-model-parallel-size 4 --num-layers 16 --zero-bubble-schedule zb-h1 "
                       "--allow-padding-num-layers")
    assert args.decoder_first_pipeline_num_layers is None  # even split: nothing to pad
    with pytest.raises(ZeroBubbleArgumentError, match="needs --num-layers = k x --pipeline-model-parallel-size - 2"):
        validate("--pipeline-model-parallel-size 4 --num-layers 13 --zero-bubble-schedule zb-h1 "
                 "--allow-padding-num-layers")
    with pytest.raises(ZeroBubbleArgumentError, match="sets the first and last stage's layer counts itself"):
        validate("--pipeline-model-parallel-size 4 --num-layers 14 --zero-bubble-schedule zb-h1 "
                 "--allow-padding-num-layers --decoder-first-pipeline-num-layers 2")


def test_one_chunk_schedules_refuse_virtual_pipeline():
    with pytest.raises(ZeroBubbleArgumentError, match="schedule zb-h1 runs one model chunk per rank"):
        validate(BASE + " --zero-bubble-schedule zb-h1 --num-layers-per-virtual-pipeline-stage 2")


def test_looped_schedules_need_megatron_virtual_pipeline():
    with pytest.raises(ZeroBubbleArgumentError, match="runs several model chunks per rank"):
        validate(BASE + " --zero-bubble-schedule interleaved-1f1b")
    _, kw = validate(BASE + " --zero-bubble-schedule interleaved-1f1b --num-layers-per-virtual-pipeline-stage 2")
    assert kw["chunks"] == 2
    _, kw = validate(BASE + " --zero-bubble-schedule looped-bfs --num-virtual-stages-per-pipeline-rank 4")
    assert kw["chunks"] == 4
    with pytest.raises(ZeroBubbleArgumentError, match="Megatron refuses a virtual pipeline at PP=2"):
        validate("--pipeline-model-parallel-size 2 --num-layers 8 --zero-bubble-schedule interleaved-1f1b "
                 "--num-layers-per-virtual-pipeline-stage 2 --no-overlap-p2p-communication")


@pytest.mark.parametrize("extra,flag", [
    ("--defer-embedding-wgrad-compute", "--defer-embedding-wgrad-compute"),
    ("--cuda-graph-impl full_iteration", "--cuda-graph-impl full_iteration"),
])
def test_conflicting_megatron_options(extra, flag):
    with pytest.raises(ZeroBubbleArgumentError, match=flag):
        validate(BASE + " --zero-bubble-schedule zb-h1 " + extra)


# -- schedule preview ---------------------------------------------------------------------------

def test_preview_simulates_and_refuses_an_impossible_memory_limit():
    unit = " --zero-bubble-cost-f 1 --zero-bubble-cost-b 1 --zero-bubble-cost-w 1"  # every stage alike
    _, kw = validate(BASE + " --zero-bubble-schedule zb-h1" + unit)
    sim, base = preview_schedule(kw, 4, 8)
    assert sim.makespan == 27 and base.makespan == 33  # the ZB paper's p=4, m=8 figures
    # without cost flags, each stage's share of the model (the last holds the output layer and loss)
    _, kw = validate(BASE + " --zero-bubble-schedule zb-h1")
    assert kw["cost_f"][3] == 1.0 and kw["cost_f"][1] == kw["cost_f"][2] < 1.0
    sim, base = preview_schedule(kw, 4, 8)
    assert sim.makespan < base.makespan
    _, kw = validate(BASE + " --zero-bubble-schedule zb-h2 --zero-bubble-memory-limit 4")
    with pytest.raises(ZeroBubbleArgumentError, match="schedule zb-h2 with pipeline size 4 and 8 microbatches"):
        preview_schedule(kw, 4, 8)


# -- inside Megatron's parser (megatron-core with megatron.training) ------------------------------

@pytest.fixture()
def megatron_parser():
    from megatron_zb.megatron.cpu import cpu_shims
    cpu_shims.apply()
    try:
        from megatron.training.arguments import add_megatron_arguments
    except ImportError as e:
        pytest.skip(f"this megatron-core has no megatron.training ({e}); run with MZB_MCORE=0.19.2")
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    return parser


@pytest.mark.megatron
def test_flags_do_not_collide_with_megatrons(megatron_parser):
    parser = chain_providers(add_zero_bubble_args)(megatron_parser)  # argparse raises on a clash
    args = parser.parse_args((BASE + " --micro-batch-size 1 --enable-zero-bubble --zero-bubble-v-schedule "
                              "--zero-bubble-v-schedule-mem-setup half --allow-padding-num-layers "
                              "--no-pre-communication-optimization --enable-zb-runtime").split())
    kw = validate_zero_bubble_args(args, before_megatron_validation=True)
    assert kw["schedule"] == "v-half" and args.num_virtual_stages_per_pipeline_rank == 2


@pytest.mark.megatron
def test_megatron_defaults_pass_validation(megatron_parser):
    """Megatron's real defaults (overlap_p2p_comm True, cuda_graph_impl 'none', ...) raise nothing."""
    parser = chain_providers(add_zero_bubble_args)(megatron_parser)
    args = parser.parse_args((BASE + " --zero-bubble-schedule zb-h1").split())
    assert validate_zero_bubble_args(args, before_megatron_validation=True)["schedule"] == "zb-h1"


@pytest.mark.megatron
def test_install_from_args_after_megatron_validation(megatron_parser):
    from megatron_zb.megatron.launch.from_args import install_from_args
    parser = chain_providers(add_zero_bubble_args)(megatron_parser)
    args = parser.parse_args((BASE + " --micro-batch-size 1 --zero-bubble-schedule zb-h1").split())
    args.virtual_pipeline_model_parallel_size = None  # as after Megatron's validate_args
    import megatron.core.pipeline_parallel as mpp
    before = mpp.get_forward_backward_func
    handle = install_from_args(args)
    try:
        assert mpp.get_forward_backward_func(pp_size=4, vp_size=None) is handle.forward_backward
        assert handle.forward_backward.options.schedule == "zb-h1"
    finally:
        handle.uninstall()
    assert mpp.get_forward_backward_func is before
    args = parser.parse_args(BASE.split())
    args.virtual_pipeline_model_parallel_size = None
    assert install_from_args(args) is None  # no zero-bubble flag: Megatron's schedules


@pytest.mark.megatron
def test_install_on_first_use_reads_megatrons_global_args(megatron_parser, monkeypatch):
    from megatron_zb.megatron.launch.from_args import install_on_first_use
    import megatron.training
    import megatron.training.training as T
    parser = chain_providers(add_zero_bubble_args)(megatron_parser)
    args = parser.parse_args((BASE + " --micro-batch-size 1 --enable-zero-bubble").split())
    args.virtual_pipeline_model_parallel_size = None
    monkeypatch.setattr(megatron.training, "get_args", lambda: args)
    original = T.get_forward_backward_func
    undo = install_on_first_use()
    try:
        fb = T.get_forward_backward_func(pp_size=4, vp_size=None)
        assert fb.options.schedule == "zb-auto"
        assert T.get_forward_backward_func(pp_size=4, vp_size=None) is fb
    finally:
        undo()
    assert T.get_forward_backward_func is original


def test_uneven_layers_need_padding():
    with pytest.raises(ZeroBubbleArgumentError, match="--num-layers 14 cannot be split evenly over 4 pipeline stages"):
        validate("--pipeline-model-parallel-size 4 --num-layers 14 --zero-bubble-schedule zb-h1")
    args, kw = validate("--pipeline-model-parallel-size 4 --num-layers 14 --zero-bubble-schedule zb-h1 "
                        "--decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 4")
    assert kw["schedule"] == "zb-h1"  # Megatron's own uneven split, which megatron-zb's layer table mirrors
    assert args.zero_bubble_layers_per_stage == [2, 4, 4, 4]
    with pytest.raises(ZeroBubbleArgumentError, match="other 2 pipeline ranks share 9 layers"):  # Megatron refuses it too
        validate("--pipeline-model-parallel-size 4 --num-layers 14 --zero-bubble-schedule zb-h1 "
                 "--decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 3")


# -- activation offload (the fork's flags and ours) -----------------------------------------------

def test_fork_offload_flags_keep_their_meaning():
    _, kw = validate(BASE + " --zero-bubble-v-schedule --num-layers 16 --cpu-offload --offload-chunk-num 1 "
                            "--offload-time 0.5 --offload-overlap-sr --offload-continuous-buffers --no-paired-barrier")
    assert (kw["offload_ratio"], kw["offload_time"], kw["offload_chunks"], kw["offload_overlap"]) == (1.0, 0.5, 1, True)
    assert kw["offload_cpu_test"] is False
    _, kw = validate(BASE + " --zero-bubble-schedule zb-h1 --zero-bubble-offload-ratio 0.5 --auto-offload-time "
                            "--zero-bubble-offload-half-duplex --zero-bubble-offload-cpu-test")
    assert (kw["offload_ratio"], kw["offload_time"], kw["offload_overlap"], kw["offload_cpu_test"]) == \
        (0.5, "auto", False, True)
    _, kw = validate(BASE + " --zero-bubble-schedule zb-auto --zero-bubble-offload-ratio auto "
                            "--zero-bubble-memory-limit 2")
    assert kw["offload_ratio"] == "auto" and kw["memory_limit"] == 2
    _, kw = validate(BASE + " --zero-bubble-schedule zb-h1")
    assert "offload_ratio" not in kw


@pytest.mark.parametrize("flags, msg", [
    ("--zero-bubble-schedule zb-h1 --offload-time 0.5", "--offload-time needs activation offload: add --cpu-offload"),
    ("--zero-bubble-schedule zb-h1 --auto-offload-time", "--auto-offload-time needs activation offload"),
    ("--zero-bubble-schedule zb-h1 --cpu-offload --offload-time 0.5 --auto-offload-time", "not both"),
    ("--zero-bubble-schedule zb-h1 --cpu-offload --offload-chunk-num 2",
     "--offload-chunk-num 2: schedule zb-h1 runs 1 model chunk(s) per rank, so give 1..1"),
    ("--zero-bubble-schedule zb-v --cpu-offload --offload-chunk-num 0", "give 1..2"),
    ("--zero-bubble-schedule zb-h1 --zero-bubble-offload-ratio auto", "add --zero-bubble-memory-limit"),
    ("--zero-bubble-schedule zb-h1 --cpu-offload --offload-overlap-sr --zero-bubble-offload-half-duplex",
     "contradict each other"),
    ("--cpu-offload", "--cpu-offload needs a megatron-zb schedule"),
    ("--zero-bubble-offload-ratio 0.5", "--zero-bubble-offload-ratio needs a megatron-zb schedule"),
    ("--zero-bubble-schedule zb-h1 --zero-bubble-offload-half-duplex", "needs activation offload"),
])
def test_bad_offload_combinations_one_line(flags, msg):
    with pytest.raises(ZeroBubbleArgumentError, match=re.escape(msg)) as ei:
        validate(BASE + " " + flags)
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("text", ["1.5", "-0.1", "half"])
def test_offload_ratio_parse_errors(text, capsys):
    with pytest.raises(SystemExit):
        parse(BASE + " --zero-bubble-schedule zb-h1 --zero-bubble-offload-ratio " + text)
    assert "takes a number in 0..1 or 'auto'" in capsys.readouterr().err


def test_preview_schedule_with_offload():
    _, kw = validate(BASE + " --zero-bubble-schedule zb-h1 --cpu-offload --offload-time 0.5")
    sim, base = preview_schedule(kw, 4, 16)
    assert sim.offload is not None and max(sim.peak_memory) < max(base.peak_memory)
    _, kw = validate(BASE + " --zero-bubble-schedule zb-h2 --zero-bubble-offload-ratio auto "
                            "--zero-bubble-memory-limit 3 --offload-time 0.5")
    sim, _ = preview_schedule(kw, 4, 16)
    assert max(sim.peak_memory) <= 3


def test_schedule_names_come_from_the_registry():
    """Every name the flag's help lists, and the unknown-name error, is the registry's (no stale list)."""
    parser = chain_providers(add_zero_bubble_args)(argparse.ArgumentParser(prog="x"))
    action = next(a for a in parser._actions if "--zero-bubble-schedule" in a.option_strings)
    for name in core_schedules.names():
        assert name in action.help, name
    with pytest.raises(SystemExit):
        parser.parse_args(["--zero-bubble-schedule", "nope"])
    from megatron_zb.core.ir import ScheduleError
    with pytest.raises(ScheduleError) as info:
        core_schedules.get("nope")
    assert str(info.value).endswith(", ".join(core_schedules.names()))


def test_the_launch_script_lists_the_registry():
    import os
    import re
    script = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                               "pretrain_gpt_zb.sh")).read()
    head = script[script.index("#   SCHEDULE      "):]
    listed = re.findall(r"[a-z0-9]+(?:-[a-z0-9]+)*", head[head.index("(") + 1:head.index(")")])
    assert listed == core_schedules.names()


def test_the_readme_schedule_table_is_the_registry():
    import os
    import re
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    table = readme[readme.index("## Schedules"):readme.index("\n## ", readme.index("## Schedules") + 5)]
    rows = re.findall(r"^\| `([a-z0-9-]+)` \|", table, re.M)
    assert rows == core_schedules.names()
    for name in rows:  # and the placement column says what the registry says
        row = next(l for l in table.splitlines() if l.startswith(f"| `{name}` |"))
        style = core_schedules.get(name).placement
        word = {"single": "1 stage/rank", "looped": "looped", "v": "V", "bitpipe": "two V"}[style]
        assert word in row.split("|")[2], (name, row)


def test_optimizer_offload_shares_per_rank():
    def parser_with_offload():
        parser = argparse.ArgumentParser(allow_abbrev=False)
        chain_providers(_megatron_like, add_zero_bubble_args)(parser)
        parser.add_argument("--optimizer-cpu-offload", action="store_true")
        parser.add_argument("--use-precision-aware-optimizer", action="store_true")
        return parser
    p = int(BASE.split("--pipeline-model-parallel-size")[1].split()[0])
    shares = ",".join(["0.5"] + ["0"] * (p - 1))
    args = parser_with_offload().parse_args((BASE + f" --zero-bubble-schedule zb-h1 --optimizer-cpu-offload "
                                             f"--use-precision-aware-optimizer --enable-optimizer-post-validation "
                                             f"--zero-bubble-optimizer-offload {shares}").split())
    kw = validate_zero_bubble_args(args, before_megatron_validation=True)
    assert kw["post_validation"] is True and args.zero_bubble_optimizer_offload == [0.5] + [0.0] * (p - 1)
    args = parser_with_offload().parse_args((BASE + f" --zero-bubble-schedule zb-h1 "
                                             f"--zero-bubble-optimizer-offload {shares}").split())
    with pytest.raises(ZeroBubbleArgumentError, match="add --optimizer-cpu-offload"):
        validate_zero_bubble_args(args, before_megatron_validation=True)
    args = parser_with_offload().parse_args((BASE + " --zero-bubble-schedule zb-h1 --optimizer-cpu-offload "
                                             "--zero-bubble-optimizer-offload 0.5").split())
    with pytest.raises(ZeroBubbleArgumentError, match="one share per pipeline rank"):
        validate_zero_bubble_args(args, before_megatron_validation=True)
    with pytest.raises(SystemExit):
        parser_with_offload().parse_args((BASE + " --zero-bubble-optimizer-offload 1.5").split())
    # trough: Megatron's share in host memory, visiting the GPU in each rank's trough
    args = parser_with_offload().parse_args((BASE + " --zero-bubble-schedule zb-v --optimizer-cpu-offload "
                                             "--use-precision-aware-optimizer --zero-bubble-optimizer-offload trough "
                                             "--enable-optimizer-post-validation").split())
    kw = validate_zero_bubble_args(args, before_megatron_validation=True)
    assert args.zero_bubble_optimizer_offload == "trough" and kw["post_validation"] is True
    for value, want in ((f"trough:{shares}", [0.5] + [0.0] * (p - 1)), ("trough:auto", "auto")):  # each rank its share
        args = parser_with_offload().parse_args((BASE + " --zero-bubble-schedule zb-v --optimizer-cpu-offload "
                                                 f"--use-precision-aware-optimizer --zero-bubble-optimizer-offload "
                                                 f"{value}").split())
        validate_zero_bubble_args(args, before_megatron_validation=True)
        assert optimizer_offload_flags(args) == (want, True)
    with pytest.raises(SystemExit):
        parser_with_offload().parse_args((BASE + " --zero-bubble-optimizer-offload trough:x").split())
    args = parser_with_offload().parse_args((BASE + " --zero-bubble-schedule zb-v "
                                             "--zero-bubble-optimizer-offload trough").split())
    with pytest.raises(ZeroBubbleArgumentError, match="add --optimizer-cpu-offload"):
        validate_zero_bubble_args(args, before_megatron_validation=True)


def test_optimizer_trough_inputs_from_megatrons_arguments():
    """The trough plan's units from plan's model of the run: one microbatch's activation (bytes), one
    stage's forward (seconds), no budget without a GPU."""
    import math

    from megatron_zb.core.ir import Placement
    from megatron_zb.megatron.launch.session import trough_inputs
    args = parse(BASE + " --zero-bubble-schedule zb-h1")
    args.padded_vocab_size = 32000
    kw = trough_inputs(args, Placement.single(4))
    assert kw["unit_bytes"] > 1e6 and 1e-6 <= kw["unit_s"] < 10
    assert kw["budget_bytes"] == math.inf or kw["budget_bytes"] > 1e9


def test_optimizer_offload_auto_shares_from_each_ranks_need():
    from megatron_zb.core.ir import Placement
    from megatron_zb.megatron.features.optimizer_offload import auto_shares
    args = parse(BASE + " --zero-bubble-schedule zb-h1 --bf16")
    args.padded_vocab_size = 32000
    pl = Placement.single(4)
    peaks = [4.0, 3.0, 2.0, 1.0]  # 1F1B-like: rank 0 holds the most
    found = []
    for k in range(40):
        budget = 1e9 * 1.15 ** k
        try:
            found.append((budget, auto_shares(args, peaks, pl, budget_bytes=budget)))
        except ValueError as e:
            assert "do not fit" in str(e)
    assert found and found[-1][1] == [0.0] * 4  # room for everything: nothing on the host
    mixed = [s for _, s in found if len(set(s)) > 1]
    assert mixed  # somewhere each rank gets its own share
    for s in mixed:
        assert s[0] >= s[1] >= s[2] >= s[3]  # the rank with the most activations offloads most
    for (_, a), (_, b) in zip(found, found[1:]):
        assert all(x >= y for x, y in zip(a, b))  # more memory, smaller shares
