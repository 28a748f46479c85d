"""The GPT pretraining entry point (``python -m megatron_zb.megatron.pretrain_gpt``) on CPU.

Real trainings of a tiny GPT with 2 gloo ranks, launched through ``scripts/pretrain_gpt_zb.sh``
(torchrun): Megatron's ``pretrain()`` with megatron-zb's schedules installed. Needs a
megatron-core whose wheel has ``megatron.training`` (0.18+): run with ``MZB_MCORE=0.19.2``;
on 0.16.1 these tests skip and only the "clear error" test runs.

Also the NumPy stand-in for megatron's compiled dataset helpers, against a line-by-line Python
transcription of the C++ loops.
"""
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from tests._ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "pretrain_gpt_zb.sh")
ITERS = 8


def _has_megatron_training() -> bool:
    """Whether the selected megatron-core ships megatron.training (looked up without importing it)."""
    spec = importlib.util.find_spec("megatron")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return any(os.path.isfile(os.path.join(d, "training", "arguments.py")) for d in locations)


needs_training = pytest.mark.skipif(
    not _has_megatron_training(),
    reason="this megatron-core has no megatron.training (the 0.16.1 wheel does not ship it); "
           "the entry point needs >= 0.18: run with MZB_MCORE=0.19.2")




def _cuda():
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def _env(**extra):
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHON=sys.executable, FORCE_CPU="1")
    if env.get("MZB_MCORE_PATH"):
        env["MZB_MCORE"] = env["MZB_MCORE_PATH"]
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_script(timeout=900, **env):  # a hang guard: about 25 s on a quiet 2-core box, minutes at a load of 40+
    proc = subprocess.run(["bash", SCRIPT], env=_env(MASTER_PORT=free_port(), **env), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return proc.returncode, proc.stdout


_ITER_RE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.*?elapsed time per iteration \(ms\): ([0-9.]+) \|"
                      r".*?learning rate: ([0-9.E+-]+) \|.*?lm loss: ([0-9.E+-]+)")


def parse_log(text):
    rows = [(int(m.group(1)), float(m.group(3)), float(m.group(4)), float(m.group(5)))
            for m in _ITER_RE.finditer(text)]
    return rows


# --------------------------------------------------------------------------------------------
# trainings
# --------------------------------------------------------------------------------------------

MOE_ARGS = ("--num-experts 4 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --moe-router-topk 2 "
            "--moe-aux-loss-coeff 0.01 --disable-bias-linear --zero-bubble-deterministic-init")
DET = "--zero-bubble-deterministic-init"
# Every run is a torchrun job of its own (about 24 CPU seconds, nearly all start-up: 8 iterations
# cost 1 s more than 2): 1f1b/det is the reference of every comparison but one (zb-h1/offload and
# zb-h2/postval, same placement and seed, compare with it just as well as with Megatron's own
# initialisation); "1f1b", from Megatron's own initialisation, is fork/vocab's, whose tied shards are
# scattered from the embedding only without the deterministic initialisation.
RUNS = {
    # the reference; the one run with the flag check before torchrun (PREFLIGHT), and the one with
    # Megatron's data-loader worker processes (the script's CPU default is none): the same batches
    "1f1b/det": dict(SCHEDULE="1f1b", EXTRA_ARGS=DET + " --num-workers 2"),
    # V placement (embedding and loss on rank 0) from the same weights as 1F1B: deterministic init
    "zb-v/det": dict(SCHEDULE="zb-v", EXTRA_ARGS=DET),
    # the ZB fork's offload flags (CPU test mode: synchronous copies to separate CPU buffers)
    "zb-h1/offload": dict(SCHEDULE="zb-h1", EXTRA_ARGS="--cpu-offload --offload-time 0.1 --offload-chunk-num 1 "
                                                      f"--offload-overlap-sr --zero-bubble-offload-cpu-test {DET}"),
    # replicated stages: deterministic init is implied (the replicas must start equal)
    "bitpipe": dict(SCHEDULE="bitpipe"),
    "zeropp/det": dict(SCHEDULE="zeropp",
                       EXTRA_ARGS="--num-virtual-stages-per-pipeline-rank 2 --zero-bubble-deterministic-init"),
    # the fork's flag in Megatron's own training loop, post-validating from the first step
    "zb-h2/postval": dict(SCHEDULE="zb-h2", EXTRA_ARGS="--enable-optimizer-post-validation "
                                                        f"--zero-bubble-post-validation-min-clean-steps 0 {DET}"),
    # MoE with expert parallelism (PP=2 x DP=2, experts over EP=2, all-to-all over gloo, aux loss), zb-v
    # with Megatron's EP all-to-all overlap flag (every pass through megatron-core's schedule plans; the
    # same runtime without the flag is verify's, tests/test_moe_recompute.py)
    # (8 microbatches per replica: each chunk costed by what it holds, zb-v's order at 4 has no F
    # directly before another microbatch's B to pair, at 8 it has)
    "zb-v/moe-overlap": dict(SCHEDULE="zb-v", NPROC=4, GBS=32, EXTRA_ARGS=MOE_ARGS + " --overlap-moe-expert-parallel-comm"),
    "1f1b/moe": dict(SCHEDULE="1f1b", NPROC=4, GBS=32, EXTRA_ARGS=MOE_ARGS),
    # vocabulary parallelism (issue 33): zb-v from the same weights as 1f1b; the VocabularyParallelism
    # fork's flags alone (its 1F1B, two barriers) from Megatron's own random init, with evaluation, against
    # Megatron's 1F1B from that init ("1f1b": the tied shards are scattered from the embedding only then)
    "1f1b": dict(SCHEDULE="1f1b"),
    # no Transformer Engine, --attention-backend flash: torch's SDPA as the core attention (zb-v from the
    # same weights as 1f1b with megatron's DotProductAttention)
    "zb-v/sdpa/det": dict(SCHEDULE="zb-v", EXTRA_ARGS=DET + " --attention-backend flash"),
    "zb-v/vocab/det": dict(SCHEDULE="zb-v", EXTRA_ARGS="--zero-bubble-deterministic-init --enable-vocab-parallel"),
    # recompute per model chunk (issue 55): rank 0's two chunks recompute their layer, rank 1's none
    "zb-v/recompute/det": dict(SCHEDULE="zb-v", EXTRA_ARGS=DET + " --recompute-granularity full --recompute-method block "
                                                                "--zero-bubble-recompute-num-layers 1,0,0,1"),
    # with activation offload (issue 55): zb-h1, the input embedding split too, half the activations
    # offloaded (CPU test mode) and one layer per stage recomputed (full, block)
    "zb-h1/vocab-offload/det": dict(SCHEDULE="zb-h1", EXTRA_ARGS=f"{DET} --enable-vocab-parallel --split-vocab-embedding "
                                    "--zero-bubble-offload-ratio 0.5 --offload-time 0.1 --zero-bubble-offload-cpu-test "
                                    "--recompute-granularity full --recompute-method block --recompute-num-layers 1"),
    # (and the input embedding split too, as the fork always does: --split-vocab-embedding)
    "fork/vocab": dict(SCHEDULE="megatron", EVAL_INTERVAL=4, EVAL_ITERS=2,
                       EXTRA_ARGS="--enable-vocab-parallel --disable-backward-fusion --split-vocab-embedding"),
}


@pytest.fixture(scope="module")
def trainings():
    out = {}
    for name, env in RUNS.items():  # the flag check before torchrun has its own tests: once here
        rc, text = run_script(ITERS=ITERS, PP=2, **({} if name == "1f1b/det" else {"PREFLIGHT": 0}), **env)
        out[name] = (rc, text, parse_log(text))
    return out


def _check_ok(trainings, name, iters=ITERS):
    rc, text, rows = trainings[name]
    assert rc == 0, f"{name} failed (rc {rc}):\n{text[-4000:]}"
    assert [r[0] for r in rows] == list(range(1, iters + 1)), f"{name}: iterations logged {[r[0] for r in rows]}"
    return text, rows


@pytest.mark.megatron
@pytest.mark.dist
@needs_training
@pytest.mark.parametrize("name", list(RUNS))
def test_trains_with_megatron_style_logs_and_falling_loss(trainings, name):
    text, rows = _check_ok(trainings, name)
    sched = {"megatron": "1f1b"}.get(RUNS[name]["SCHEDULE"], RUNS[name]["SCHEDULE"])
    assert f"megatron-zb: schedule {sched} installed" in text
    losses = [r[3] for r in rows]
    assert losses[-1] < losses[0] - 0.3, f"{name}: loss did not fall: {losses}"
    assert all(r[1] > 0 for r in rows)  # ms per iteration
    assert rows[0][2] > rows[-1][2]  # cosine learning rate decays


@pytest.mark.megatron
@pytest.mark.dist
@needs_training
def test_zb_h1_with_the_forks_offload_flags_equals_1f1b_at_the_same_seed(trainings):
    """Same placement, same seed: zb-h1 (offloading every activation in the CPU test mode) gives
    1f1b's losses."""
    text, b = _check_ok(trainings, "zb-h1/offload")
    _, a = _check_ok(trainings, "1f1b/det")
    assert "megatron-zb: activation offload ratio 1.0, K 0.1, two copy streams" in text
    for (i, _, _, la), (_, _, _, lb) in zip(a, b):
        assert lb == pytest.approx(la, rel=2e-6), f"iteration {i}: 1f1b {la} vs zb-h1 + offload {lb}"


@pytest.mark.megatron
@pytest.mark.dist
@needs_training
def test_v_placement_equals_1f1b_from_the_same_weights(trainings):
    text, v = _check_ok(trainings, "zb-v/det")
    _, ref = _check_ok(trainings, "1f1b/det")
    assert "v placement, 2 chunk(s) per rank" in text
    # rank 0 builds stages 0 and 3 (embedding and loss), rank 1 stages 1 and 2
    assert re.search(r"pipeline rank 0 chunk 1: stage 3 of 4, layers 3-3, loss", text)
    assert re.search(r"pipeline rank 1 chunk 1: stage 2 of 4, layers 2-2\b", text)
    for (i, _, _, la), (_, _, _, lb) in zip(ref, v):
        assert lb == pytest.approx(la, rel=2e-6), f"iteration {i}: 1f1b {la} vs zb-v {lb}"


@pytest.mark.megatron
@pytest.mark.dist
@needs_training
def test_recompute_per_model_chunk_equals_1f1b(trainings):
    """--zero-bubble-recompute-num-layers: each chunk recomputes its own count (the chunk lines say so),
    and the losses are 1f1b's from the same weights."""
    text, v = _check_ok(trainings, "zb-v/recompute/det")
    _, ref = _check_ok(trainings, "1f1b/det")
    assert re.search(r"pipeline rank 0 chunk 1: stage 3 of 4, layers 3-3, recomputes 1 of them, loss", text)
    assert re.search(r"pipeline rank 1 chunk 0: stage 1 of 4, layers 1-1, recomputes 0 of them", text)
    for (i, _, _, la), (_, _, _, lb) in zip(ref, v):
        assert lb == pytest.approx(la, rel=2e-6), f"iteration {i}: 1f1b {la} vs zb-v with recompute {lb}"


@pytest.mark.megatron
@pytest.mark.dist
@needs_training
def test_moe_with_expert_parallelism_zb_v_equals_1f1b(trainings):
    """An MoE GPT with EP=2 trains with zb-v exactly like 1f1b from the same weights; the router's
    weight gradient, which stays in B, is named."""
    text, v = _check_ok(trainings, "zb-v/moe-overlap")
    _, ref = _check_ok(trainings, "1f1b/moe")
    fused = [l for l in text.splitlines() if "weight gradients computed in B, not deferred to W" in l]
    assert fused and all(l.endswith("decoder.layers.*.mlp.router.weight") for l in fused), fused  # experts: in W
    assert "load_balancing_loss" in text
    for (i, _, _, la), (_, _, _, lb) in zip(ref, v):
        assert lb == pytest.approx(la, rel=2e-6), f"iteration {i}: 1f1b {la} vs zb-v {lb}"


@pytest.mark.megatron
@pytest.mark.dist
@needs_training
def test_moe_ep_overlap_flag_trains_like_1f1b(trainings):
    """--overlap-moe-expert-parallel-comm with zb-v: the schedule core pairs F&B passes (the all-to-all at
    half of F by default), each pair runs as one pass through megatron-core's schedule plans, and the
    losses equal 1f1b's from the same weights."""
    text, v = _check_ok(trainings, "zb-v/moe-overlap")
    _, ref = _check_ok(trainings, "1f1b/moe")
    assert "--overlap-moe-expert-parallel-comm run by megatron-zb alone" in text  # CPU: fp32, not Megatron's config
    said = re.findall(r"EP all-to-all overlap .*?: every pass through megatron-core's schedule plans, (\d+) overlapped", text)
    assert said and all(int(n) > 0 for n in said), said
    for (i, _, _, la), (_, _, _, lb) in zip(ref, v):
        assert lb == pytest.approx(la, rel=2e-6), f"iteration {i}: 1f1b {la} vs zb-v + EP overlap {lb}"


@pytest.mark.megatron
@pytest.mark.dist
@needs_training
@pytest.mark.parametrize("name", ["bitpipe", "zeropp/det"])
def test_field_schedules_equal_1f1b_from_the_same_weights(trainings, name):
    """Adam with gradient clipping: the replicas' gradients are summed and counted once in the norm."""
    text, rows = _check_ok(trainings, name)
    _, ref = _check_ok(trainings, "1f1b/det")
    if name == "bitpipe":
        assert "bitpipe placement, 4 chunk(s) per rank" in text
        # rank 1 holds the up direction's embedding and loss (logical stages 0 and 3 of path 1)
        assert re.search(r"pipeline rank 1 chunk 2: stage 0 of 4 \(path 1\), layers 0-0, embedding", text)
        assert re.search(r"pipeline rank 1 chunk 3: stage 3 of 4 \(path 1\), layers 3-3, loss", text)
    for (i, _, _, la), (_, _, _, lb) in zip(ref, rows):
        assert lb == pytest.approx(la, rel=2e-6), f"iteration {i}: 1f1b {la} vs {name} {lb}"


@pytest.mark.megatron
@pytest.mark.dist
@needs_training
def test_sdpa_attention_backend_trains_like_1f1b(trainings):
    """--attention-backend flash without Transformer Engine: Megatron's local spec with torch's
    scaled_dot_product_attention, zb-v, the losses of 1f1b with megatron's attention up to float rounding."""
    text, rows = _check_ok(trainings, "zb-v/sdpa/det")
    _, ref = _check_ok(trainings, "1f1b/det")
    assert text.count("core attention: torch's scaled_dot_product_attention (--attention-backend flash") == 1
    for (i, _, _, la), (_, _, _, lb) in zip(ref, rows):
        assert lb == pytest.approx(la, rel=1e-5), f"iteration {i}: 1f1b {la} vs zb-v with SDPA {lb}"


@pytest.mark.megatron
@pytest.mark.dist
@needs_training
def test_vocabulary_parallelism_trains_like_1f1b(trainings):
    """The output layer spread over both ranks: zb-v (one barrier) from the same weights as 1f1b; the
    fork's flags alone (1F1B, two barriers, the input embedding split too) from Megatron's own
    initialisation, the tied shards scattered from the embedding, which the first stage then drops;
    Megatron's evaluation through the vocabulary passes."""
    for name, ref_name in (("zb-v/vocab/det", "1f1b/det"), ("fork/vocab", "1f1b")):
        text, rows = _check_ok(trainings, name)
        _, ref = _check_ok(trainings, ref_name)
        assert "vocabulary parallelism with" in text, name
        for (i, _, _, la), (_, _, _, lb) in zip(ref, rows):
            assert lb == pytest.approx(la, rel=2e-6), f"iteration {i}: {ref_name} {la} vs {name} {lb}"
    text, _ = _check_ok(trainings, "fork/vocab")
    assert "2 barrier(s)" in text
    evals = [float(v) for v in re.findall(r"validation loss at iteration \d+.*?lm loss value: ([0-9.E+-]+)", text)]
    assert len(evals) >= 2 and all(0 < v < 10 for v in evals), evals


@pytest.mark.megatron
@pytest.mark.dist
@needs_training
def test_vocabulary_parallelism_with_activation_offload_trains_like_1f1b(trainings):
    """Vocabulary parallelism (the input embedding split too) with half the activations offloaded and
    full recomputation: zb-h1 from the same weights gives 1f1b's losses."""
    text, rows = _check_ok(trainings, "zb-h1/vocab-offload/det")
    _, ref = _check_ok(trainings, "1f1b/det")
    assert "vocabulary parallelism with" in text and "megatron-zb: activation offload ratio 0.5, K 0.1" in text
    for (i, _, _, la), (_, _, _, lb) in zip(ref, rows):
        assert lb == pytest.approx(la, rel=2e-6), f"iteration {i}: 1f1b {la} vs zb-h1 + vocab + offload {lb}"


@pytest.mark.megatron
@pytest.mark.dist
@needs_training
def test_optimizer_post_validation_in_megatrons_training_loop(trainings):
    text, pv = _check_ok(trainings, "zb-h2/postval")
    _, ref = _check_ok(trainings, "1f1b/det")
    assert "megatron-zb: optimizer post-validation on" in text
    # Megatron clips (--clip-grad 1.0) these steps: each is rolled back and redone, and the run
    # still trains like the synchronous one (1f1b there: same placement, same seed)
    assert re.search(r"megatron-zb post-validation: the step of iteration \d+ was rolled back and redone", text)
    for (i, _, lr_a, la), (_, _, lr_b, lb) in zip(ref, pv):
        assert lb == pytest.approx(la, rel=2e-6), f"iteration {i}: 1f1b {la} vs zb-h2 post-validated {lb}"
        assert lr_b == lr_a
    assert "grad norm:" in text


# --------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------

def _entry(args, timeout=600):
    cmd = [sys.executable, "-m", "megatron_zb.megatron.pretrain_gpt"] + args
    return subprocess.run(cmd, env=_env(RANK="0", WORLD_SIZE="2"), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, timeout=timeout)


TINY = ("--pipeline-model-parallel-size 2 --num-layers 6 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 16 --train-iters 2 --lr 1e-3 "
        "--tokenizer-type NullTokenizer --vocab-size 128").split()


@pytest.mark.megatron
@needs_training
@pytest.mark.parametrize("flags,message", [
    (["--zero-bubble-schedule", "zb-v"], "V schedule zb-v needs an even number of layers per pipeline stage"),
    (["--enable-zero-bubble", "--offload-time", "0.5"], "--offload-time needs activation offload: add --cpu-offload"),
    (["--enable-zero-bubble", "--cpu-offload", "--offload-chunk-num", "2"],
     "--offload-chunk-num 2: schedule zb-auto runs 1 model chunk(s) per rank"),
    (["--zero-bubble-schedule", "zb-h2", "--zero-bubble-memory-limit", "2"],
     "schedule zb-h2 with pipeline size 2 and 8 microbatches"),
    (["--zero-bubble-schedule", "zb-h1", "--attention-backend", "flash", "--context-parallel-size", "2"],
     "(torch's scaled_dot_product_attention) does not run with --context-parallel-size > 1"),
    (["--zero-bubble-schedule", "zb-h1", "--recompute-granularity", "full", "--recompute-method", "block",
      "--zero-bubble-recompute-num-layers", "4,0"], "asks 4 recomputed layers of model chunk 0 (pipeline rank 0), "
                                                     "which holds 3"),
])
def test_bad_flags_fail_before_training_with_one_line(flags, message):
    proc = _entry(TINY + flags)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.megatron
@needs_training
@pytest.mark.skipif(_cuda(), reason="the refusal is for machines without CUDA")
def test_offload_without_cuda_needs_the_cpu_test_mode():
    proc = _entry(TINY + ["--zero-bubble-schedule", "zb-h1", "--cpu-offload"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "this machine has no CUDA device" in proc.stderr and "--zero-bubble-offload-cpu-test" in proc.stderr


_WARMUP_CHECK = """
import types
from megatron_zb.megatron.cpu import cpu_shims
cpu_shims.python_compat(); cpu_shims.apply()
import megatron.training.initialize as init
from megatron.training import global_vars
calls = []
init._warmup_jit_function = lambda *a, **k: calls.append(1)
cpu_shims.apply_training(force=True)
global_vars._GLOBAL_ARGS = types.SimpleNamespace(bias_gelu_fusion=False, bias_swiglu_fusion=False,
                                                 bias_dropout_fusion=False)
init._warmup_jit_function()
assert calls == [], calls
global_vars._GLOBAL_ARGS.bias_dropout_fusion = True
init._warmup_jit_function()
assert calls == [1], calls
print("ok")
"""


@pytest.mark.megatron
@needs_training
def test_cpu_start_up_warms_up_no_fusion_that_is_off():
    """Megatron's start-up torch.compiles the fused bias+activation and bias+dropout+add to warm them
    up (a third of a tiny CPU run's start-up); on a CPU the fusions are off, so the shims skip it, and
    run it when one is on."""
    proc = subprocess.run([sys.executable, "-c", _WARMUP_CHECK], env=_env(), cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.megatron
@pytest.mark.skipif(_has_megatron_training(), reason="this megatron-core has megatron.training")
def test_entry_point_says_what_it_needs_without_megatron_training():
    proc = _entry(TINY + ["--zero-bubble-schedule", "zb-h1"])
    assert proc.returncode == 2
    assert "needs megatron.training" in proc.stderr and "patches/megatron-lm-pretrain_gpt.patch" in proc.stderr


# --------------------------------------------------------------------------------------------
# the NumPy stand-in for megatron's dataset helpers
# --------------------------------------------------------------------------------------------

def _reference_sample_idx(sizes, document_idx, seq_length, num_epochs, tokens_per_epoch, drop_last, add_extra):
    """helpers.cpp's build_sample_idx, transcribed loop for loop."""
    import math
    if drop_last:
        num_samples = (num_epochs * tokens_per_epoch - add_extra) // seq_length
    else:
        num_samples = math.ceil(float(np.float32(num_epochs * tokens_per_epoch - add_extra)) / seq_length)
    out = [(0, 0)]
    idx, offset = 0, 0
    while len(out) <= num_samples:
        remaining = seq_length + add_extra
        while remaining != 0:
            length = int(sizes[document_idx[idx]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - add_extra
                remaining = 0
            else:
                if idx == len(document_idx) - 1:
                    offset = int(sizes[document_idx[idx]]) - add_extra
                    break
                idx += 1
                offset = 0
        out.append((idx, offset))
    return np.array(out)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("add_extra", [1, 0])
def test_numpy_sample_index_matches_the_cpp_loop(seed, drop_last, add_extra):
    from megatron_zb.megatron.cpu.cpu_shims import _numpy_dataset_helpers
    helpers = _numpy_dataset_helpers("helpers_cpp_test")
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 40, size=50).astype(np.int32)
    epochs = 2
    document_idx = np.concatenate([rng.permutation(50) for _ in range(epochs)]).astype(np.int32)
    tokens_per_epoch = int(sizes.sum())
    seq = int(rng.integers(2, 30))
    got = helpers.build_sample_idx_int32(sizes, document_idx, seq, epochs, tokens_per_epoch, drop_last, add_extra)
    want = _reference_sample_idx(sizes, document_idx, seq, epochs, tokens_per_epoch, drop_last, add_extra)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


def test_numpy_blending_indices_match_the_cpp_loops():
    from megatron_zb.megatron.cpu.cpu_shims import _numpy_dataset_helpers
    helpers = _numpy_dataset_helpers("helpers_cpp_test")
    weights = np.array([0.5, 0.3, 0.2])
    di, dsi = np.zeros(100, np.int16), np.zeros(100, np.int64)
    helpers.build_blending_indices(di, dsi, weights, 3, 100, False)
    cur = [0, 0, 0]
    for i in range(100):  # the C++ loop
        errs = [weights[d] * max(i, 1) - cur[d] for d in range(3)]
        j = max(range(3), key=lambda d: (errs[d], -d))
        assert (di[i], dsi[i]) == (j, cur[j])
        cur[j] += 1
    sizes = np.array([3, 5, 2], dtype=np.int64)
    di, dsi = np.zeros(10, np.int16), np.zeros(10, np.int64)
    helpers.build_exhaustive_blending_indices(di, dsi, sizes, 3)
    assert np.bincount(di, minlength=3).tolist() == [3, 5, 2]
    for d in range(3):
        assert dsi[di == d].tolist() == list(range(sizes[d]))


@pytest.mark.megatron
@pytest.mark.dist
@needs_training
@pytest.mark.parametrize("schedule,limit_gib,extra", [
    # about 1.9 microbatches of the tiny GPT's stage (one is 0.66 MB by plan's formula)
    ("zb-auto", 0.0012, ""), ("v-auto", 0.0012, ""),
    # zb-v peaks at 2 microbatches; 1.97 of them fit only with part of the activations offloaded
    ("zb-v", 0.00123, "--zero-bubble-offload-ratio auto --zero-bubble-offload-cpu-test")])
def test_a_memory_limit_in_gib_holds_as_measured(schedule, limit_gib, extra):
    """--zero-bubble-memory-limit in GiB: every rank's activation peak, as measured in the profile
    window (runtime.observe.memory), is at most that; the measurement is in the profile JSON too."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "profile.json")
        rc, text = run_script(SCHEDULE=schedule, PP=2, ITERS=3, PREFLIGHT=0,  # the window ends the run
                              EXTRA_ARGS=f"--zero-bubble-memory-limit {limit_gib}GiB --zero-bubble-profile-window 2 3 "
                                         f"--zero-bubble-profile-path {path} {extra}")
        assert rc == 0, text[-4000:]
        peaks = {int(r): float(m) for r, m in
                 re.findall(r"pipeline rank (\d+): activations peak ([0-9.]+) MiB measured", text)}
        assert sorted(peaks) == [0, 1], text[-3000:]
        assert all(0 < m <= limit_gib * 1024 for m in peaks.values()), peaks
        with open(path) as f:
            prof = json.load(f)
    assert all(0 < b <= limit_gib * 2 ** 30 for b in prof["peak_activation_bytes_measured"]), prof
    assert len(prof["peak_activation_bytes_predicted"]) == 2 and len(prof["memory_traces"]) == 2
