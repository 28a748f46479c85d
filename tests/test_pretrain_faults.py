"""The training entry point under faults and bad input (real torchrun jobs through
``scripts/pretrain_gpt_zb.sh``; megatron-core >= 0.18, i.e. ``MZB_MCORE=0.19.2``).

* checkpoints know their placement: a per-rank (``--ckpt-format torch``) zb-v checkpoint is
  refused by a 1F1B run with one line; converted (``convert_checkpoint``) it loads and gives the
  uninterrupted run's loss; ``torch_dist`` checkpoints move between zb-v, 1F1B and
  interleaved-1F1B and give the uninterrupted losses;
* bad input: one line, exit code 2, in under 15 s, from the launch script (the preflight check)
  and, in process, for each check;
* a rank stopped with SIGSTOP in a PP=4 run is named by every rank's timeout message, and the
  job ends soon after the timeout;
* killing the torchrun launcher with SIGKILL ends every rank within 10 s, and no new checkpoint
  appears.
"""
from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys
import time

import pytest

from tests._host import overload
from tests._ports import free_port
from tests.test_pretrain_entry import ROOT, SCRIPT, _env, needs_training, parse_log, run_script

pytestmark = [pytest.mark.megatron, needs_training]


ITERS = 5


def _losses(text):
    return {it: loss for it, _, _, loss in parse_log(text)}


# --------------------------------------------------------------------------------------------
# checkpoints and placement
# --------------------------------------------------------------------------------------------

def _runner(runs):
    def run(name, **env):  # the flag check before torchrun has its own tests
        runs[name] = run_script(PREFLIGHT=0, **env)
        return runs[name]
    return run


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory):
    """zb-v saving per-rank (torch format) checkpoints; 1f1b loading one; the converted one."""
    tmp = tmp_path_factory.mktemp("torch")
    runs = {}
    run = _runner(runs)
    # saves at iteration 2, logs iteration 3's loss, saves again at 3 and exits
    run("zb-v torch", SCHEDULE="zb-v", PP=2, ITERS=ITERS, SAVE=tmp / "torch", SAVE_INTERVAL=2,
        EXTRA_ARGS="--ckpt-format torch --exit-interval 3")
    run("1f1b from zb-v torch", SCHEDULE="1f1b", PP=2, ITERS=ITERS, LOAD=tmp / "torch", EXTRA_ARGS="--ckpt-format torch")
    conv = subprocess.run([sys.executable, "-m", "megatron_zb.megatron.convert_checkpoint", "--load", str(tmp / "torch"),
                           "--save", str(tmp / "torch-1f1b"), "--to-schedule", "1f1b", "--iteration", "2"],
                          env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    runs["convert"] = (conv.returncode, conv.stdout)
    run("1f1b from converted", SCHEDULE="1f1b", PP=2, ITERS=ITERS, LOAD=tmp / "torch-1f1b",
        EXTRA_ARGS="--ckpt-format torch --no-load-optim --exit-interval 3")
    return runs


@pytest.fixture(scope="module")
def dist_runs(tmp_path_factory):
    """zb-v saving torch_dist checkpoints (uninterrupted); 1f1b and interleaved-1f1b resuming one."""
    tmp = tmp_path_factory.mktemp("dist")
    runs = {}
    run = _runner(runs)
    run("zb-v dist", SCHEDULE="zb-v", PP=2, ITERS=ITERS, SAVE=tmp / "dist", SAVE_INTERVAL=2)
    for sched, extra in (("1f1b", ""), ("interleaved-1f1b", "--num-layers-per-virtual-pipeline-stage 1")):
        run(f"{sched} from zb-v dist", SCHEDULE=sched, PP=2, ITERS=ITERS, LOAD=tmp / "dist",
            EXTRA_ARGS=f"--ckpt-step 2 {extra}")
    return runs


def _ok(runs, name):
    rc, text = runs[name]
    assert rc == 0, f"{name} failed (rc {rc}):\n{text[-3000:]}"
    return text


def test_a_per_rank_checkpoint_of_another_placement_is_refused_with_one_line(torch_runs):
    _ok(torch_runs, "zb-v torch")
    rc, text = torch_runs["1f1b from zb-v torch"]
    assert rc == 2, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("megatron-zb: error:")]
    assert len(errors) == 1, errors
    assert "was saved with zb-v, v placement, PP=2 (rank 0: layers 0 + 3, rank 1: layers 1 + 2), but this run " \
           "uses 1f1b, single placement, PP=2 (rank 0: layers 0-1, rank 1: layers 2-3)" in errors[0]
    assert "--ckpt-format torch_dist" in errors[0] and "convert_checkpoint" in errors[0]
    assert "Traceback" not in text and "iteration        1/" not in text


def test_the_converted_checkpoint_gives_the_uninterrupted_loss(torch_runs):
    rc, out = torch_runs["convert"]
    assert rc == 0 and "zb-v, v placement" in out and "-> 1f1b, single placement" in out, out
    ref = _losses(_ok(torch_runs, "zb-v torch"))
    got = _losses(_ok(torch_runs, "1f1b from converted"))
    assert sorted(got) == [3], got
    # iteration 3's loss is computed with the loaded weights (before any update): exact
    assert got[3] == pytest.approx(ref[3], rel=1e-6), (got, ref)


@pytest.mark.parametrize("sched", ["1f1b", "interleaved-1f1b"])
def test_torch_dist_moves_between_placements_with_the_uninterrupted_losses(dist_runs, sched):
    ref = _losses(_ok(dist_runs, "zb-v dist"))
    text = _ok(dist_runs, f"{sched} from zb-v dist")
    got = _losses(text)
    assert "the torch_dist format maps layers by their global names" in text
    assert sorted(got) == [3, 4, 5], got
    assert got[3] == pytest.approx(ref[3], rel=1e-6), (got, ref)  # the loaded weights, exactly
    # Megatron's log after a resume: the second line (iteration 4) shows the mean of iterations 3
    # and 4 (megatron-core 0.19.2; the same when zb-v resumes its own checkpoint); then per iteration
    assert got[4] == pytest.approx((ref[3] + ref[4]) / 2, rel=1e-5), (got, ref)
    assert got[5] == pytest.approx(ref[5], rel=1e-5), (got, ref)


# --------------------------------------------------------------------------------------------
# bad input: one line, exit code 2, before torchrun
# --------------------------------------------------------------------------------------------

TINY = ("--pipeline-model-parallel-size 4 --num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 16 --train-iters 2 --lr 1e-3 "
        "--tokenizer-type NullTokenizer --vocab-size 128").split()


def _replace(flags, **new):
    out = list(flags)
    for flag, value in new.items():
        flag = "--" + flag.replace("_", "-")
        i = out.index(flag)
        out[i + 1] = str(value)
    return out


@pytest.mark.parametrize("argv, world, message", [
    (_replace(TINY, global_batch_size=15), 4,
     "--global-batch-size 15 is not a multiple of --micro-batch-size 2 x data-parallel size 1 = 2"),
    (TINY + ["--tensor-model-parallel-size", "3"], 12,
     "--num-attention-heads 4 is not divisible by --tensor-model-parallel-size 3"),
    (TINY, 6, "world size 6 (processes in the job) is not a multiple of tensor x pipeline x context parallel size"),
    (TINY + ["--data-path", "/nonexistent/corpus_text_document"], 4,
     "dataset '/nonexistent/corpus_text_document' has no /nonexistent/corpus_text_document.bin and"),
    (_replace(TINY, tokenizer_type="GPT2BPETokenizer") + ["--mock-data"], 4,
     "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"),
    (TINY + ["--vocab-file", "/nonexistent/vocab.json"], 4, "--vocab-file /nonexistent/vocab.json: no such file"),
    (TINY + ["--zero-bubble-schedule", "zb-x"], 4, "unknown schedule 'zb-x'; known schedules: gpipe, 1f1b"),
    (TINY + ["--no-such-flag"], 4, "unrecognized arguments: --no-such-flag"),
    (_replace(TINY, num_layers=6) + ["--zero-bubble-schedule", "zb-v"], 4,
     "V schedule zb-v needs an even number of layers per pipeline stage"),
    (_replace(TINY, num_layers=6), 4, "Megatron's argument check failed"),  # Megatron's own schedules
    (TINY + ["--zero-bubble-schedule", "zb-h2", "--zero-bubble-memory-limit", "3"], 4,
     "schedule zb-h2 with pipeline size 4 and 8 microbatches"),
    (TINY + ["--load", "/nonexistent/ckpt"], 4,
     "--load /nonexistent/ckpt: no such directory; Megatron would train from random weights"),
])
def test_preflight_names_the_bad_input(argv, world, message, monkeypatch):
    from megatron_zb.megatron import preflight
    from megatron_zb.megatron.errors import ZeroBubbleArgumentError
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(var, os.environ.get(var, "0"))
    with pytest.raises(ZeroBubbleArgumentError) as info:
        preflight.check(argv, world)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("env, message", [
    (dict(GBS=15, MBS=2), "--global-batch-size 15 is not a multiple of --micro-batch-size 2"),
    (dict(SCHEDULE="zb-x"), "unknown schedule 'zb-x'"),
])
@pytest.mark.timing
def test_the_launch_script_says_one_line_and_exits_2_before_torchrun(env, message):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(["bash", SCRIPT], env=_env(MASTER_PORT=free_port(), PP=4, **env), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("megatron-zb: error:") and message in lines[0], proc.stderr
    assert "usage:" not in proc.stdout + proc.stderr
    assert "torch.distributed" not in proc.stdout + proc.stderr  # torchrun never started
    # little work: 6 s of CPU on an idle 2-core box, mostly importing megatron-core (CPU time, not the
    # wall clock: the suite's eight streams on two cores stretched the wall clock past 120 s)
    assert cpu < 15, f"{cpu:.1f} s of CPU"


# --------------------------------------------------------------------------------------------
# a stopped rank; a killed launcher
# --------------------------------------------------------------------------------------------

def _ranks_of(launcher_pid):
    """{global rank: pid} of the launcher's child processes that are ranks."""
    out = {}
    for pid in subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout.split():
        try:
            env = dict(kv.split(b"=", 1) for kv in open(f"/proc/{pid}/environ", "rb").read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env:
            out[int(env[b"RANK"])] = int(pid)
    return out


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


class _Job:
    """The launch script in the background, output in a file; every process it started is gone after."""

    def __init__(self, tmp, **env):
        self.log_path = tmp / "job.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(["bash", SCRIPT], env=_env(MASTER_PORT=free_port(), PREFLIGHT=0, **env),
                                     cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.ranks = {}

    def text(self):
        return self.log_path.read_text()

    def wait_for(self, pattern, timeout=900):
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text()):
            assert self.proc.poll() is None, f"the job ended (rc {self.proc.returncode}):\n{self.text()[-3000:]}"
            assert time.monotonic() < deadline, f"no {pattern!r} after {timeout}s:\n{self.text()[-3000:]}"
            time.sleep(0.2)
        self.ranks = _ranks_of(self.proc.pid)

    def close(self):
        left = _descendants(self.proc.pid) + [p for r in self.ranks.values() for p in [r] + _descendants(r)]
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in left:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.log.close()


def _descendants(pid):
    kids = [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]
    return kids + [d for k in kids for d in _descendants(k)]


TIMEOUT_S = 5


@pytest.mark.dist
@pytest.mark.timing
def test_a_stopped_rank_is_named_by_every_rank_and_the_job_ends(tmp_path):
    job = _Job(tmp_path, SCHEDULE="zb-v", PP=4, ITERS=100000, EXTRA_ARGS=f"--zero-bubble-timeout {TIMEOUT_S}")
    try:
        job.wait_for(r"iteration\s+3/")
        assert sorted(job.ranks) == [0, 1, 2, 3], job.ranks
        t0 = time.monotonic()
        os.kill(job.ranks[2], signal.SIGSTOP)
        rc = job.proc.wait(timeout=600)
        secs = time.monotonic() - t0
        text = job.text()
        errors = [line for line in text.splitlines() if line.startswith("megatron-zb: error:")]
        assert errors, text[-3000:]
        for line in errors:  # whether it waited in the schedule or in a collective after it
            assert "the rank that stopped progressing first is pipeline rank 2 (global rank 2," in line, line
        assert rc == 1 and text.rstrip().splitlines()[-1].startswith("megatron-zb: error:")  # the launcher repeats it last
        slack = 15 * overload()
        assert secs < TIMEOUT_S + slack, f"the job ended {secs:.1f}s after the stop"
        assert not _alive(job.ranks[2])
    finally:
        job.close()


@pytest.mark.dist
@pytest.mark.timing
def test_killing_the_launcher_ends_every_rank_and_no_checkpoint_follows(tmp_path):
    save = tmp_path / "ckpt"
    job = _Job(tmp_path, SCHEDULE="zb-v", PP=2, ITERS=100000, SAVE=save, SAVE_INTERVAL=5)
    try:
        job.wait_for(r"successfully saved checkpoint from iteration\s+5 ")
        assert len(job.ranks) == 2
        # the ranks go on training (a save every 5 iterations of a few ms): frozen while the launcher
        # dies, so that the latest checkpoint before its death is the one read here, however late
        # this process got to it on a busy host; after it, they must end before another completes
        for pid in job.ranks.values():
            os.kill(pid, signal.SIGSTOP)
        tracker = save / "latest_checkpointed_iteration.txt"
        before = tracker.read_text()
        t0, limit = time.monotonic(), 10 * overload()  # at once; slack for a busy host
        os.kill(job.proc.pid, signal.SIGKILL)  # the torchrun agent (the script exec'd it)
        job.proc.wait()
        for pid in job.ranks.values():
            os.kill(pid, signal.SIGCONT)
        while any(_alive(p) for p in job.ranks.values()) and time.monotonic() - t0 < limit:
            time.sleep(0.05)
        secs = time.monotonic() - t0
        assert not any(_alive(p) for p in job.ranks.values()), f"ranks outlived their launcher by {limit:.0f} s"
        time.sleep(2)
        after = tracker.read_text()  # Megatron's latest complete checkpoint (a save cut short leaves a folder)
        assert after == before, f"a checkpoint completed after the launcher died: iteration {before} -> {after}"
        assert "the launcher (torchrun agent)" in job.text() and secs < limit
    finally:
        job.close()


@pytest.mark.dist
@pytest.mark.timing
def test_nothing_outlives_a_sigkilled_rank(tmp_path):
    """The OOM killer's way: a rank SIGKILLed after a checkpoint save started Megatron's
    checkpoint-writer Manager (and multiprocessing's resource tracker) leaves nothing running:
    they come back to the torchrun wrapper (a child subreaper), which ends them with the job."""
    save = tmp_path / "ckpt"
    job = _Job(tmp_path, SCHEDULE="zb-h1", PP=2, ITERS=100000, SAVE=save, SAVE_INTERVAL=3)
    try:
        job.wait_for(r"successfully saved checkpoint from iteration\s+3 ")
        helpers = _descendants(job.ranks[1])
        assert helpers, "a save started no helper process here: nothing to check"
        os.kill(job.ranks[1], signal.SIGKILL)
        rc = job.proc.wait(timeout=600)
        assert rc != 0
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in helpers) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in helpers if _alive(p)]
        assert not left, f"outlived the job: {[open(f'/proc/{p}/cmdline').read()[:80] for p in left]}"
    finally:
        job.close()


def test_load_without_a_checkpoint_is_refused_unless_starting_fresh(tmp_path, monkeypatch):
    """An empty --load folder: refused (Megatron would start from random weights), accepted with
    --zero-bubble-start-fresh; a tracker behind a newer, unfinished save gives a note."""
    from megatron_zb.megatron import preflight
    from megatron_zb.megatron.launch import startup
    from megatron_zb.megatron.errors import ZeroBubbleArgumentError
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(var, os.environ.get(var, "0"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ZeroBubbleArgumentError, match="no checkpoint in it .* --zero-bubble-start-fresh"):
        preflight.check(TINY + ["--load", str(empty)], 4)
    assert preflight.check(TINY + ["--load", str(empty), "--zero-bubble-start-fresh"], 4)
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000010").mkdir(parents=True)
    (ckpt / "iter_0000020").mkdir()  # a save killed part-way: the tracker still names 10
    (ckpt / "latest_checkpointed_iteration.txt").write_text("10")

    class Args:
        load = str(ckpt)
    assert startup.check_load(Args()) == ("megatron-zb: resuming from iteration 10 (the checkpoint tracker's); "
                                          "iter_0000020 was not finished (a save stopped part-way) and is ignored")
