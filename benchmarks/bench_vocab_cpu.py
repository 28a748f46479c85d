"""Vocabulary parallelism with real compute on this machine's CPU (issue 33): a small GPT whose
output layer weighs more than its transformer layers (hidden 256, 4 layers, sequence 256,
vocabulary 12288: the output layer + loss is 3.4 layers of FLOPs) trained on 2 pipeline ranks (gloo,
one process per core): Megatron's own 1F1B (no megatron-zb flag) with the layout ``megatron-zb
plan`` picks for 1f1b, against plan's best schedule with ``--enable-vocab-parallel``.

    OMP_NUM_THREADS=1 python benchmarks/bench_vocab_cpu.py [--rounds 3] [--iters 8]
        [--out benchmarks/results/vocab_cpu.json]

Per round the runs are interleaved: Megatron's 1F1B, megatron-zb's 1f1b with the same layout
(profiled: its chunks' F/B/W give the prediction for Megatron's 1F1B, which runs the same order),
and the schedule with vocabulary parallelism (profiled: its chunks' F/B/W and every rank's VS, VT,
VW). Per run the median elapsed time per iteration from iteration 5 on (after the profiling window
2-4); per schedule the median over the rounds and their spread; the speed-up over Megatron's 1F1B
per round (paired), its median and spread. Simulated: the schedule that ran (the profile's), timed
with that run's profiled costs, message time, and the measured time between two forward-backward
calls (Megatron's optimizer step and the rest of its loop); a barrier costs one message time.
On a shared (busy) host the rounds spread: the spread is printed beside every median.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from megatron_zb.core.ir import io as sched_io  # noqa: E402
from megatron_zb.core.ir import Setting  # noqa: E402
from megatron_zb.core.sim.iteration import iteration_times  # noqa: E402
from megatron_zb.core.plan import ModelSpec, PlanRequest, VocabLever, plan  # noqa: E402
from megatron_zb.core.ir.vocab import VocabSetting  # noqa: E402

MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=4, seq_length=256, ffn_hidden_size=1024,
             vocab_size=12288, micro_batch_size=1, activation_bytes=4, dropout=False)
ENV = dict(PP="2", NUM_LAYERS="4", HIDDEN="256", HEADS="4", SEQ_LEN="256", MBS="1", GBS="8", VOCAB="12288",
           LOG_INTERVAL="1", PREFLIGHT="0")
TIMED_FROM = 5
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*elapsed time per iteration \(ms\): ([\d.]+)")
SCHEDULES = ["1f1b", "zb-h1", "zb-v", "v-half"]


def pick(spec):
    """(Megatron 1F1B's layout, the best +vocab row) from plan."""
    rows = plan(PlanRequest(spec, 2, 8, 80.0, schedules=SCHEDULES, vocab=VocabLever("both")))
    ok = [r for r in rows if "error" not in r and r["fits"]]
    base = next(r for r in ok if r["schedule"] == "1f1b" and not r.get("vocab_parallel"))
    best = next(r for r in ok if r.get("vocab_parallel"))
    return base, best


def run(name, schedule, flags, iters, log, profile):
    env = dict(os.environ, SCHEDULE=schedule, ITERS=str(iters), LOG_FILE=log, OMP_NUM_THREADS="1", **ENV)
    extra = "--zero-bubble-deterministic-init " + flags
    if profile:
        extra += f" --zero-bubble-profile-window 2 4 --zero-bubble-profile-path {profile}"
    env["EXTRA_ARGS"] = extra
    t0 = time.time()
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "pretrain_gpt_zb.sh")], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"bench_vocab_cpu: run {name} failed (exit {p.returncode}); see {log}")
    its = {}
    for line in open(log, errors="replace"):
        m = LINE.search(line)
        if m:
            its[int(m.group(1))] = float(m.group(2))
    after = [ms for i, ms in its.items() if i >= TIMED_FROM]
    return statistics.median(after), time.time() - t0


def predicted_ms(prof, barriers):
    """The simulator's iteration (ms) for the profiled run: its schedule, chunk costs, vocabulary
    passes (per rank), message time and optimizer step."""
    sched = sched_io.from_json(json.dumps(prof["built_schedule"]))
    p, m = prof["pipeline_size"], prof["microbatches"]
    comm = prof.get("cost_comm") or 0.0
    vocab = None
    if prof.get("vocab_cost_s"):
        vocab = VocabSetting(barriers=barriers, cost_s=prof["vocab_cost_s"], cost_t=prof["vocab_cost_t"],
                             cost_w=prof["vocab_cost_w"], cost_comm=comm)
    st = Setting(p, m, chunks=sched.placement.chunks, cost_f=prof["chunk_cost_f"], cost_b=prof["chunk_cost_b"],
                 cost_w=prof["chunk_cost_w"], cost_comm=comm, vocab=vocab)
    return 1e3 * iteration_times(sched, st, prof.get("between_iterations_s") or 0.0).iteration_time


def _spread(xs):
    return f"{min(xs):.0f}-{max(xs):.0f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--work", default="/tmp/mzb_bench_vocab_cpu")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "vocab_cpu.json"))
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.iters <= TIMED_FROM:
        sys.exit(f"bench_vocab_cpu: need --rounds >= 1 and --iters > {TIMED_FROM}")
    os.makedirs(args.work, exist_ok=True)
    spec = ModelSpec(**MODEL)
    base, best = pick(spec)
    barriers = best["vocab_parallel"]
    lay = f"--pipeline-model-parallel-layout {base['layout']}"
    runs = [("Megatron 1F1B", "megatron", lay, False),
            ("megatron-zb 1f1b", "1f1b", lay, True),
            (f"{best['schedule']} + vocab-{barriers}", best["schedule"],
             best["flags"].split("--zero-bubble-schedule " + best["schedule"], 1)[1].strip(), True)]
    got = {name: {"rounds": [], "predicted": [], "seconds": []} for name, *_ in runs}
    t0 = time.time()
    for rnd in range(1, args.rounds + 1):
        for name, sched, flags, prof in runs:
            tag = sched.replace("-", "_")
            log = os.path.join(args.work, f"{tag}_r{rnd}.log")
            profile = os.path.join(args.work, f"profile_{tag}_r{rnd}.json") if prof else None
            ms, secs = run(name, sched, flags, args.iters, log, profile)
            got[name]["rounds"].append(ms)
            got[name]["seconds"].append(secs)
            if profile:
                got[name]["predicted"].append(predicted_ms(json.load(open(profile)), barriers))
            print(f"round {rnd}: {name:<22} {ms:8.1f} ms per iteration ({secs:.0f} s)", flush=True)
    # Megatron's own 1F1B runs 1f1b's order: predicted from megatron-zb's 1f1b profile (same layout)
    got["Megatron 1F1B"]["predicted"] = got["megatron-zb 1f1b"]["predicted"]
    rows, ref = [], got["Megatron 1F1B"]
    for name, sched, flags, _ in runs:
        g = got[name]
        ratios = [b / x for b, x in zip(ref["rounds"], g["rounds"])]
        pred = statistics.median(g["predicted"])
        rows.append({"label": name, "schedule": sched, "flags": flags, "rounds_ms": g["rounds"],
                     "measured_ms": statistics.median(g["rounds"]), "predicted_ms": pred,
                     "predicted_rounds_ms": g["predicted"],
                     "error_pct": 100.0 * (statistics.median(g["rounds"]) - pred) / pred,
                     "speedup_measured": statistics.median(ratios), "speedup_rounds": ratios,
                     "speedup_predicted": statistics.median(ref["predicted"]) / pred})
    print(f"\nVocabulary parallelism, REAL compute (CPU, {platform.node()}): GPT hidden 256, 4 layers, sequence 256, "
          f"vocabulary 12288\n(output layer + loss = {sum(spec.output_flops()) / sum(spec.layer_flops(0)):.2f} layers "
          f"of FLOPs), 2 pipeline ranks, 8 microbatches; {args.rounds} rounds, runs interleaved; Megatron's layout "
          f"{base['layout']}")
    print(f"{'schedule':<24}{'measured ms':>12}{'spread':>12}{'simulated':>11}{'diff':>8}{'x Megatron':>12}"
          f"{'spread':>14}{'simulated':>11}")
    for r in rows:
        sp = f"{min(r['speedup_rounds']):.3f}-{max(r['speedup_rounds']):.3f}"
        print(f"{r['label']:<24}{r['measured_ms']:>12.1f}{_spread(r['rounds_ms']):>12}{r['predicted_ms']:>11.1f}"
              f"{r['error_pct']:>+7.1f}%{r['speedup_measured']:>11.3f}x{sp:>14}{r['speedup_predicted']:>10.3f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"model": MODEL, "pp": 2, "microbatches": 8, "rounds": args.rounds, "iters": args.iters,
                   "timed_from": TIMED_FROM, "megatron_layout": base["layout"], "vocab_row": best["flags"],
                   "command": f"python benchmarks/bench_vocab_cpu.py --rounds {args.rounds} --iters {args.iters}",
                   "host": platform.node(), "cpus": os.cpu_count(),
                   "load_average_at_end": os.getloadavg(), "seconds": time.time() - t0, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
