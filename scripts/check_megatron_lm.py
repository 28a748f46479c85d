"""Run a Megatron-LM checkout's own ``pretrain_gpt.py`` through ``python -m megatron_zb.run`` and check
that megatron-zb's schedules train it exactly like Megatron's own 1F1B.

    python scripts/check_megatron_lm.py ~/Megatron-LM [--pp 2 4] [--schedules zb-v v-half bitpipe zb-h1]
                                        [--iters 4] [--json out.json]

For every pipeline size: Megatron's own schedule (no megatron-zb flag), then each schedule, all with
``--zero-bubble-deterministic-init`` (every weight drawn from its global name, so a V placement starts
from the same weights as Megatron's layout) and no dropout, on CPU processes (gloo) through
``scripts/pretrain_gpt_zb.sh`` with ``SCRIPT=<checkout>/pretrain_gpt.py``. Prints one line per run
(losses, identical or not) and exits 1 if any run fails or differs. Runs on this machine's CPU: a
trial of the route, not a speed measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(checkout: str, schedule: str, pp: int, iters: int, timeout: float) -> dict:
    port = free_port()
    env = dict(os.environ, FORCE_CPU="1", SCRIPT=os.path.join(checkout, "pretrain_gpt.py"), SCHEDULE=schedule,
               PP=str(pp), ITERS=str(iters), MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               EXTRA_ARGS="--zero-bubble-deterministic-init " + os.environ.get("EXTRA_ARGS", ""))
    env.pop("MZB_MCORE", None)  # the checkout's own megatron package
    t0 = time.time()
    p = subprocess.run(["bash", os.path.join(REPO, "scripts", "pretrain_gpt_zb.sh")], env=env, cwd=REPO,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    losses = [float(m.group(2)) for m in LOSS.finditer(p.stdout)]
    banner = next((l for l in p.stdout.splitlines() if l.startswith("megatron-zb: schedule ")
                   or l.startswith("megatron-zb: no zero-bubble flag")), "")
    err = "" if p.returncode == 0 else next((l for l in reversed(p.stdout.splitlines()) if "rror" in l), "")[:300]
    return {"schedule": schedule, "pp": pp, "rc": p.returncode, "losses": losses, "banner": banner, "error": err,
            "wall_s": round(time.time() - t0, 1), "log_tail": p.stdout[-3000:] if p.returncode else ""}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", help="a Megatron-LM checkout (the folder holding pretrain_gpt.py)")
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--schedules", nargs="+", default=["zb-v", "v-half", "bitpipe", "zb-h1"])
    ap.add_argument("--iters", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(a.checkout, "pretrain_gpt.py")):
        print(f"check_megatron_lm: error: no pretrain_gpt.py in {a.checkout!r}", file=sys.stderr)
        return 2
    rows, bad = [], 0
    for pp in a.pp:
        ref = run(a.checkout, "megatron", pp, a.iters, a.timeout)
        rows.append(ref)
        print(f"PP={pp} megatron (own 1F1B): rc {ref['rc']} losses {ref['losses']} {ref['error']}", flush=True)
        bad += ref["rc"] != 0 or len(ref["losses"]) != a.iters
        for s in a.schedules:
            r = run(a.checkout, s, pp, a.iters, a.timeout)
            r["identical"] = r["rc"] == 0 and r["losses"] == ref["losses"] and len(r["losses"]) == a.iters
            rows.append(r)
            bad += not r["identical"]
            print(f"PP={pp} {s}: rc {r['rc']} losses {r['losses']} -> "
                  f"{'identical to Megatron 1F1B' if r['identical'] else 'DIFFERENT'} {r['error']}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"checkout": os.path.abspath(a.checkout), "rows": rows}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
