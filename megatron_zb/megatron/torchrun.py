"""torchrun, ending with one line instead of its failure report when ranks fail.

    python -m megatron_zb.megatron.torchrun <torchrun's flags> -m megatron_zb.megatron.pretrain_gpt ...

Exactly ``python -m torch.distributed.run`` (same flags, same agent, same rendezvous), except when
the ranks fail: torchrun then raises ``ChildFailedError`` and prints its own traceback and a table
per rank; the ranks have already printed the error once (``rank_errors``), so this prints one
line naming the rank that failed first and exits with its code when that is 2 (bad input), else 1.
``scripts/pretrain_gpt_zb.sh`` launches through it.
"""
from __future__ import annotations

import sys
from typing import Optional, Sequence

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        run(args)
    except ChildFailedError as e:
        # ranks that reported through rank_errors left their exit code in torchrun's error file;
        # the rank that failed first may be one megatron-zb ended itself (a stopped rank it killed)
        reported = sorted((f.timestamp, r, f.error_file_data["mzb_exit_code"]) for r, f in e.failures.items()
                          if isinstance(f.error_file_data, dict) and "mzb_exit_code" in f.error_file_data)
        if reported:
            print("megatron-zb: training failed; the error is printed above", file=sys.stderr, flush=True)
            return 2 if reported[0][2] == 2 else 1
        rank, first = e.get_first_failure()
        how = f"exit code {first.exitcode}" if first.exitcode >= 0 else f"signal {first.signal_name()}"
        print(f"megatron-zb: training failed: global rank {rank} (pid {first.pid}) ended first with {how}; read its "
              "output above", file=sys.stderr, flush=True)
        return 2 if first.exitcode == 2 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
