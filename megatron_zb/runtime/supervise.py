"""No unsupervised ranks: a rank ends as soon as the process that launched it is gone.

If a launcher (torchrun's agent, megatron-zb's verify launcher) is killed with SIGKILL, its ranks
are re-parented and, left alone, keep training and writing checkpoints; a restarted job would
then write into the same directory at the same time. Two ways to tie a rank to its launcher:

* ``die_with_parent(parent_pid)``: Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG,
  SIGKILL)``): the kernel kills this process when the *thread* that forked it exits. Only safe
  where that thread lives as long as the launcher (our own launcher forks from its main thread).
* ``watch_parent()``: a daemon thread polling ``os.getppid()`` every ``poll_s`` seconds; when the
  parent changes (the launcher died, the process was re-parented), it prints one line and ends
  the process with ``os._exit`` at once (no cleanup, no checkpoint save, no ``atexit``). Safe
  under any launcher; used by the training entry point under torchrun.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import Optional

__all__ = ["die_with_parent", "watch_parent", "kill_children", "exit_now", "EXIT_CODE", "become_subreaper",
           "children_of", "reap_orphans"]

EXIT_CODE = 70  # os._exit status of a rank whose launcher died (EX_SOFTWARE)
_PR_SET_PDEATHSIG = 1
_watching = False


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux); if the parent
    ``parent_pid`` is already gone, exit now. Returns False where prctl is unavailable."""
    ok = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            ok = libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
        except (OSError, AttributeError):
            ok = False
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(EXIT_CODE)
    return ok


def children_of(pid: int) -> list:
    """Live child pids of ``pid`` (from /proc; empty where there is no /proc)."""
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:  # pragma: no cover
        return out
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(e))
    return out


def kill_children() -> None:
    """SIGKILL this process's child processes (Linux /proc; e.g. the multiprocessing manager and
    writer Megatron's checkpointing starts), which would outlive an ``os._exit`` of their parent."""
    for pid in children_of(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            continue


def become_subreaper() -> bool:
    """Linux: orphaned descendants (what a killed child left running: Megatron's checkpoint-writer
    Manager, multiprocessing's resource tracker) are re-parented to this process instead of init,
    so ``reap_orphans`` can end them."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return False


def reap_orphans(deadline_s: float = 10.0) -> None:
    """Kill every process still a child of this one and reap until none is left."""
    import time
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for pid in children_of(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.01)


def exit_now(code: int) -> None:
    """End this process at once (``os._exit``: no cleanup that could hang on a stuck peer), and
    its child processes with it."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass
    kill_children()
    os._exit(code)


def watch_parent(poll_s: float = 0.2, what: str = "the launcher", label: Optional[str] = None) -> bool:
    """Start (once per process) a daemon thread that ends this process when its parent dies.

    Returns False if already watching. ``label`` names this process in the one line printed
    before exiting (default: ``rank $RANK``).
    """
    global _watching
    if _watching:
        return False
    _watching = True
    parent = os.getppid()
    me = label or f"rank {os.environ.get('RANK', '?')}"

    def run():
        ev = threading.Event()
        while not ev.wait(poll_s):
            if os.getppid() != parent:
                try:
                    os.write(2, (f"megatron-zb: {me}: {what} (pid {parent}) is gone; exiting now so that no "
                                 "unsupervised rank keeps training or writing checkpoints\n").encode())
                except OSError:
                    pass
                exit_now(EXIT_CODE)

    threading.Thread(target=run, name="megatron-zb-parent-watch", daemon=True).start()
    return True
