"""No process left behind: the launcher reaps what ranks start, and the suite's own check
(tests/conftest.py, after every test) catches a test that leaves a process running. Megatron's
checkpoint writer being stopped in the ranks: tests/test_checkpoint_resume.py."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests import _proc_fns

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _running(pids):
    import psutil
    out = []
    for pid in set(pids):
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.dist
def test_launch_reaps_what_ranks_leave_behind():
    from megatron_zb.verify.launch import launch
    started = launch(_proc_fns.leave_things_behind, 1, cpu_shims=False, timeout=120)[0]
    assert len(set(started)) >= 4  # a Manager, its resource tracker, a detached sleeper and its child
    assert _running(started) == [], "still running after launch() returned"


def test_the_suite_fails_a_test_that_leaves_a_process(tmp_path):
    test = tmp_path / "test_leaky.py"
    test.write_text(textwrap.dedent("""
        import subprocess, sys
        def test_leaks():
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                             start_new_session=True)
        def test_clean():
            subprocess.run([sys.executable, "-c", "pass"], check=True)
    """))
    env = dict(os.environ, MZB_LEFTOVER_GRACE_S="1", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                        "--rootdir", str(tmp_path), str(test)],
                       capture_output=True, text=True, cwd=str(tmp_path), env=env, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "test_leaks left 1 process(es) running" in out and "time.sleep(300)" in out, out
    assert "2 passed, 1 error" in out, out  # test_leaks passes, its teardown fails
