"""Session-wide test conventions.

* ``MZB_MCORE`` selects the megatron-core the megatron tests run against: unset (or
  ``installed``) = the one installed in the venv (0.16.1 here); a version such as ``0.19.2`` =
  ``<repo>/.venv/mcore-0.19.2``; or a directory holding ``megatron/core``. The chosen directory is
  put first on ``sys.path`` in this process and on ``PYTHONPATH`` for every subprocess, and
  ``megatron_zb.verify.processes.launch`` puts it first in every rank it starts.
* This checkout's own package comes first on ``sys.path`` and ``PYTHONPATH`` (a shared venv's
  editable install may point at another checkout).
* Multi-process tests are marked ``dist`` (``pytest -m dist``), tests that import megatron
  ``megatron`` (``scripts/run_tests.sh`` reruns ``-m megatron`` on megatron-core 0.19.2).
* Fixtures: ``mcore_path`` (the directory or None), ``mcore_version`` (the version string the
  ranks must report, or None when it is "whatever is installed"), and ``rank_pool``: a callable
  ``rank_pool(fn, cases, world_size, timeout=...)`` -> ``results[case][rank]`` that runs
  ``fn(case)`` on ``world_size`` real gloo processes (one launch for all cases; see
  ``megatron_zb.verify.processes.launch.run_cases``).

* No process left behind: the pytest process is a child subreaper (Linux), so whatever a test
  starts stays its descendant even when orphaned; after every test, a process that the test
  started and that is still running (after a grace of a few seconds) fails the test's teardown,
  naming the processes (they are then killed), and the session ends with the same check.

* Two warm zygote servers per pytest process that runs ``dist`` tests
  (``megatron_zb.verify.processes.zygote_server``, their sockets in ``$MZB_ZYGOTE_SERVER``): one imports torch,
  the CPU shims and megatron-core once, the other torch alone, and each forks the zygote of every
  launch it fits (this process's and its CLIs'): the launch's megatron-core, checkout and
  environment are the server's; ``MZB_ZYGOTE_SERVER=0``: none (every launch imports for itself).

* Hypothesis draws the same examples on every run (``derandomize``): a property test's time and
  outcome do not change from one run to the next (the schedule searches it calls range from
  milliseconds to seconds, so random draws moved one test between 2.6 and 18 CPU s). ``MZB_HYPOTHESIS=random``:
  fresh random examples, to explore.

* ``--cpu-durations N``: the N tests that took the most CPU seconds (user + system of this process and
  of every process it waited for, the ranks and their launchers included; per phase, like
  ``--durations``). A busy host stretches wall times, not these: how to find what to shorten.

Nothing here imports torch or megatron (the schedule-core tests stay light).
"""
from __future__ import annotations

import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _resolve_mcore():
    want = os.environ.get("MZB_MCORE", "").strip()
    if not want or want in ("installed", "default", "site"):
        return None, None
    path = want if os.path.isdir(want) else os.path.join(ROOT, ".venv", f"mcore-{want}")
    path = os.path.abspath(path)
    version = None if os.path.isdir(want) else want
    return path, version


# This checkout's package first, here and in every subprocess (console scripts, ranks, shell
# scripts): a venv's editable install may point at another checkout of the project
if ROOT in sys.path:
    sys.path.remove(ROOT)
sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT])

MCORE_PATH, MCORE_VERSION = _resolve_mcore()
_MCORE_ERROR = None
if MCORE_PATH is not None:
    if not os.path.isdir(os.path.join(MCORE_PATH, "megatron", "core")):
        _MCORE_ERROR = f"MZB_MCORE={os.environ.get('MZB_MCORE')}: no megatron/core under {MCORE_PATH}"
    else:
        if MCORE_PATH in sys.path:
            sys.path.remove(MCORE_PATH)
        sys.path.insert(0, MCORE_PATH)
        parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != MCORE_PATH]
        os.environ["PYTHONPATH"] = os.pathsep.join([MCORE_PATH] + parts)
        os.environ["MZB_MCORE_PATH"] = MCORE_PATH


def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="show the N tests that took the most CPU seconds (this process and every process it "
                          "waited for, ranks included): unlike --durations, the same on a busy host")


def pytest_configure(config):
    if _MCORE_ERROR:
        raise pytest.UsageError(_MCORE_ERROR)
    _become_subreaper()
    for line in ("dist: launches several real torch.distributed processes",
                 "megatron: needs torch and megatron-core (run on both megatron-core versions)",
                 "version_free: a megatron test whose outcome does not depend on megatron-core's version "
                 "(megatron-zb's own process handling, launcher, progress, stall watch): the 0.19.2 pass leaves it out",
                 "timing: measures time, never a figure that changes with the host's load (scripts/stress_tests.sh "
                 "runs these beside busy processes)"):
        config.addinivalue_line("markers", line)


def _hypothesis_profile() -> None:
    if os.environ.get("MZB_HYPOTHESIS", "") == "random":
        return
    try:
        from hypothesis import settings
    except ImportError:  # pragma: no cover - hypothesis is a test dependency
        return
    settings.register_profile("mzb-derandomized", derandomize=True)
    settings.load_profile("mzb-derandomized")


_hypothesis_profile()


def pytest_report_header(config):
    return f"megatron-core for megatron tests: {MCORE_PATH or 'installed'} (MZB_MCORE)"


@pytest.fixture(scope="session")
def mcore_path():
    return MCORE_PATH


@pytest.fixture(scope="session")
def mcore_version():
    """The version the ranks must report (from MZB_MCORE, else the installed distribution)."""
    if MCORE_VERSION:
        return MCORE_VERSION
    if MCORE_PATH:
        return None
    try:
        from importlib.metadata import version
        return version("megatron-core")
    except Exception:  # pragma: no cover
        return None


@pytest.fixture(scope="session")
def rank_pool():
    """``rank_pool(fn, cases, world_size, timeout=300, **kw)`` -> results[case][rank]."""
    from megatron_zb.verify.processes.launch import LaunchOptions, run_cases

    def run(fn, cases, world_size, timeout=300.0, **kw):
        kw.setdefault("mcore_path", MCORE_PATH)
        return run_cases(fn, cases, world_size, LaunchOptions(timeout=timeout, **kw))
    return run


# -- no process left behind ----------------------------------------------------------------------

LEFTOVER_GRACE_S = float(os.environ.get("MZB_LEFTOVER_GRACE_S", "10"))  # orphans may take a moment to exit


def _become_subreaper() -> None:
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def _own_helpers() -> set:
    """Processes this pytest process keeps for itself: multiprocessing's resource tracker (it
    exits with the process) and the warm zygote servers (not what they fork: each launch's
    zygote must end with its launch)."""
    mods = sys.modules.get("multiprocessing.resource_tracker")
    pid = getattr(getattr(mods, "_resource_tracker", None), "_pid", None)
    return {p for p in [pid] + [proc.pid for proc, _ in _ZYGOTE_SERVERS] if p}


# -- warm zygote servers for the pytest processes that run multi-process tests ---------------------
# (megatron_zb.verify.processes.zygote_server: one imports torch, the CPU shims and megatron-core once, the
# other torch alone, and each forks the zygotes of the launches it fits, of this process and of the
# CLIs it runs, so those launches cost no import; MZB_ZYGOTE_SERVER=0: none)

_ZYGOTE_SERVERS = []  # (Popen, its socket's folder)


def pytest_collection_finish(session):
    if os.environ.get("MZB_ZYGOTE_SERVER", "") == "0" or _ZYGOTE_SERVERS:
        return
    if not any(item.get_closest_marker("dist") for item in session.items):
        return
    import subprocess
    import tempfile
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("MZB_ZYGOTE_SERVER", None)
    paths = []
    for shims in ("1", "0"):
        d = tempfile.mkdtemp(prefix="mzb-zygote-server-")
        paths.append(os.path.join(d, "socket"))
        with open(os.path.join(d, "server.log"), "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "megatron_zb.verify.processes.zygote_server", paths[-1],
                                     str(os.getpid()), MCORE_PATH or "", shims], env=env, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        _ZYGOTE_SERVERS.append((proc, d))
    os.environ["MZB_ZYGOTE_SERVER"] = os.pathsep.join(paths)


def _stop_zygote_servers() -> None:
    import shutil
    keep = os.environ.get("MZB_ZYGOTE_SERVER_LOG")  # a file: the servers' logs (a line per launch)
    if _ZYGOTE_SERVERS:
        os.environ.pop("MZB_ZYGOTE_SERVER", None)
    while _ZYGOTE_SERVERS:
        proc, d = _ZYGOTE_SERVERS.pop()
        proc.kill()
        proc.wait()
        if keep:
            with open(keep, "ab") as out, open(os.path.join(d, "server.log"), "rb") as f:
                out.write(f.read())
        shutil.rmtree(d, ignore_errors=True)


def _server_cpu() -> tuple:
    """The warm servers' CPU seconds, with every launch's they reaped (user, system; /proc)."""
    u = s = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for proc, _ in _ZYGOTE_SERVERS:
        try:
            with open(f"/proc/{proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
        u, s = u + (utime + cutime) / tick, s + (stime + cstime) / tick
    return u, s


def live_descendants() -> dict:
    """{pid: command line} of the running (not zombie) descendants of this process."""
    import psutil
    out = {}
    own = _own_helpers()
    for c in psutil.Process().children(recursive=True):
        try:
            if c.pid in own or c.status() == psutil.STATUS_ZOMBIE:
                continue
            out[c.pid] = " ".join(c.cmdline())[:160]
        except psutil.NoSuchProcess:
            continue
    return out


def leftover_processes(before=(), grace: float = LEFTOVER_GRACE_S) -> dict:
    """Descendants not in ``before`` still running after up to ``grace`` seconds."""
    end = time.monotonic() + grace
    while True:
        left = {p: c for p, c in live_descendants().items() if p not in before}
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.1)


def _kill(pids) -> None:
    import psutil
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.NoSuchProcess:
            pass


@pytest.fixture(autouse=True)
def _no_process_left_behind(request):
    before = set(live_descendants())
    yield
    left = leftover_processes(before)
    if left:
        _kill(left)
        listing = "; ".join(f"pid {p}: {c}" for p, c in sorted(left.items()))
        pytest.fail(f"{request.node.nodeid} left {len(left)} process(es) running: {listing}", pytrace=False)


def pytest_sessionfinish(session, exitstatus):
    _stop_zygote_servers()
    left = leftover_processes(grace=LEFTOVER_GRACE_S)
    if left:
        _kill(left)
        sys.stderr.write(f"\nprocesses left running when the test session ended (killed now): "
                         + "; ".join(f"pid {p}: {c}" for p, c in sorted(left.items())) + "\n")
        session.exitstatus = 1


# -- CPU seconds per test (--cpu-durations) ----------------------------------------------------------

_CPU = []  # (seconds, system seconds, phase, nodeid)


def _cpu_now():
    import resource
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    su, ss = _server_cpu()  # the launches the warm server forked (it is not waited for until the end)
    return me.ru_utime + kids.ru_utime + su, me.ru_stime + kids.ru_stime + ss


def _cpu_since(t0, phase, item):
    u, s = _cpu_now()
    _CPU.append((u - t0[0] + s - t0[1], s - t0[1], phase, item.nodeid))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    t = _cpu_now()
    yield
    _cpu_since(t, "setup", item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    t = _cpu_now()
    yield
    _cpu_since(t, "call", item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    t = _cpu_now()
    yield
    _cpu_since(t, "teardown", item)


def pytest_terminal_summary(terminalreporter, config):
    n = config.getoption("--cpu-durations")
    if n is None or not _CPU:
        return
    total, system = sum(c[0] for c in _CPU), sum(c[1] for c in _CPU)
    terminalreporter.write_sep("=", f"slowest {n or len(_CPU)} tests in CPU seconds (of {total:.0f} s in all, "
                                    f"{system:.0f} s of it system)")
    for c, sys_s, phase, nodeid in sorted(_CPU, reverse=True)[: n or None]:
        terminalreporter.write_line(f"{c:8.2f}s cpu ({sys_s:6.2f}s sys) {phase:<8} {nodeid}")
