"""Fault figures of the training entry point: how fast a stopped or killed rank ends the job, and
how fast the ranks go when their launcher is killed.

    OMP_NUM_THREADS=1 MZB_MCORE=0.19.2 python benchmarks/bench_faults.py [--pp 4] [--timeout 5]
        [--trials 2] [--scenarios stop kill launcher] [--out benchmarks/results/faults.json]

Each trial starts ``scripts/pretrain_gpt_zb.sh`` (zb-v, the tiny CPU GPT, ``--zero-bubble-timeout``),
waits for iteration 3 in its log, then:

* ``stop``: SIGSTOP pipeline rank 2 (it stays alive, silent). Measured: seconds from the stop to
  the first ``megatron-zb: error:`` line (the detection: the timeout plus the diagnosis), and to
  the end of the job; whether every error line names rank 2.
* ``kill``: SIGKILL pipeline rank 2. Measured: seconds to the end of the job.
* ``launcher``: SIGKILL the torchrun agent. Measured: seconds until every rank is gone.
* ``save``: a checkpoint every 3 iterations; SIGSTOP pipeline rank 2 as soon as the log says the
  save of iteration 6 began (the ranks are in Megatron's save: its collectives). Measured as for
  ``stop``, plus whether the error lines say the ranks were saving.

Prints a table and writes the JSON (with the host's load average: these are wall-clock times).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPT = os.path.join(ROOT, "scripts", "pretrain_gpt_zb.sh")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(pid):
    out = {}
    for child in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split():
        try:
            env = dict(kv.split(b"=", 1) for kv in open(f"/proc/{child}/environ", "rb").read().split(b"\0")
                       if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env:
            out[int(env[b"RANK"])] = int(child)
    return out


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _descendants(pid):
    kids = [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]
    return kids + [d for k in kids for d in _descendants(k)]


def trial(scenario, pp, timeout, victim=2):
    with tempfile.TemporaryDirectory(prefix="mzb-faults-") as tmp:
        log_path = os.path.join(tmp, "job.log")
        env = dict(os.environ, SCHEDULE="zb-v", PP=str(pp), ITERS="100000", PREFLIGHT="0", PYTHONUNBUFFERED="1",
                   MASTER_PORT=str(_free_port()), EXTRA_ARGS=f"--zero-bubble-timeout {timeout}",
                   OMP_NUM_THREADS="1", PYTHON=os.environ.get("PYTHON", sys.executable))
        if scenario == "save":
            env.update(SAVE=os.path.join(tmp, "ckpt"), SAVE_INTERVAL="3")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(["bash", SCRIPT], env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        ranks, left = {}, []
        try:
            ready = r"saving checkpoint at iteration\s+6 " if scenario == "save" else r"iteration\s+3/"
            while not re.search(ready, open(log_path).read()):
                if proc.poll() is not None:
                    raise RuntimeError(f"the job ended early:\n{open(log_path).read()[-2000:]}")
                time.sleep(0.1)
            ranks = _ranks(proc.pid)
            left = [d for r in ranks.values() for d in [r] + _descendants(r)]
            t0 = time.monotonic()
            first_error = None
            if scenario == "launcher":
                os.kill(proc.pid, signal.SIGKILL)
                while any(_alive(r) for r in ranks.values()) and time.monotonic() - t0 < 60:
                    time.sleep(0.01)
                return {"ranks_gone_s": round(time.monotonic() - t0, 2),
                        "all_gone": not any(_alive(r) for r in ranks.values())}
            if scenario == "save":
                ranks = ranks or _ranks(proc.pid)
            os.kill(ranks[victim], signal.SIGKILL if scenario == "kill" else signal.SIGSTOP)
            while proc.poll() is None and time.monotonic() - t0 < 600:
                if first_error is None and "megatron-zb: error:" in open(log_path).read():
                    first_error = time.monotonic() - t0
                time.sleep(0.02)
            end = time.monotonic() - t0
            text = open(log_path).read()
            errors = [line for line in text.splitlines() if line.startswith("megatron-zb: error:")]
            named = [bool(re.search(rf"first is pipeline rank {victim} \(global rank {victim},", e)) for e in errors]
            out = {"job_end_s": round(end, 2), "exit_code": proc.returncode, "error_lines": len(errors)}
            if scenario in ("stop", "save"):
                out.update(first_error_s=None if first_error is None else round(first_error, 2),
                           all_name_the_stopped_rank=bool(errors) and all(named))
            if scenario == "save":
                out["errors_say_saving"] = sum("saving checkpoint iter" in e for e in errors)
            return out
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            for pid in left:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=5.0, help="--zero-bubble-timeout (seconds)")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--scenarios", nargs="+", default=["stop", "kill", "launcher", "save"],
                    choices=["stop", "kill", "launcher", "save"])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "faults.json"))
    a = ap.parse_args()
    results = {}
    for sc in a.scenarios:
        results[sc] = []
        for i in range(a.trials):
            r = trial(sc, a.pp, a.timeout)
            results[sc].append(r)
            print(f"{sc} trial {i + 1}: {r}", flush=True)
    print(f"\nPP={a.pp}, --zero-bubble-timeout {a.timeout:g}s, {a.trials} trial(s), load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'scenario':<10} {'figure':<28} {'median':>8} {'max':>8}")
    summary = {}
    for sc, rows in results.items():
        for key in ("first_error_s", "job_end_s", "ranks_gone_s"):
            vals = [r[key] for r in rows if r.get(key) is not None]
            if vals:
                summary[f"{sc}.{key}"] = {"median": statistics.median(vals), "max": max(vals)}
                print(f"{sc:<10} {key:<28} {statistics.median(vals):>8.2f} {max(vals):>8.2f}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"pp": a.pp, "timeout_s": a.timeout, "trials": a.trials, "results": results, "summary": summary,
                   "host": platform.node(), "cores": os.cpu_count(), "loadavg": os.getloadavg()}, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
