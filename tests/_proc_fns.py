"""Rank code for tests/test_processes.py (module level, so launched ranks can import it)."""
from __future__ import annotations

import os



def descendants() -> list:
    import psutil
    return [c.pid for c in psutil.Process().children(recursive=True)]


def start_spawn_manager(_case=None) -> list:
    """What megatron-core's checkpoint writer does: a spawn-context Manager (a Python process plus a
    resource tracker), never shut down. Returns this rank's descendants."""
    import multiprocessing as mp
    manager = mp.get_context("spawn").Manager()
    start_spawn_manager.keep = (manager, manager.Queue())
    return descendants()


def start_detached_sleeper(_case=None) -> list:
    """A grandchild that leaves the rank's process group (its own session) and outlives its parent:
    only the zygote's reaping finds it."""
    import subprocess
    import sys
    code = ("import os, subprocess, sys, time; os.setsid(); "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True); "
            "time.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", code])
    import time

    import psutil
    for _ in range(400):
        if psutil.Process(proc.pid).children():
            break
        time.sleep(0.05)
    return descendants() + [proc.pid]


def leave_things_behind(_case=None) -> list:
    """Both of the above on one rank; returns every pid they started."""
    return start_spawn_manager() + start_detached_sleeper()


def zygote_parent(_case=None) -> tuple:
    """The pid and command line of this rank's zygote's parent: the launcher, or the warm server."""
    with open(f"/proc/{os.getppid()}/stat") as f:
        parent = int(f.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{parent}/cmdline", "rb") as f:
        return parent, f.read().replace(b"\0", b" ").decode()
