"""Run a Python function on N real processes (one torch.distributed rank each), never hanging.

    from megatron_zb.verify.processes.launch import LaunchOptions, launch, run_cases
    results = launch(fn, 2, "arg")                  # fn("arg") on ranks 0 and 1 -> [r0, r1]
    per_case = run_cases(fn, [c1, c2, c3], 4)        # one process group, fn(c) for each case
    run_cases(fn, cases, 2, LaunchOptions(timeout=60, cpu_shims=False))  # how the ranks start, are watched

* One fresh ``python`` subprocess per launch (the *zygote*) gets ``OMP_NUM_THREADS=1``, the
  parent's ``sys.path`` (so functions defined in test modules resolve) and, first of all, the
  megatron-core directory chosen by ``mcore_path`` / ``$MZB_MCORE_PATH`` / ``$MZB_MCORE``
  (a version: ``<repo>/.venv/mcore-<version>``). With gloo it imports torch, applies the CPU
  shims (no CUDA) and imports megatron-core once, then forks one process per rank (each in its
  own session, one torch thread): a rank costs no import of its own, which is most of a small
  launch's time. With NCCL it forks first and every rank imports for itself (CUDA must not be
  touched before a fork).
* The process group (gloo by default) rendezvouses through a ``TCPStore`` the parent opens on
  127.0.0.1 with a port the OS picks, so there is no port race.
* ``fn`` and the cases must be picklable (module-level functions); results must be picklable.
* An exception in a rank is re-raised here as ``RankError`` carrying that rank's traceback; the
  other ranks are killed after a short grace period (``grace``). If the whole launch runs past ``timeout``
  seconds, every rank still running is sent SIGUSR1 (faulthandler dumps its Python stacks into
  its log), then killed, and ``LaunchTimeout`` names the ranks that did not finish, the case they
  were in, their last ``set_status()`` text and the tail of their logs.
* Nothing is left behind: before a rank ends it stops what it or megatron started (megatron's
  checkpoint-writer Manager, any ``multiprocessing`` child); the zygote is a child subreaper
  (Linux), kills whatever is left in each finished rank's process group, reaps every orphan that
  comes back to it and exits only when it has no child left; the parent waits for that.
* ``set_status(text)`` (``verify.processes.rankio``; callable from rank code, e.g. an executor about to wait on
  a receive) is a memory write into a small per-rank mmap'd file, cheap enough to call before every
  pass. The ranks' side (the zygote, each rank's main) is ``verify.processes.zygote``.
"""
from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from .rankio import (STATUS_BYTES, TensorPickler, get_status, load_result, log_tail, read_int, read_status, repo_root,
                     set_status, status_file, td)
from .zygote_server import ServedZygote, ask_server

__all__ = ["LaunchOptions", "launch", "run_cases", "set_status", "get_status", "RankError", "LaunchTimeout",
           "LaunchError", "resolve_mcore_path", "repo_root"]

_ZYGOTE_EXIT_S = 15.0  # how long the parent waits for the zygote to reap everything before killing it


class LaunchError(RuntimeError):
    """Base class: a launch did not produce a result for every rank."""


class RankError(LaunchError):
    """A rank raised. ``rank``, ``case`` (index), ``exc_type``, ``rank_traceback``, ``log_tail``."""

    def __init__(self, rank: int, case: Optional[int], exc_type: str, message: str, rank_traceback: str,
                 log_tail: str = "", others: str = ""):
        self.rank, self.case, self.exc_type, self.message = rank, case, exc_type, message
        self.rank_traceback, self.log_tail = rank_traceback, log_tail
        where = f"rank {rank}" + (f" (case {case})" if case is not None else "")
        text = f"{where} raised {exc_type}: {message}\n--- traceback of {where} ---\n{rank_traceback.rstrip()}"
        if others:
            text += "\n" + others
        if log_tail:
            text += f"\n--- last lines of rank {rank}'s log ---\n{log_tail.rstrip()}"
        super().__init__(text)


class LaunchTimeout(LaunchError):
    """The launch ran past its timeout. ``ranks``: the unfinished ranks; ``statuses``: rank -> text;
    ``progress``: the pipeline progress report (``runtime.observe.progress``), naming the rank that stopped
    first, or ''."""

    def __init__(self, timeout: float, ranks: List[int], statuses: Dict[int, str], logs: Dict[int, str],
                 progress: str = ""):
        self.timeout, self.ranks, self.statuses, self.logs = timeout, ranks, statuses, logs
        self.progress = progress
        lines = [f"timed out after {timeout:g} s; rank(s) {', '.join(map(str, ranks))} did not finish"]
        if progress:
            lines.append(progress)
        for r in ranks:
            lines.append(f"  rank {r}: last status: {statuses.get(r) or '(none)'}")
        for r in ranks:
            if logs.get(r):
                lines.append(f"--- last lines of rank {r}'s log (stack dump included) ---\n{logs[r].rstrip()}")
        super().__init__("\n".join(lines))


def resolve_mcore_path(mcore_path: Optional[str] = None) -> Optional[str]:
    """Which megatron-core directory to put first on the ranks' sys.path (None: the installed one).

    Order: the argument, ``$MZB_MCORE_PATH`` (a directory), ``$MZB_MCORE`` (a directory, or a
    version such as ``0.19.2`` meaning ``<repo>/.venv/mcore-<version>``; ``installed`` or empty:
    none).
    """
    cand = mcore_path or os.environ.get("MZB_MCORE_PATH") or None
    if cand is None:
        v = os.environ.get("MZB_MCORE", "").strip()
        if v and v not in ("installed", "default", "site"):
            cand = v if os.path.isdir(v) else os.path.join(repo_root(), ".venv", f"mcore-{v}")
    if cand is None:
        return None
    cand = os.path.abspath(cand)
    if not os.path.isdir(os.path.join(cand, "megatron", "core")):
        raise LaunchError(f"megatron-core path {cand} has no megatron/core package")
    return cand




# --------------------------------------------------------------------------------------------
# parent side
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LaunchOptions:
    """How a launch starts its ranks and watches them."""

    timeout: float = 300.0  # seconds for the whole launch
    mcore_path: Optional[str] = None  # megatron-core's directory (``resolve_mcore_path``)
    backend: str = "gloo"
    cpu_shims: bool = True  # gloo: the zygote applies the CPU shims before importing megatron-core
    env: Optional[Dict[str, str]] = None  # added to the ranks' environment
    grace: float = 3.0  # seconds the other ranks get once one has raised
    keep_logs: bool = False  # keep the launch's folder (the ranks' logs) and say where
    barrier_between: bool = True  # a barrier between cases
    # called with the cases once megatron is imported, before any rank is forked (gloo); what it raises
    # fails every rank (a ``RankError`` naming its type), e.g. a model config Megatron refuses
    precheck: Optional[Callable] = None


def launch(fn: Callable, world_size: int, *args, options: Optional[LaunchOptions] = None, **kwargs) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the per-rank results."""
    return run_cases(_CallWith(fn, args, kwargs), [None], world_size, options)[0]


@dataclass
class _CallWith:
    fn: Callable
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def __call__(self, _case):
        return self.fn(*self.args, **self.kwargs)


def run_cases(fn: Callable, cases: Sequence[Any], world_size: int,
              options: Optional[LaunchOptions] = None) -> List[List[Any]]:
    """Run ``fn(case)`` on every rank for each case, in order, in one process group.

    Returns ``results[case_index][rank]``. Paying the process start and the megatron import once
    for many cases is the point. ``options``: how the ranks start and are watched (``LaunchOptions``;
    its ``timeout`` bounds the whole launch).
    """
    import torch.distributed as dist  # parent needs only torch (for the store)

    o = options if options is not None else LaunchOptions()
    timeout, backend, cpu_shims = o.timeout, o.backend, o.cpu_shims
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    cases = list(cases)
    mpath = resolve_mcore_path(o.mcore_path)
    workdir = tempfile.mkdtemp(prefix="mzb-launch-")
    procs: List[_Rank] = []
    zygote = None  # subprocess.Popen, or the warm server's zygote (the same calls)
    logs: List[Any] = []
    store = None
    try:
        store = dist.TCPStore("127.0.0.1", 0, world_size + 1, True, wait_for_workers=False,
                              timeout=td(timeout + 30))
        port = store.port
        sys_path = [p for p in sys.path if p]
        if mpath:
            sys_path = [mpath] + [p for p in sys_path if os.path.abspath(p) != mpath]
        header = {"sys_path": sys_path, "mcore_path": mpath, "cpu_shims": cpu_shims, "world_size": world_size,
                  "backend": backend}
        payload = os.path.join(workdir, "payload.pkl")
        with open(payload, "wb") as f:
            pickle.dump(header, f)
            TensorPickler(f, protocol=pickle.HIGHEST_PROTOCOL).dump(
                {"fn": fn, "cases": cases, "port": port, "timeout": timeout,
                 "barrier_between": o.barrier_between, "precheck": o.precheck})
        child_env = dict(os.environ)
        child_env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                          "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size),
                          "LOCAL_WORLD_SIZE": str(world_size), "PYTHONFAULTHANDLER": "1",
                          "MZB_LAUNCHER_PID": str(os.getpid())})
        old = child_env.get("PYTHONPATH")
        child_env["PYTHONPATH"] = os.pathsep.join(([mpath] if mpath else []) + [repo_root()] + ([old] if old else []))
        if o.env:
            child_env.update(o.env)
        for r in range(world_size):
            with open(status_file(workdir, r), "wb") as f:
                f.write(b"\0" * STATUS_BYTES)
        log = open(os.path.join(workdir, "zygote.log"), "wb")
        logs.append(log)
        # the warm server's zygote where one is named ($MZB_ZYGOTE_SERVER) and can serve it, else our own
        zygote = ask_server(workdir, child_env, header, timeout)
        if zygote is None:
            cmd = [sys.executable, "-m", "megatron_zb.verify.processes.zygote", workdir]
            zygote = subprocess.Popen(cmd, env=child_env, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        procs = [_Rank(workdir, r, zygote) for r in range(world_size)]
        return _wait(procs, workdir, world_size, timeout, o.grace, store)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)
        if zygote is not None and zygote.poll() is None:
            ranks_done = bool(procs) and all(
                read_int(os.path.join(workdir, f"exit{p.rank}")) is not None for p in procs)
            try:  # with every rank reaped it only cleans up what they left behind, then exits
                zygote.wait(timeout=_ZYGOTE_EXIT_S if ranks_done else 0.1)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(zygote.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                zygote.wait()
        if isinstance(zygote, ServedZygote):
            zygote.close()
        for log in logs:
            try:
                log.close()
            except Exception:
                pass
        del store
        if o.keep_logs:
            sys.stderr.write(f"[megatron-zb launch] rank logs kept in {workdir}\n")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


class _Rank:
    """A rank forked by the launch's zygote: its pid (once forked) and exit code (once reaped),
    read from the small files the zygote writes into the launch's folder."""

    def __init__(self, workdir: str, rank: int, zygote):
        self.workdir, self.rank, self.zygote = workdir, rank, zygote

    @property
    def pid(self) -> Optional[int]:
        return read_int(os.path.join(self.workdir, f"pid{self.rank}"))

    def poll(self) -> Optional[int]:
        code = read_int(os.path.join(self.workdir, f"exit{self.rank}"))
        if code is None and self.zygote.poll() is not None:  # the zygote is gone: nobody will report
            code = read_int(os.path.join(self.workdir, f"exit{self.rank}"))
            if code is None:
                code = self.zygote.returncode or -1
        return code


def _kill(p: _Rank) -> None:
    pid = p.pid
    if pid is not None:
        try:
            os.killpg(pid, signal.SIGKILL)  # the rank's own session: it and anything it started
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + 5
    while p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)


def _progress_report(store, world_size: int) -> str:
    """The ranks' pipeline progress (``runtime.observe.progress`` records in this launch's store): who
    stopped first, and one line per rank. '' when no rank published any."""
    from ...runtime.observe import progress as P
    try:
        ranks = list(range(world_size))
        first = P.read_records(store, ranks)
        if not any(first.values()):
            return ""
        time.sleep(P.CHECK_S)
        second = P.read_records(store, ranks)
    except Exception:  # noqa: BLE001 - a report, best effort
        return ""
    waiting = [g for g, rec in second.items() if rec and rec.get("wait")]
    silent = [g for g in ranks if second[g] is None or first[g] is None or second[g]["seq"] == first[g]["seq"]]
    if silent or waiting:
        me = waiting[0] if waiting else -1
        peer = second[me]["wait"]["rank"] if waiting else -1
        head = P.diagnose_records(first, second, me, peer, kill_stopped=False)
    else:
        head = "no rank is waiting for a pipeline message"
    return "pipeline progress: " + head + "\n" + "\n".join("  " + l for l in P.group_summary(second))


def _wait(procs, workdir, world_size, timeout, grace, store=None) -> List[List[Any]]:
    deadline = time.monotonic() + timeout
    first_fail = None  # (rank, time)
    pause = 0.02  # between looks at the ranks: 20 ms at first, growing to 100 ms (a long launch's
    # looks cost about 1% of a core at 20 ms; what they wait for takes seconds)
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) and first_fail is None:
            failed = [r for r, c in enumerate(codes) if c != 0]
            if not failed:
                break
            first_fail = (failed[0], time.monotonic())
        if first_fail is None:
            for r, c in enumerate(codes):
                if c is not None and c != 0:
                    first_fail = (r, time.monotonic())
                    break
        if first_fail is not None:
            # give the others a moment to report their own errors, then stop them
            if all(c is not None for c in codes) or time.monotonic() - first_fail[1] > grace:
                for p in procs:
                    if p.poll() is None:
                        _kill(p)
                _raise_rank_error(procs, workdir, world_size, first_fail[0])
        if time.monotonic() > deadline:
            unfinished = [r for r, p in enumerate(procs) if p.poll() is None]
            for r in unfinished:
                try:
                    if procs[r].pid is not None:
                        os.kill(procs[r].pid, signal.SIGUSR1)  # faulthandler: Python stacks into the log
                except ProcessLookupError:
                    pass
            progress = _progress_report(store, world_size) if store is not None else ""
            time.sleep(0.5)
            statuses = {r: read_status(workdir, r) for r in unfinished}
            logs = {r: log_tail(workdir, r, 40) for r in unfinished}
            for p in procs:
                if p.poll() is None:
                    _kill(p)
            raise LaunchTimeout(timeout, unfinished, statuses, logs, progress)
        time.sleep(pause)
        pause = min(0.1, pause * 1.1)
    per_rank = []
    for r in range(world_size):
        res = load_result(workdir, r)
        if res is None or not res.get("ok"):
            _raise_rank_error(procs, workdir, world_size, r)
        per_rank.append(res["results"])
    ncases = len(per_rank[0])
    return [[per_rank[r][i] for r in range(world_size)] for i in range(ncases)]


def _raise_rank_error(procs, workdir, world_size, hint_rank):
    # Prefer a rank that reported a Python exception (the root cause) over one that merely died.
    reports = {r: load_result(workdir, r) for r in range(world_size)}
    errs = {r: rep for r, rep in reports.items() if rep is not None and not rep.get("ok")}
    if errs:
        # the earliest failure in wall time is most likely the cause
        r = min(errs, key=lambda k: errs[k].get("time", 0.0))
        e = errs[r]
        others = [f"rank {k} also failed: {v['exc_type']}: {v['message'].splitlines()[0] if v['message'] else ''}"
                  for k, v in sorted(errs.items()) if k != r]
        raise RankError(r, e.get("case"), e["exc_type"], e["message"], e["traceback"],
                        log_tail="", others="\n".join(others))
    code = procs[hint_rank].poll()
    raise RankError(hint_rank, None, "ProcessDied", f"rank {hint_rank} exited with code {code} without a report",
                    "(no Python traceback: the process died)", log_tail=log_tail(workdir, hint_rank))
