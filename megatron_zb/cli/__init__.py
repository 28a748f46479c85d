"""`megatron-zb` command line: simulate, compare, plot, plan (the schedule core, no torch) and
verify (trains a tiny megatron GPT; torch and megatron-core, imported only for it).

``common`` holds the flags every schedule command shares and their one path into
``core.build``; ``schedule`` the simulate/compare/plot commands; ``plan`` the planner's. Bad input
gets one line on stderr and exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import List, Optional

from ..core.ir import ScheduleError
from . import plan, schedule
from .common import Parser, UsageError

__all__ = ["main", "build_parser", "UsageError"]


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="megatron-zb", description="Zero-bubble pipeline schedules for megatron-core")
    sub = ap.add_subparsers(dest="cmd", parser_class=Parser)
    schedule.add_parsers(sub)
    plan.add_parser(sub)
    sub.add_parser("verify", help="train a tiny megatron GPT with a schedule vs the reference "
                   "(see `megatron-zb verify --help`)", add_help=False)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "verify":
        from .. import verify
        return verify.main_verify(argv[1:])
    ap = build_parser()
    try:
        args = ap.parse_args(argv)
        if not getattr(args, "func", None):
            ap.print_help()
            return 2
        # the schedule searches make millions of small objects and keep few cycles: the modules
        # imported so far left out of every collection, and one collection per 100,000 allocations
        # instead of 700 (plan: 5% less CPU, the same peak memory)
        threshold = gc.get_threshold()
        gc.freeze()
        gc.set_threshold(100_000, 50, 100)
        try:
            return args.func(args)
        finally:  # (a caller's own process, e.g. a test's, as it was)
            gc.set_threshold(*threshold)
            gc.unfreeze()
    except (UsageError, ScheduleError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if not msg.startswith("megatron-zb"):
            msg = f"megatron-zb: error: {msg}"
        print(msg, file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (e.g. `| head`): nothing more to say
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
