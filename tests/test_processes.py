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
@pytest.mark.parametrize("served", [False, True], ids=["own-zygote", "warm-server"])
def test_launch_reaps_what_ranks_leave_behind(served):
    from megatron_zb.verify.processes.launch import LaunchOptions, launch
    env = None if served else {"MZB_ZYGOTE_SERVER": ""}  # (tests/conftest.py names the servers)
    started = launch(_proc_fns.leave_things_behind, 1, options=LaunchOptions(cpu_shims=False, timeout=600, env=env))[0]
    assert len(set(started)) >= 4  # a Manager, its resource tracker, a detached sleeper and its child
    assert _running(started) == [], "still running after launch() returned"


@pytest.mark.dist
def test_a_launch_forks_from_the_warm_server_where_it_can_serve_it():
    """tests/conftest.py starts two servers (verify.processes.zygote_server) for the dist tests: a launch
    with the CPU shims forks its zygote from the one that imported megatron-core, one without them
    from the one that imported torch alone (no import of their own), and one whose environment
    differs in a variable the imports may read starts its own zygote."""
    from megatron_zb.verify.processes.launch import LaunchOptions, launch
    assert len(os.environ.get("MZB_ZYGOTE_SERVER", "").split(os.pathsep)) == 2, "tests/conftest.py names two"
    for shims in (True, False):
        served = launch(_proc_fns.zygote_parent, 2, options=LaunchOptions(cpu_shims=shims, timeout=600))
        (pid, cmd), other = served
        assert other == (pid, cmd) and pid != os.getpid(), served
        assert "megatron_zb.verify.processes.zygote_server" in cmd and cmd.split()[-1] == str(int(shims)), cmd
    own = launch(_proc_fns.zygote_parent, 2, options=LaunchOptions(timeout=600, env={"MZB_ANYTHING": "1"}))
    assert [pid for pid, _ in own] == [os.getpid()] * 2, own


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


_STUCK_PASS = textwrap.dedent("""
    import datetime, subprocess, sys, time
    import torch.distributed as dist
    from megatron_zb.runtime.observe.progress import Progress
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    p = Progress(0, ("127.0.0.1", store.port), period_s=0.1)
    p.pp_rank = 0
    p.start()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    def a_pass_that_hangs():
        p.begin("F0.3")
        deadline = time.time() + 300  # until the progress thread has written the stacks, at any load
        while not p._dumped and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(float(sys.argv[1]))  # and a while longer: nothing more is written for this pass
        p.end("F0.3")
    a_pass_that_hangs()
    p.stop()
    p._thread.join(60)  # its last round, and the writing, done
    child.kill(); child.wait()
""")


def test_a_rank_stuck_in_a_pass_writes_its_stacks_once():
    """runtime.observe.stack_dump through the progress thread: one header naming the rank, the pass and its
    child processes (e.g. data-loader workers), then every thread's stack, once per pass."""
    env = dict(os.environ, MZB_STACK_DUMP_S="0.5", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", _STUCK_PASS, "1.0"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    err = out.stderr
    assert err.count("megatron-zb: pipeline rank 0 (global rank 0) has been running F0.3 for ") == 1, err
    assert "its child processes: pid " in err and "state S (" in err and "time.sleep(30)" in err, err
    assert "in a_pass_that_hangs" in err and "in dump_stuck_pass" in err, err  # the stuck thread's and its own
