"""A rank's Python stacks in its own log when one pass runs far longer than any pass should.

The peer that waits for this rank names it after its timeout ("running F0.0 for 301s; read its log
first"); what the log then shows is where the pass stood: every thread's Python stack
(``faulthandler``) and the rank's child processes with their state (e.g. data-loader workers),
written once per pass, ``DUMP_AFTER_S`` into it (environment ``MZB_STACK_DUMP_S``), by the progress
thread (``runtime.observe.progress``).
"""
from __future__ import annotations

import faulthandler
import os
import sys

__all__ = ["DUMP_AFTER_S", "dump_stuck_pass"]

DUMP_AFTER_S = float(os.environ.get("MZB_STACK_DUMP_S", "120"))  # well before a waiting peer's timeout (300 s)


def _children() -> str:
    pid = os.getpid()
    kids = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += f.read().split()
    except OSError:  # not Linux
        return "unknown"
    out = []
    for k in kids:
        try:
            with open(f"/proc/{k}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{k}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:100]
        except OSError:
            continue
        out.append(f"pid {k} state {state} ({cmd})")
    return "; ".join(out) or "none"


def dump_stuck_pass(who: str, what: str, seconds: float) -> None:
    """Write the header line, the child processes and every thread's stack to stderr."""
    try:
        sys.stderr.flush()
        os.write(2, (f"megatron-zb: {who} has been running {what} for {seconds:.0f}s; its child processes: "
                     f"{_children()}; its Python stacks follow\n").encode())
        faulthandler.dump_traceback(all_threads=True)
    except (OSError, ValueError):  # stderr closed
        pass
