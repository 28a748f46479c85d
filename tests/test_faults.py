"""Faults: the rank that stopped is named by every rank; no rank outlives its launcher.

* ``runtime.observe.progress``'s diagnosis on fabricated records (a stopped rank, a rank stuck in a pass
  found by following who waits for whom, a deadlock cycle, a rank that never published);
* real gloo ranks (``verify.processes.launch``) training a tiny GPT with zb-v at PP=4: one rank stops itself
  with SIGSTOP in the middle of an iteration; every other rank's PipelineTimeout names it, within
  the timeout plus a few seconds;
* killing the verify launcher's process with SIGKILL ends its ranks.

The torchrun versions (the training entry point) are in tests/test_pretrain_faults.py.
"""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from megatron_zb.runtime.observe.progress import diagnose_records
from tests._host import overload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rec(rank, seq, hb, pp=None, wait=None, cur=None, done="B1.0", it=3):
    return {"rank": rank, "pp": rank if pp is None else pp, "host": "h", "pid": 100 + rank, "seq": seq, "hb": hb,
            "it": it, "cur": cur, "cur_t": hb - 1, "done": done, "done_t": hb - 2,
            "wait": None if wait is None else {"what": "the input of F2.1", "pp": wait, "rank": wait, "since": hb - 1}}


def test_a_silent_rank_is_named_even_when_nobody_waits_for_it_directly():
    # rank 2 stopped (its heartbeat did not move); rank 0 waited for rank 1, which waits for rank 2
    first = {0: _rec(0, 5, 100, wait=1), 1: _rec(1, 5, 100, wait=2), 2: _rec(2, 3, 90, cur="F2.1"),
             3: _rec(3, 5, 100, wait=2)}
    second = {0: _rec(0, 7, 101, wait=1), 1: _rec(1, 7, 101, wait=2), 2: _rec(2, 3, 90, cur="F2.1"),
              3: _rec(3, 7, 101, wait=2)}
    msg = diagnose_records(first, second, 0, 1, now=101)
    assert "stopped progressing first is pipeline rank 2 (global rank 2" in msg
    assert "no heartbeat for 11s" in msg and "running F2.1" in msg


def test_of_two_silent_ranks_the_one_that_stopped_first_is_named():
    first = {0: _rec(0, 5, 100, wait=1), 1: _rec(1, 4, 95), 2: _rec(2, 3, 90)}
    second = {0: _rec(0, 7, 101, wait=1), 1: _rec(1, 4, 95), 2: _rec(2, 3, 90)}
    assert "first is pipeline rank 2" in diagnose_records(first, second, 0, 1, now=101)


def test_a_responding_rank_stuck_in_a_pass_is_found_along_the_waits():
    recs = {0: _rec(0, 5, 100, wait=1), 1: _rec(1, 5, 100, wait=2), 2: _rec(2, 5, 100, cur="W2.3")}
    second = {g: dict(r, seq=r["seq"] + 2) for g, r in recs.items()}
    msg = diagnose_records(recs, second, 0, 1, now=100)
    assert "first is pipeline rank 2 (global rank 2" in msg and "not waiting for a pipeline message" in msg
    assert "running W2.3" in msg and "reached through pipeline rank 1" in msg


def test_a_wait_cycle_is_called_a_deadlock():
    recs = {0: _rec(0, 5, 100, wait=1), 1: _rec(1, 5, 100, wait=0)}
    second = {g: dict(r, seq=r["seq"] + 2) for g, r in recs.items()}
    assert "cycle (a deadlock" in diagnose_records(recs, second, 0, 1, now=100)


def test_a_rank_that_never_published_is_named():
    first = {0: _rec(0, 5, 100, wait=1), 1: None}
    second = {0: _rec(0, 7, 101, wait=1), 1: None}
    assert "global rank 1: it never published any progress" in diagnose_records(first, second, 0, 1)


# --------------------------------------------------------------------------------------------
# real ranks
# --------------------------------------------------------------------------------------------

TIMEOUT_S = 3.0


@pytest.mark.version_free  # megatron-zb's progress records and stall watch: megatron only builds the model
@pytest.mark.megatron
@pytest.mark.dist
@pytest.mark.timing
def test_the_stopped_rank_is_named_by_every_rank(rank_pool, tmp_path):
    from megatron_zb.verify.processes.launch import RankError
    from tests import _fault_fns

    case = dict(schedule="zb-v", placement="v", pp=4, chunks=2, timeout=TIMEOUT_S, stop_rank=1, stop_at=2,
                stop_delay=0.3, out=str(tmp_path))
    with pytest.raises(RankError) as info:
        rank_pool(_fault_fns.stop_one_rank, [case], 4, timeout=120)
    assert info.value.exc_type in ("PipelineTimeout", "PeerLost")
    stopped_at = float((tmp_path / "stopped_at").read_text())
    messages = {}
    for f in glob.glob(str(tmp_path / "rank*.txt")):
        t, msg = open(f).read().split("\n", 1)
        messages[os.path.basename(f)] = (float(t) - stopped_at, msg)
    assert sorted(messages) == ["rank0.txt", "rank2.txt", "rank3.txt"], messages
    for name, (secs, msg) in messages.items():
        # a rank whose peer ended after its own timeout loses the connection before its timeout
        # fires: PeerLost (a PipelineTimeout) then names the same culprit
        assert msg.startswith(("PipelineTimeout: pipeline rank", "PeerLost: pipeline rank")), msg
        assert "the rank that stopped progressing first is pipeline rank 1 (global rank 1," in msg, (name, msg)
        # detected within the timeout plus the 1.2 s check (and slack for a loaded machine)
        assert TIMEOUT_S <= secs < TIMEOUT_S + 9 * overload(), (name, secs)


_LAUNCHER = textwrap.dedent("""
    import sys
    from megatron_zb.verify.processes.launch import LaunchOptions, launch
    from tests import _fault_fns
    launch(_fault_fns.write_pid_and_sleep, 2, {"out": sys.argv[1]}, options=LaunchOptions(timeout=600, cpu_shims=False))
""")


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.dist
@pytest.mark.timing
@pytest.mark.parametrize("served", [False, True], ids=["own-zygote", "warm-server"])
def test_ranks_end_when_the_verify_launcher_is_killed(tmp_path, served):
    """Its own zygote dies with the launcher; the warm server's (tests/conftest.py names them) is
    killed by the server when the launcher's connection ends. Either way the ranks die with it."""
    # the killed launcher cannot remove its launch folder: make it here, where pytest removes it
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in sys.path if p]),
               TMPDIR=str(tmp_path / "tmp"))
    if not served:
        env.pop("MZB_ZYGOTE_SERVER", None)
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(tmp_path)], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
            pids = [int(open(f).read()) for f in glob.glob(str(tmp_path / "pid*")) if open(f).read()]
        assert len(pids) == 2, f"the ranks did not start (launcher exit {proc.poll()})"
        proc.kill()
        proc.wait()
        t0, limit = time.monotonic(), 10 * overload()  # at once; slack for a busy host
        while any(_alive(p) for p in pids) and time.monotonic() - t0 < limit:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), f"ranks outlived their launcher by {limit:.0f} s"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in pids:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.version_free  # megatron-zb's progress records and stall watch: megatron only builds the model
@pytest.mark.megatron
@pytest.mark.dist
@pytest.mark.timing
def test_a_rank_stopped_outside_the_schedule_is_named_by_the_stall_watch(rank_pool, tmp_path):
    from megatron_zb.verify.processes.launch import LaunchError
    from tests import _fault_fns

    case = dict(schedule="1f1b", placement="single", pp=4, timeout=TIMEOUT_S, stop_rank=2, stop_at=1,
                out=str(tmp_path))
    with pytest.raises(LaunchError):
        rank_pool(_fault_fns.stop_outside_schedule, [case], 4, timeout=120)
    stopped_at = float((tmp_path / "stopped_at").read_text())
    found = {}
    for f in glob.glob(str(tmp_path / "rank*.txt")):
        t, msg = open(f).read().split("\n", 1)
        found[os.path.basename(f)] = (float(t) - stopped_at, msg)
    # the ranks' watches fire within half a second of each other; one that fires after the first
    # rank ended the stopped one sees its all-reduce fail instead (and the launcher stops the rest)
    assert found and set(found) <= {"rank0.txt", "rank1.txt", "rank3.txt"}, found
    for name, (secs, msg) in found.items():
        assert "outside the pipeline schedule" in msg, msg
        assert "the rank that stopped progressing first is pipeline rank 2 (global rank 2," in msg, (name, msg)
        assert TIMEOUT_S <= secs < TIMEOUT_S + 9 * overload(), (name, secs)


@pytest.mark.version_free  # megatron-zb's progress records and stall watch: megatron only builds the model
@pytest.mark.megatron
@pytest.mark.dist
@pytest.mark.timing
def test_a_rank_stopped_during_a_checkpoint_save_is_named(rank_pool, tmp_path):
    """The stall watch covers saves: a rank stopped while every rank saves is named, with what it
    was doing, by the ranks waiting inside the save (no silent hang until Megatron's distributed
    timeout)."""
    from megatron_zb.verify.processes.launch import LaunchError
    from tests import _fault_fns

    case = dict(pp=4, timeout=TIMEOUT_S, stop_rank=1, out=str(tmp_path))
    with pytest.raises(LaunchError):
        rank_pool(_fault_fns.stop_while_saving, [case], 4, timeout=120)
    stopped_at = float((tmp_path / "stopped_at").read_text())
    found = {}
    for f in glob.glob(str(tmp_path / "rank*.txt")):
        t, msg = open(f).read().split("\n", 1)
        found[os.path.basename(f)] = (float(t) - stopped_at, msg)
    assert found and set(found) <= {"rank0.txt", "rank2.txt", "rank3.txt"}, found
    for name, (secs, msg) in found.items():
        assert "has been saving checkpoint iter 7 for" in msg and "without writing" in msg, msg
        assert "the rank that stopped progressing first is pipeline rank 1 (global rank 1," in msg, (name, msg)
        assert TIMEOUT_S <= secs < TIMEOUT_S + 9 * overload(), (name, secs)


@pytest.mark.megatron
@pytest.mark.dist
@pytest.mark.version_free  # verify's launcher and its 45 s timeout: the same on every megatron-core
@pytest.mark.timing
def test_the_launch_timeout_names_a_rank_stuck_in_a_pass(rank_pool):
    from megatron_zb.verify.processes.launch import LaunchTimeout
    from tests import _fault_fns

    case = dict(schedule="1f1b", placement="single", pp=4, timeout=300.0, slow_rank=2, slow_at=0, sleep=600.0)
    with pytest.raises(LaunchTimeout) as info:  # the ranks reach the slow pass first, on a busy host too
        rank_pool(_fault_fns.slow_forward_on_one_rank, [case], 4, timeout=45 * min(overload(), 4))
    text = info.value.progress
    assert "the rank that stopped progressing first is pipeline rank 2 (global rank 2," in text, text
    assert "responds but is not waiting for a pipeline message: running F2." in text, text
