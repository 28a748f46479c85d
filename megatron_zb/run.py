"""Run a Megatron-LM user's own, unmodified training script with megatron-zb.

    torchrun --nproc-per-node 4 -m megatron_zb.run path/to/pretrain_gpt.py \\
        <Megatron's flags> --zero-bubble-schedule zb-v [<megatron-zb's flags>]

The script runs as ``python path/to/pretrain_gpt.py`` would (its folder first on ``sys.path``, so a
Megatron-LM checkout's own ``megatron`` package and its helper modules are the ones imported),
with megatron-zb's flags in Megatron's parser and its schedules in Megatron's training loop
(``megatron_zb.megatron.dropin``). Errors are one line for the whole job and exit code 2.
"""
from __future__ import annotations

import gc
import os
import runpy
import sys
from typing import List, Optional

if __name__ == "__main__":
    gc.disable()  # the start-up without the cyclic collector (megatron.launch.session.start_up_done)

USAGE = ("usage: torchrun ... -m megatron_zb.run path/to/pretrain_gpt.py <Megatron flags> <megatron-zb flags> "
         "(e.g. --zero-bubble-schedule zb-v)")


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        return 0 if argv else 2
    script = argv[0]
    if not os.path.isfile(script):
        print(f"megatron-zb: error: no such training script {script!r} ({USAGE})", file=sys.stderr)
        return 2
    sys.argv = [script] + argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    from .megatron import dropin
    from .megatron.launch.session import run_reporting, supervise
    supervise()

    def run():
        d = dropin.enable(route=f"{os.path.basename(script)} through megatron_zb.run")
        try:
            runpy.run_path(script, run_name="__main__")
        finally:
            d.finish()
    return run_reporting(run)


if __name__ == "__main__":
    code = main()
    if code:  # after a failure, no orderly teardown: collectives with a stuck peer could hang it
        from .runtime.supervise import exit_now
        exit_now(code)
    sys.exit(0)
