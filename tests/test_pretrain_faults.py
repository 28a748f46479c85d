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
import signal
import subprocess
import sys
import time

import pytest

from tests.test_pretrain_entry import ROOT, SCRIPT, _env, _free_port, needs_training, parse_log, run_script

pytestmark = [pytest.mark.megatron, needs_training]


def _losses(text):
    return {it: loss for it, _, _, loss in parse_log(text)}


# --------------------------------------------------------------------------------------------
# checkpoints and placement
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    runs = {}

    def run(name, **env):  # the flag check before torchrun has its own tests
        runs[name] = run_script(PREFLIGHT=0, **env)
        return runs[name]

    # the uninterrupted zb-v run, saving torch_dist checkpoints at iterations 2 and 4
    run("zb-v dist", SCHEDULE="zb-v", PP=2, ITERS=4, SAVE=tmp / "dist", SAVE_INTERVAL=2)
    # zb-v, per-rank torch format, saved at iteration 2 (same learning-rate schedule: 4 iterations)
    run("zb-v torch", SCHEDULE="zb-v", PP=2, ITERS=4, SAVE=tmp / "torch",
        EXTRA_ARGS="--ckpt-format torch --exit-interval 2")
    run("1f1b from zb-v torch", SCHEDULE="1f1b", PP=2, ITERS=3, LOAD=tmp / "torch", EXTRA_ARGS="--ckpt-format torch")
    conv = subprocess.run([sys.executable, "-m", "megatron_zb.megatron.convert_checkpoint", "--load", str(tmp / "torch"),
                           "--save", str(tmp / "torch-1f1b"), "--to-schedule", "1f1b"], env=_env(), cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    runs["convert"] = (conv.returncode, conv.stdout)
    run("1f1b from converted", SCHEDULE="1f1b", PP=2, ITERS=3, LOAD=tmp / "torch-1f1b",
        EXTRA_ARGS="--ckpt-format torch --no-load-optim")
    for sched, extra in (("1f1b", ""), ("interleaved-1f1b", "--num-layers-per-virtual-pipeline-stage 1")):
        run(f"{sched} from zb-v dist", SCHEDULE=sched, PP=2, ITERS=4, LOAD=tmp / "dist",
            EXTRA_ARGS=f"--ckpt-step 2 {extra}")
    return runs


def _ok(runs, name):
    rc, text = runs[name]
    assert rc == 0, f"{name} failed (rc {rc}):\n{text[-3000:]}"
    return text


def test_a_per_rank_checkpoint_of_another_placement_is_refused_with_one_line(ckpt_runs):
    _ok(ckpt_runs, "zb-v torch")
    rc, text = ckpt_runs["1f1b from zb-v torch"]
    assert rc == 2, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("megatron-zb: error:")]
    assert len(errors) == 1, errors
    assert "was saved with zb-v, v placement, PP=2 (rank 0: layers 0 + 3, rank 1: layers 1 + 2), but this run " \
           "uses 1f1b, single placement, PP=2 (rank 0: layers 0-1, rank 1: layers 2-3)" in errors[0]
    assert "--ckpt-format torch_dist" in errors[0] and "convert_checkpoint" in errors[0]
    assert "Traceback" not in text and "iteration        1/" not in text


def test_the_converted_checkpoint_gives_the_uninterrupted_loss(ckpt_runs):
    rc, out = ckpt_runs["convert"]
    assert rc == 0 and "zb-v, v placement" in out and "-> 1f1b, single placement" in out, out
    ref = _losses(_ok(ckpt_runs, "zb-v dist"))
    got = _losses(_ok(ckpt_runs, "1f1b from converted"))
    assert sorted(got) == [3], got
    # iteration 3's loss is computed with the loaded weights (before any update): exact
    assert got[3] == pytest.approx(ref[3], rel=1e-6), (got, ref)


@pytest.mark.parametrize("sched", ["1f1b", "interleaved-1f1b"])
def test_torch_dist_moves_between_placements_with_the_uninterrupted_losses(ckpt_runs, sched):
    ref = _losses(_ok(ckpt_runs, "zb-v dist"))
    text = _ok(ckpt_runs, f"{sched} from zb-v dist")
    got = _losses(text)
    assert "the torch_dist format maps layers by their global names" in text
    assert sorted(got) == [3, 4], got
    for it in (3, 4):
        assert got[it] == pytest.approx(ref[it], rel=1e-5), (it, got, ref)
