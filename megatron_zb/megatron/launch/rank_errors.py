"""Errors inside training ranks, reported once, as one line where the cause is known.

Under torchrun every rank runs the same code, so a configuration error is hit by every rank and
would be printed N times (with N tracebacks). ``report`` prints an error once: the first rank to
report it (an atomic counter in the job's store, the one torch.distributed rendezvoused through),
or global rank 0 before the process group exists. It also writes torchrun's error file
(``TORCHELASTIC_ERROR_FILE``) on the reporting rank, so torchrun's "Root Cause" shows the message
instead of "To enable traceback see ...".

Under megatron-zb's torchrun wrapper (``megatron.torchrun``, which sets ``MZB_REPORT_TO_LAUNCHER``)
a known error is only written to the error file and the wrapper prints it once when the ranks have
ended: whichever rank failed first and however quickly torchrun stopped the others, the line
reaches the user.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Optional

__all__ = ["first_to_report", "report", "record_for_torchrun"]

_KEY = "mzb/errors/{restart}/{what}"


def _store():
    try:
        import torch.distributed as dist
        if dist.is_initialized():
            return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001
        pass
    return None


def _key(what: str) -> str:
    return _KEY.format(restart=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), what=what)


def first_to_report(summary: str) -> Optional[str]:
    """'first' on the first rank that reports an error (global rank 0 before the process group
    exists); for a later rank None if its ``summary`` equals the first one's (the same error),
    'other' if it differs (a different failure is worth its own line)."""
    store = _store()
    if store is None:
        return "first" if os.environ.get("RANK", "0") == "0" else None
    try:
        if store.add(_key("count"), 1) == 1:
            store.set(_key("first"), summary)
            return "first"
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if store.check([_key("first")]):
                same = store.get(_key("first")).decode("utf-8", "replace") == summary
                return None if same else "other"
            time.sleep(0.05)
        return "other"
    except Exception:  # noqa: BLE001 - the store is gone: say it rather than nothing
        return "other"


def record_for_torchrun(message: str, callstack: Optional[str] = None, exit_code: int = 1) -> None:
    """Write torchrun's per-rank error file (what ``@record`` writes), if torchrun asked for one;
    ``exit_code`` is kept in it for ``megatron_zb.megatron.torchrun`` (the rank may be stopped by
    torchrun before it exits with that code)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": message, "extraInfo": {"py_callstack": callstack or message,
                                                                     "timestamp": str(int(time.time()))}},
                       "mzb_exit_code": int(exit_code)}, f)
    except OSError:
        pass


def _launcher_prints() -> bool:
    """Whether megatron-zb's torchrun wrapper prints what this rank records in its error file."""
    return os.environ.get("MZB_REPORT_TO_LAUNCHER") == "1" and bool(os.environ.get("TORCHELASTIC_ERROR_FILE"))


def report(exc: BaseException, known: bool) -> None:
    """Print ``exc`` once for the whole job.

    ``known``: an error whose message says everything (bad flags, a checkpoint that does not fit):
    one line ``megatron-zb: error: ...``, no traceback. Otherwise the first reporting rank prints
    the traceback and ranks with a different error one line each.
    """
    rank = os.environ.get("RANK", "?")
    first_line = (str(exc).splitlines() or [""])[0]
    summary = f"{type(exc).__name__}: {first_line}"
    who = first_to_report(summary)
    if known:
        line = f"megatron-zb: error: {exc}"
        record_for_torchrun(line, exit_code=2)
        if who is not None and not _launcher_prints():
            print(line, file=sys.stderr, flush=True)
        return
    if who is None:
        record_for_torchrun(f"rank {rank}: {summary}")
        return
    if who == "other":
        print(f"megatron-zb: rank {rank} failed too: {summary}", file=sys.stderr, flush=True)
        return
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    record_for_torchrun(f"rank {rank}: {summary}", tb)
    sys.stderr.write(f"megatron-zb: rank {rank} failed:\n{tb}")
    sys.stderr.flush()
