"""A user's own Megatron-LM script, unmodified, through the launcher (``python -m megatron_zb.run``).

``tests/megatron_lm_style/pretrain_gpt.py`` is a Megatron-LM-style script of our own (model_provider,
forward_step, ``pretrain`` from ``megatron.training``, nothing of megatron-zb in it), trained on 2
gloo ranks through ``scripts/pretrain_gpt_zb.sh SCRIPT=...``: V placement (zb-v, also with a layout), replicated
stages (bitpipe) and one-chunk schedules (zb-h1) give losses identical to Megatron's own 1F1B with
deterministic initialisation, through ``get_model`` and through 0.19's model builder. Needs a
megatron-core with ``megatron.training`` (run with ``MZB_MCORE=0.19.2``).
"""
import os
import re
import subprocess
import sys

import pytest
from tests._ports import free_port
from tests.test_pretrain_entry import needs_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "megatron_lm_style", "pretrain_gpt.py")
ITERS = 3
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")

pytestmark = [pytest.mark.megatron, pytest.mark.dist, needs_training]


def run(schedule, builder=False, extra="", timeout=900):  # a hang guard (about 22 s on a quiet box)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHON=sys.executable, FORCE_CPU="1",
               SCRIPT=SCRIPT, SCHEDULE=schedule, PP="2", ITERS=str(ITERS), MASTER_PORT=str(free_port()),
               MZB_TEST_BUILDER="1" if builder else "0", EXTRA_ARGS=f"--zero-bubble-deterministic-init {extra}")
    if env.get("MZB_MCORE_PATH"):
        env["MZB_MCORE"] = env["MZB_MCORE_PATH"]
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "pretrain_gpt_zb.sh")], env=env, cwd=ROOT,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return p.returncode, p.stdout, [float(m.group(2)) for m in LOSS.finditer(p.stdout)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    profile = tmp_path_factory.mktemp("profile") / "zb-h1.json"
    # one torchrun job each (~22 CPU seconds, nearly all start-up). V placements run as zb-v three
    # ways (get_model, 0.19's model builder, a layout); v-half, another V order on the same path,
    # was a fourth (its order under megatron-core: tests/test_runtime_megatron.py)
    cases = {"megatron": ("megatron", False), "zb-v": ("zb-v", False), "zb-v/builder": ("zb-v", True),
             "bitpipe": ("bitpipe", False),
             # Megatron's layout flag under a V (read in V order): rank 0 holds the embedding alone and the loss alone
             "zb-v/layout": ("zb-v", False, "--pipeline-model-parallel-layout E|ttt|t|L"),
             "zb-h1": ("zb-h1", False, f"--zero-bubble-profile-window 1 2 --zero-bubble-profile-path {profile}")}
    return {name: run(*case) for name, case in cases.items()}


def test_megatrons_own_schedule_runs_and_says_so(runs):
    rc, out, losses = runs["megatron"]
    assert rc == 0, out[-4000:]
    assert len(losses) == ITERS
    assert "megatron-zb: no zero-bubble flag given; Megatron's own pipeline schedules run" in out
    assert "megatron-zb: adjusted for this machine:" in out  # no CUDA: said in one line


@pytest.mark.parametrize("name", ["zb-v", "zb-v/builder", "zb-v/layout", "bitpipe", "zb-h1"])
def test_schedules_from_the_users_script_equal_megatrons_1f1b(runs, name):
    rc, out, losses = runs[name]
    assert rc == 0, f"{name}:\n{out[-4000:]}"
    assert losses == runs["megatron"][2], f"{name}: {losses} vs Megatron's 1F1B {runs['megatron'][2]}"
    schedule = name.split("/")[0]
    placement = {"zb-v": "v", "bitpipe": "bitpipe", "zb-h1": "single"}[schedule]
    banner = [l for l in out.splitlines() if l.startswith(f"megatron-zb: schedule {schedule} installed")]
    assert len(banner) == 1, out[-3000:]  # one line, rank 0 only
    assert f"({placement} placement" in banner[0] and "pipeline size 2" in banner[0] and "bubble" in banner[0]
    assert "through megatron_zb.run" in banner[0]
    assert f"megatron-zb: {ITERS} training iteration(s) ran through {schedule}" in out
    if name == "zb-v/layout":  # the layout's chunks, and the schedule planned with each chunk's share
        assert "pipeline rank 0 chunk 1: stage 3 of 4, no layers, loss" in out
        assert "pipeline rank 1 chunk 0: stage 1 of 4, layers 0-2" in out
        assert "for the layout E|t*3|t|L" in banner[0]
    elif placement in ("v", "bitpipe"):  # each chunk says what it holds
        assert "pipeline rank 0 chunk 1: stage 3 of 4, layers 3-3, loss" in out or placement == "bitpipe"
    if name == "zb-h1":  # profiled: the end line sets the measured iteration against the simulator's
        assert re.search(r"ran through zb-h1; profiled iterations 1-2: [0-9.]+ ms measured, [0-9.]+ ms simulated "
                         r"from their F/B/W \([+-][0-9.]+%\)", out), out[-2000:]


def test_a_bad_flag_is_one_line_before_megatrons_argument_dump():
    rc, out, _ = run("zb-v", extra="--num-layers-per-virtual-pipeline-stage 1")
    assert rc == 2, out[-3000:]
    assert "Traceback" not in out
    errors = [l for l in out.splitlines() if l.startswith("megatron-zb: error:")]
    assert errors and "--num-layers-per-virtual-pipeline-stage" in errors[0]
    assert "arguments ------" not in out  # refused before Megatron prints its arguments


def test_the_launcher_refuses_a_missing_script_in_one_line():
    p = subprocess.run([sys.executable, "-m", "megatron_zb.run", "/no/such/pretrain_gpt.py", "--num-layers", "4"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [
        "megatron-zb: error: no such training script '/no/such/pretrain_gpt.py' (usage: torchrun ... -m "
        "megatron_zb.run path/to/pretrain_gpt.py <Megatron flags> <megatron-zb flags> (e.g. --zero-bubble-schedule "
        "zb-v))"]
