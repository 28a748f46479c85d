"""torchrun, ending with one line instead of its failure report when ranks fail.

    python -m megatron_zb.megatron.torchrun <torchrun's flags> -m megatron_zb.megatron.pretrain_gpt ...

Exactly ``python -m torch.distributed.run`` (same flags, same agent, same rendezvous), except that
nothing outlives the job: the wrapper is a child subreaper, so what a killed rank left running
(Megatron's checkpoint-writer Manager, multiprocessing's resource tracker: a SIGKILL, e.g. the OOM
killer's, gives the rank no chance to stop them) comes back to it and is ended when the ranks are
gone; and except when
the ranks fail: torchrun then raises ``ChildFailedError`` and prints its own traceback and a table
per rank. Instead this prints what the ranks recorded in torchrun's error files (``rank_errors``):
the one-line message of a known error (bad flags, ...), whichever rank failed first, or the
failing rank's one-line summary (its traceback is in its output above), and exits with 2 for bad
input, else 1. ``scripts/pretrain_gpt_zb.sh`` launches through it.
"""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from ..runtime.supervise import become_subreaper, reap_orphans
    from .launch.session import start_up_done

    start_up_done()  # torch's import made without the collector's passes (below): frozen, collector on
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    os.environ["MZB_REPORT_TO_LAUNCHER"] = "1"  # the ranks record their errors; this prints them once
    become_subreaper()  # what a killed rank leaves running comes back here (Megatron's writer Manager)
    try:
        return _run(run, args, ChildFailedError)
    finally:
        reap_orphans()


def _run(run, args, ChildFailedError) -> int:
    try:
        run(args)
    except ChildFailedError as e:
        # ranks that reported through rank_errors left their message and exit code in torchrun's
        # error file; the rank that failed first may be one megatron-zb ended itself (a stopped rank
        # it killed)
        reported = sorted((f.timestamp, r, f.error_file_data["mzb_exit_code"], _message(f.error_file_data))
                          for r, f in e.failures.items()
                          if isinstance(f.error_file_data, dict) and "mzb_exit_code" in f.error_file_data)
        if reported:
            code = reported[0][2]
            lines = []
            for _, _, c, msg in reported:
                if msg and msg not in lines and (c == code or not lines):
                    lines.append(msg)
            for msg in lines[:3] or ["megatron-zb: training failed; see the ranks' output above"]:
                print(msg if msg.startswith("megatron-zb:") else f"megatron-zb: training failed: {msg}",
                      file=sys.stderr, flush=True)
            return 2 if code == 2 else 1
        rank, first = e.get_first_failure()
        how = f"exit code {first.exitcode}" if first.exitcode >= 0 else f"signal {first.signal_name()}"
        print(f"megatron-zb: training failed: global rank {rank} (pid {first.pid}) ended first with {how}; read its "
              "output above", file=sys.stderr, flush=True)
        return 2 if first.exitcode == 2 else 1
    return 0


def _message(data: dict) -> str:
    """The one-line message a rank recorded (``rank_errors.record_for_torchrun``)."""
    msg = data.get("message")
    msg = msg.get("message") if isinstance(msg, dict) else msg
    return (str(msg).strip().splitlines() or [""])[0] if msg else ""


if __name__ == "__main__":
    import gc
    gc.disable()  # the start-up without the cyclic collector (launch.session.start_up_done)
    sys.exit(main())
