"""The SLURM path for real: a one-node cluster on this machine runs scripts/slurm/pretrain_gpt_zb.sbatch.

``scripts/slurm/run_local_slurm.sh`` starts munged, slurmctld and slurmd (their files under a
temporary directory), submits the sbatch job (tiny CPU GPT, zb-v, PP=2, 2 gloo ranks through
srun -> torchrun with a c10d rendezvous), waits, and checks that the log shows every iteration
with a falling loss; it stops the daemons it started. About 30 s.

Runs when the process is root and Debian's slurm-wlm and munge are installed; with
``MZB_TEST_SLURM=1`` it also installs them (apt-get) when missing; ``MZB_TEST_SLURM=0`` skips it.
Needs a megatron-core with megatron.training (run with ``MZB_MCORE=0.19.2``).
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.test_pretrain_entry import _has_megatron_training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "slurm", "run_local_slurm.sh")

pytestmark = [pytest.mark.megatron, pytest.mark.dist]


def _skip_reason():
    want = os.environ.get("MZB_TEST_SLURM", "")
    if want == "0":
        return "MZB_TEST_SLURM=0"
    if not _has_megatron_training():
        return "this megatron-core has no megatron.training; run with MZB_MCORE=0.19.2"
    if os.geteuid() != 0:
        return "starting munged/slurmctld/slurmd needs root (run scripts/slurm/run_local_slurm.sh as root)"
    installed = all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "sbatch"))
    if not installed and want != "1":
        return "slurm-wlm/munge are not installed (MZB_TEST_SLURM=1 lets the script apt-get them)"
    return None


@pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
def test_sbatch_job_trains_on_a_local_one_node_cluster(tmp_path):
    env = dict(os.environ, SLURM_DIR=str(tmp_path / "slurm"), SCHEDULE="zb-v", ITERS="12", PP="2",
               PYTHON=sys.executable, OMP_NUM_THREADS="1", JOB_TIMEOUT="300")
    if env.get("MZB_MCORE_PATH"):
        env["MZB_MCORE"] = env["MZB_MCORE_PATH"]
    env.pop("SLURM_CONF", None)
    proc = subprocess.run(["bash", SCRIPT], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-5000:]
    assert "OK: SLURM job trained with zb-v (12 iterations" in proc.stdout
    m = re.search(r"lm loss ([0-9.E+-]+) -> ([0-9.E+-]+)", proc.stdout)
    assert m and float(m.group(2)) < float(m.group(1)) - 0.3
    outs = list((tmp_path / "slurm" / "jobs").glob("pretrain_gpt_zb-*.out"))
    assert len(outs) == 1
    text = outs[0].read_text()
    assert "rendezvous" in text and "megatron-zb: schedule zb-v installed (v placement" in text
