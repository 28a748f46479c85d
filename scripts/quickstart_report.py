"""The quickstart's report: correctness from the training logs, then speed.

    python scripts/quickstart_report.py out/quickstart [--mode cpu|gpu] [--pp 4] [--schedules zb-v 1f1b]

cpu: the losses of the tiny GPT trained on CPU with each schedule (they must be identical), then
     the same pipeline with emulated compute (``megatron_zb.verify.timing.emulate``: real processes and
     real point-to-point messages, each pass a wait of the F/B/W time measured for a transformer
     layer on an H100) for the schedules in EMULATED, against the simulator's prediction, read from
     <out>/emulated.json, which ``--emulate`` writes (the quickstart runs it during the training);
     then vocabulary parallelism with emulated compute (``megatron_zb.verify.timing.emulate_vocab``) for a
     model whose output layer has Llama-3.2-1B's share of the FLOPs: Megatron's 1F1B with the best
     layout plan finds for it against plan's best schedule with vocabulary parallelism, measured
     and simulated (<out>/emulated_vocab.json, also written by ``--emulate``).
gpu: the training runs used real compute: their measured time per iteration against the
     simulator's prediction from each run's own profiled F/B/W times.
Also writes <out>/quickstart.json and the timeline pictures.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import signal
import statistics
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from megatron_zb import plot  # noqa: E402
from megatron_zb.core.ir import io as sched_io  # noqa: E402
from megatron_zb.core.ir import Setting  # noqa: E402
from megatron_zb.core.sim.iteration import iteration_times  # noqa: E402
from megatron_zb.core.schedules import generate  # noqa: E402
from megatron_zb.core.sim.simulate import simulate  # noqa: E402
from megatron_zb.verify.timing.emulate import Entry  # noqa: E402

# The schedules the emulated run compares; the first is the baseline. One line per schedule.
EMULATED = [
    Entry("1f1b"),
    Entry("zb-h1"),
    Entry("zb-v"),
    Entry("zb-h2", post_validation=True),  # iterations back to back, as optimizer post-validation runs them
]
# F/B/W of one transformer layer measured on an H100 (benchmarks/bench_split_overhead.py)
H100_LAYER = os.path.join(ROOT, "benchmarks", "results", "fbw_h100_h4096_s4096.json")
LAYERS_PER_RANK = 2  # the tiny GPT has 2 x PP layers (one per V chunk)

# Vocabulary parallelism, emulated: Llama-3.2-1B's shape (vocabulary 128256, hidden 2048, 16
# layers, tied embeddings) at sequence 4096, costs from FLOPs at an H100's peak x 0.5 (plan's), each
# pass sleeping VOCAB_SLOW_DOWN x its cost (the runtime's overheads then weigh an eighth as much)
VOCAB_MODEL = ("llama-3.2-1b", 4096)
VOCAB_SLOW_DOWN = 8.0
VOCAB_ITERATIONS = 8

LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*elapsed time per iteration \(ms\): ([\d.]+).*lm loss: ([\d.E+-]+)")


def read_log(path):
    """{iteration: (ms per iteration over the logging interval, lm loss)} from Megatron's lines."""
    it = {}
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.search(line)
            if m:
                it[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    return it


def correctness(out, schedules):
    """Print the loss table; return {schedule: log} and the largest difference to the first."""
    logs = {}
    for s in schedules:
        path = os.path.join(out, f"train_{s}.log")
        if not os.path.exists(path):
            sys.exit(f"quickstart_report: no training log {path}")
        logs[s] = read_log(path)
        if not logs[s]:
            sys.exit(f"quickstart_report: no iteration lines with an lm loss in {path}")
    its = sorted(set.intersection(*(set(v) for v in logs.values())))
    print("lm loss per logged iteration (Megatron's log lines):")
    print(f"{'iteration':>9} " + " ".join(f"{s:>12}" for s in schedules) + f" {'largest |diff|':>15}")
    worst = 0.0
    for i in its:
        vals = [logs[s][i][1] for s in schedules]
        d = max(abs(v - vals[0]) for v in vals)
        worst = max(worst, d)
        print(f"{i:>9} " + " ".join(f"{v:>12.6f}" for v in vals) + f" {d:>15.2e}")
    return logs, its, worst


def run_emulation(out, pp, microbatches):
    """Run the emulated-compute comparison; write <out>/emulated.json and the timeline pictures."""
    from megatron_zb.core.ir import Setting
    from megatron_zb.verify.timing.emulate import Timing, emulate

    layer = json.load(open(H100_LAYER))
    f, b, w = (layer["median_s"][k] * 1e3 for k in ("f", "b", "w"))
    k = LAYERS_PER_RANK
    rows = emulate(EMULATED, Setting(pp, microbatches, cost_f=k * f, cost_b=k * b, cost_w=k * w),
                   Timing(unit_s=1e-3, iterations=5, warmup=1))
    for r in rows:
        if r["schedule"] in ("zb-v", "1f1b") and not r["post_validation"]:
            base = os.path.join(out, f"timeline_{r['schedule']}")
            title = (f"{r['label']} as it ran, emulated H100 compute (P={pp}, M={microbatches}): "
                     f"iteration {r['per_iteration'][-1]:.0f} ms")
            for ext in ((".png", ".svg", ".trace.json") if r["schedule"] == "zb-v" else (".png",)):
                plot.save(r["timeline"], base + ext, title=title, time_unit="ms")
            r["picture"] = base
        r.pop("timeline")
    with open(os.path.join(out, "emulated.json"), "w") as fh:
        json.dump({"pp": pp, "microbatches": microbatches, "layers_per_rank": k, "layer": layer["config"],
                   "layer_ms": {"f": f, "b": b, "w": w}, "source": os.path.relpath(H100_LAYER, ROOT),
                   "rows": rows}, fh, indent=1)


def vocab_spec():
    from megatron_zb.core.costs.model import ModelSpec
    from megatron_zb.core.costs.models import spec_kwargs
    return ModelSpec(**spec_kwargs(VOCAB_MODEL[0], seq_length=VOCAB_MODEL[1]))


def output_share(spec, layout):
    """The output layer + loss's share of one microbatch's FLOPs (``core.costs.chunk_costs``), and its
    weight in transformer layers."""
    from megatron_zb.core.costs.chunk_costs import stage_work
    from megatron_zb.core.costs.layout import parse
    total = sum(stage_work(spec, parse(layout)))
    out = sum(spec.output_flops())
    return out / total, out / sum(spec.layer_flops(0))


def run_vocab_emulation(out, pp, microbatches):
    """Vocabulary parallelism with emulated compute (``verify.timing.emulate_vocab.compare``); writes
    <out>/emulated_vocab.json and the timeline picture of the schedule with vocabulary parallelism."""
    from megatron_zb.verify.timing.emulate_vocab import compare

    spec = vocab_spec()
    rows = compare(spec, pp, microbatches, slow_down=VOCAB_SLOW_DOWN, iterations=VOCAB_ITERATIONS)
    for r in rows:
        tl = r.pop("timeline")
        if r["vocab_parallel"]:
            base = os.path.join(out, "timeline_vocab")
            plot.save(tl, base + ".png", time_unit="ms",
                      title=f"{r['label']} as it ran, emulated compute (P={pp}, M={microbatches}): iteration "
                            f"{r['per_iteration'][-1]:.0f} ms")
            r["picture"] = base
    share, layers = output_share(spec, rows[0]["layout"])
    with open(os.path.join(out, "emulated_vocab.json"), "w") as fh:
        json.dump({"pp": pp, "microbatches": microbatches, "model": VOCAB_MODEL[0], "seq_length": VOCAB_MODEL[1],
                   "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size, "num_layers": spec.num_layers,
                   "output_share": share, "output_layers": layers, "slow_down": VOCAB_SLOW_DOWN,
                   "rows": rows}, fh, indent=1)


def _handling(rows):
    return ", ".join(f"{r['label']} {r['handling_ms']:.3f} ms" for r in rows if r.get("handling_ms") is not None) \
        or "none measured"


def _nominal(rows):
    return ", ".join(f"{r['label']} {r['predicted_nominal']:.1f} ms" for r in rows
                     if r.get("predicted_nominal") is not None) or "-"


def vocab_speed(out):
    """Print the vocabulary-parallelism comparison (emulated); its rows, or None without the file."""
    path = os.path.join(out, "emulated_vocab.json")
    if not os.path.exists(path):
        return None
    d = json.load(open(path))
    rows = d["rows"]
    print(f"Vocabulary parallelism with EMULATED compute: a GPT of {VOCAB_MODEL[0]}'s shape (vocabulary "
          f"{d['vocab_size']}, hidden {d['hidden_size']},\n{d['num_layers']} layers, sequence {d['seq_length']}: "
          f"its output layer + loss {100 * d['output_share']:.1f}% of the FLOPs, "
          f"{d['output_layers']:.2f} layers' worth) "
          f"on {d['pp']} real\nprocesses, {d['microbatches']} microbatches: Megatron's 1F1B with the best layout "
          "`megatron-zb plan` finds for it\nagainst plan's best schedule with vocabulary parallelism (its VS/VT/VW "
          "passes on every rank, barriers real\ngloo all-reduces). F/B/W from FLOPs at an H100's peak x 0.5; each "
          f"pass waits {d['slow_down']:g}x its time, reported\nback in H100 ms; median of "
          f"{len(rows[0]['per_iteration'])} iterations, the schedules interleaved. simulated = the simulator,\n"
          f"same schedules and costs, this machine's message time ({rows[0]['hop_ms']:.3f} ms per hop) and each\n"
          f"pass's host costs as profiled in two iterations after them (posting its messages, the executor; median "
          f"{_handling(rows)}); without them: {_nominal(rows)}")
    print(f"{'schedule':<26}{'layout':<18}{'ms per iteration':^29}{'speed-up over Megatron 1F1B':^36}")
    print(f"{'':<26}{'':<18}{'measured':>10}{'simulated':>11}{'diff':>8}{'measured':>11}{'range':>14}{'simulated':>11}")
    for r in rows:
        lo, hi = r["speedup_measured_range"]
        rng = f"{lo:.3f}-{hi:.3f}" if r is not rows[0] else "-"
        print(f"{r['label']:<26}{r['layout']:<18}{r['measured']:>10.1f}{r['predicted']:>11.1f}{r['error_pct']:>+7.1f}%"
              f"{r['speedup_measured']:>10.3f}x{rng:>14}{r['speedup_predicted']:>10.3f}x")
    best = rows[-1]
    print(f"flags of the {best['label']} row: {best['flags'].strip()}")
    return rows


def emulated_speed(out):
    path = os.path.join(out, "emulated.json")
    if not os.path.exists(path):
        sys.exit(f"quickstart_report: no {path}: the emulated run did not finish (see {out}/emulate.log)")
    d = json.load(open(path))
    rows, cfg, ms = d["rows"], d["layer"], d["layer_ms"]
    print(f"Speed with EMULATED compute (no GPU here): {d['pp']} real processes (gloo) run each schedule through\n"
          "megatron-zb's runtime and exchange real point-to-point messages; each pass waits the time one\n"
          f"megatron-core transformer layer (hidden {cfg['hidden']}, sequence {cfg['seq']}, batch {cfg['batch']}, "
          f"fp32) took on an H100:\nF {ms['f']:.1f}, B {ms['b']:.1f}, W {ms['w']:.1f} ms ({d['source']});\n"
          f"{d['layers_per_rank']} layers per rank, {d['microbatches']} microbatches; median of "
          f"{len(rows[0]['per_iteration'])} iterations. It ran alongside the CPU training above (its\n"
          "waits need almost no CPU; the training ran at a lower priority).")
    print(f"simulated = the simulator with the same F/B/W times and this machine's measured message time "
          f"({rows[0]['hop']:.2f} ms per hop)")
    print(f"{'schedule':<26}{'ms per iteration':^30}{'speed-up over ' + rows[0]['label']:^24}")
    print(f"{'':<26}{'measured':>10}{'simulated':>11}{'diff':>9}{'measured':>12}{'simulated':>12}")
    for r in rows:
        pred = f"{r['predicted']:>11.1f}{r['error_pct']:>+8.1f}%" if r["predicted"] else f"{'-':>11}{'-':>9}"
        sp = f"{r['speedup_predicted']:>11.3f}x" if r["speedup_predicted"] else f"{'-':>12}"
        print(f"{r['label']:<26}{r['measured']:>10.1f}{pred}{r['speedup_measured']:>11.3f}x{sp}")
    return rows, [r["picture"] for r in rows if r.get("picture")]


def simulated_ms(prof, schedule, with_step=False):
    """The simulator's time (ms) for the schedule that ran (the one the profile recorded; else the
    schedule generated with unit costs), timed with the costs profiled in that run
    (``runtime.profile_data.profile_to_setting_kwargs``: each model chunk's F/B/W where the profile has
    them, the fused backward as measured, each pass's handling on a CPU: its messages' posting and the
    executor's bookkeeping) and the message time; ``with_step``: a whole training iteration with
    Megatron's synchronous optimizer step, its time the measured gap between two forward-backward
    calls (the step and the rest of Megatron's loop)."""
    from megatron_zb.runtime.observe.profile_data import profile_to_setting_kwargs
    p, m = prof["pipeline_size"], prof["microbatches"]
    if prof.get("built_schedule") and prof.get("schedule") == schedule:
        sched = sched_io.from_json(json.dumps(prof["built_schedule"]))
    else:
        sched = generate(schedule, Setting(p, m))
    kw = profile_to_setting_kwargs(prof, per_chunk=True)
    kw = {k: v for k, v in kw.items() if k in ("cost_f", "cost_b", "cost_w", "cost_bw", "cost_comm")}
    st = Setting(p, m, chunks=sched.placement.chunks, **kw)
    res = simulate(sched, st)
    if with_step:
        step = prof.get("between_iterations_s") or 0.0
        return 1e3 * iteration_times(sched, st, step).iteration_time, res
    return 1e3 * max(tl[-1].end for tl in res.timeline if tl), res


def gpu_speed(out, schedules, logs, window_end):
    """Real compute: Megatron's measured ms/iteration (logged after the profiling window) against
    the simulator's iteration time for the schedule that ran, with that run's profiled costs."""
    rows = []
    for s in schedules:
        prof = json.load(open(os.path.join(out, f"profile_{s}.json")))
        after = [ms for i, (ms, _) in logs[s].items() if i > window_end + 5]
        if not after:
            sys.exit(f"quickstart_report: no logged iteration after the profiling window for {s}")
        pred_ms, res = simulated_ms(prof, s)
        rows.append({"label": s, "schedule": s, "measured": statistics.median(after), "predicted": pred_ms,
                     "error_pct": 100.0 * (statistics.median(after) - pred_ms) / pred_ms, "result": res})
    for r in rows:
        r["speedup_measured"] = rows[0]["measured"] / r["measured"]
        r["speedup_predicted"] = rows[0]["predicted"] / r["predicted"]
    print("Speed with REAL compute on GPUs: Megatron's elapsed time per iteration (median of the logged\n"
          "intervals after the profiling window) and the simulator's pipeline time for the same schedule with\n"
          "the F/B/W and message times profiled in that run (it leaves out the optimizer step and data loading)")
    print(f"{'schedule':<10}{'measured ms':>12}{'simulated ms':>13}{'diff':>8}{'x' + rows[0]['label'] + ' meas.':>14}"
          f"{'simulated':>11}")
    for r in rows:
        print(f"{r['label']:<10}{r['measured']:>12.1f}{r['predicted']:>13.1f}{r['error_pct']:>+7.1f}%"
              f"{r['speedup_measured']:>13.3f}x{r['speedup_predicted']:>10.3f}x")
    pictures = []
    for r in rows:
        res = r.pop("result")
        if r["schedule"] == "zb-v":
            base = os.path.join(out, "timeline_zb-v")
            for ext in (".png", ".svg", ".trace.json"):
                plot.save(res, base + ext, time_unit="s",
                          title="zb-v simulated with the F/B/W times profiled on the GPUs")
            pictures.append(base)
    return rows, pictures


# The real-compute comparison on CPU (the quickstart's REAL_* settings): Megatron's own 1F1B (no
# megatron-zb flag) first, then megatron-zb's schedules, each with the balanced layout plan finds
# for it (``real_layouts``); profiled from iteration 3 to the last, timed from 3 to the one before the last
# (the last holds the profile window's end: its message probe and gather), so that the moments a busy host
# slows weigh on the measured iterations and on the costs the simulation takes alike. megatron-zb's 1f1b runs
# Megatron's 1F1B order through megatron-zb's runtime: its profile (fused backwards measured) times
# Megatron's own 1F1B in the simulator, and its row shows what the runtime costs beside Megatron's loop.
REAL = ["megatron", "1f1b", "zb-h1", "zb-v"]
REAL_TIMED_FROM = 3
REAL_WITHIN_PCT = 3.0  # the main job's claim: each row's measured median within this of its simulation
# the real-compute GPT: 8 layers, hidden 256, sequence 256, 2 pipeline ranks, 8 microbatches, fp32;
# its vocabulary makes the output layer weigh about two transformer layers, as in Llama-3-8B
REAL_MODEL = dict(num_layers=8, hidden_size=256, num_attention_heads=4, seq_length=256, ffn_hidden_size=1024,
                  vocab_size=7168, micro_batch_size=1, activation_bytes=4, dropout=False)


def real_layouts():
    """Shell assignments LAYOUT_<schedule>='...' of the layout plan picks for each real-compute run
    (Megatron's own 1F1B takes 1f1b's: one chunk per rank, as Megatron lays it out)."""
    from megatron_zb.core.plan import ModelSpec, PlanRequest, plan
    rows = plan(PlanRequest(ModelSpec(**REAL_MODEL), 2, 8, 80.0, schedules=["1f1b", "zb-h1", "zb-v"]), jobs=1)
    got = {r["schedule"]: r["layout"] for r in rows if "layout" in r}
    got["megatron"] = got["1f1b"]
    for s in REAL:
        print(f"LAYOUT_{s.replace('-', '_')}='{got[s]}'")


def _spread(xs):
    return f"{min(xs):.0f}-{max(xs):.0f}" if len(xs) > 1 else "-"


def real_cpu_speed(out):
    """Real compute on this machine's CPU: per schedule and round the median elapsed time of the
    iterations after the profiling window; the median over the rounds and their spread. Simulated:
    the schedule that ran, with the costs profiled in that run (``simulated_ms``) and Megatron's
    optimizer step (the measured time between two forward-backward calls); Megatron's own 1F1B runs
    1f1b's order, timed with megatron-zb's 1f1b profile of the same round (the same layout, its fused
    backwards measured)."""
    rows = []
    for s in REAL:
        meds, preds = [], []
        for path in sorted(glob.glob(os.path.join(out, f"real_{s}_r*.log"))):
            its = read_log(path)
            after = [ms for i, (ms, _) in its.items() if REAL_TIMED_FROM <= i < max(its)]
            if after:
                meds.append(statistics.median(after))
            src = "1f1b" if s == "megatron" else s
            prof = path.replace(f"real_{s}_", f"real_profile_{src}_").replace(".log", ".json")
            if os.path.exists(prof):
                preds.append(simulated_ms(json.load(open(prof)), src, with_step=True)[0])
        if not meds:
            if s == "1f1b":  # an older run without it: the rest still compares
                continue
            return None
        rows.append({"label": "Megatron's own 1F1B" if s == "megatron" else s, "schedule": s,
                     "measured": statistics.median(meds), "rounds": meds,
                     "predicted": statistics.median(preds) if preds else None, "predicted_rounds": preds})
    base = rows[0]
    for r in rows:
        per_round = [b / x for b, x in zip(base["rounds"], r["rounds"])]
        r["speedup_measured"] = statistics.median(per_round)
        r["speedup_measured_rounds"] = per_round
        r["speedup_predicted"] = base["predicted"] / r["predicted"] if r["predicted"] and base["predicted"] else None
        r["error_pct"] = 100.0 * (r["measured"] - r["predicted"]) / r["predicted"] if r["predicted"] else None
        r["spread_pct"] = 100.0 * (max(r["rounds"]) - min(r["rounds"])) / r["measured"]
        r["ratio_error_pct"] = (100.0 * (r["speedup_measured"] / r["speedup_predicted"] - 1.0)
                                if r["speedup_predicted"] else None)
    n = len(rows[0]["rounds"])
    print(f"Speed with REAL compute (CPU): 2 pipeline ranks, each a process on its own core (gloo), train a GPT of\n"
          f"8 layers, hidden 256, sequence 256, vocabulary {REAL_MODEL['vocab_size']} (its output layer weighs about 2 "
          f"layers), 8 microbatches,\neach schedule with the layout plan picks for it; {n} rounds, schedules "
          f"interleaved; per round the median elapsed\ntime per iteration from iteration {REAL_TIMED_FROM} to the one "
          "before the last; the median over the rounds, and their\nspread (min-max). simulated = the schedule that ran, "
          "timed with the costs profiled in those same\niterations: each model chunk's F/B/W (fused backwards as "
          "measured), each pass's host costs (its\nmessages, the executor, what other threads take), the optimizer "
          "step; Megatron's own 1F1B: 1f1b's\norder and megatron-zb's 1f1b profile of the same round")
    print(f"{'schedule':<22}{'ms per iteration':^38}{'speed-up over Megatron 1F1B':^34}")
    print(f"{'':<22}{'measured':>10}{'spread':>10}{'simulated':>11}{'diff':>7}{'measured':>11}{'spread':>13}"
          f"{'simulated':>11}")
    for r in rows:
        pred = f"{r['predicted']:>11.1f}{r['error_pct']:>+6.1f}%" if r["predicted"] else f"{'-':>11}{'-':>7}"
        sp = f"{r['speedup_predicted']:>10.3f}x" if r["speedup_predicted"] else f"{'-':>11}"
        spread = (f"{min(r['speedup_measured_rounds']):.3f}-{max(r['speedup_measured_rounds']):.3f}"
                  if n > 1 and r is not base else "-")
        print(f"{r['label']:<22}{r['measured']:>10.1f}{_spread(r['rounds']):>10}{pred}"
              f"{r['speedup_measured']:>10.3f}x{spread:>13}{sp}")
    return rows


def _versus(r, base):
    """Words for a row's measured speed-up over Megatron's own 1F1B: what its rounds show, never more."""
    rr = r["speedup_measured_rounds"]
    lo, hi, n = min(rr), max(rr), len(rr)
    each = f"each of {n} rounds" if n > 1 else "1 round"
    if lo > 1.0:
        what = (f"{r['speedup_measured']:.3f}x the iteration speed of {base} measured ({each} faster: "
                f"{lo:.3f}x-{hi:.3f}x)")
    elif hi < 1.0:
        what = (f"slower than {base} measured: {r['speedup_measured']:.3f}x its iteration speed ({each} slower: "
                f"{lo:.3f}x-{hi:.3f}x)")
    else:
        what = f"no speed-up over {base} measured: its {n} rounds range {lo:.3f}x-{hi:.3f}x, across 1.000x"
    if r["speedup_predicted"]:
        what += f"; {r['speedup_predicted']:.3f}x simulated"
    return what


def real_summary(rows):
    """The summary lines of the real-compute rows: each row's measured iteration beside its simulation
    (in words where they differ by more than the rounds' spread), each schedule's speed-up over
    Megatron's own 1F1B as its rounds show it, and whether every row is within REAL_WITHIN_PCT."""
    lines, base = [], rows[0]["label"]
    for r in rows:
        head = f"speed (real compute, CPU): {r['label']}"
        if r is not rows[0]:
            head += " " + _versus(r, base) + ";"
        if r["predicted"] is None:
            lines.append(f"{head} iteration {r['measured']:.0f} ms measured (no profile to simulate)")
            continue
        e, spread = r["error_pct"], r["spread_pct"]
        if abs(e) <= spread:
            words = "within the rounds' spread"
        else:
            words = (f"measured {abs(e):.1f}% {'slower' if e > 0 else 'faster'} than simulated, more than the "
                     f"rounds' spread ({spread:.1f}%)")
        lines.append(f"{head} iteration {r['measured']:.0f} ms measured (rounds {_spread(r['rounds'])}), "
                     f"{r['predicted']:.0f} ms simulated ({e:+.1f}%: {words})")
    off = [r for r in rows if r["predicted"] is not None and abs(r["error_pct"]) > REAL_WITHIN_PCT]
    if not off:
        worst = max((r for r in rows if r["predicted"] is not None), key=lambda r: abs(r["error_pct"]))
        lines.append(f"real compute (CPU): every row within {REAL_WITHIN_PCT:g}% of its simulation (median over the "
                     f"rounds; largest {worst['error_pct']:+.1f}%, {worst['label']})")
    else:
        lines.append(f"real compute (CPU): not every row within {REAL_WITHIN_PCT:g}% of its simulation: "
                     + ", ".join(f"{r['label']} {r['error_pct']:+.1f}%" for r in off))
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", default="out/quickstart")
    ap.add_argument("--mode", choices=["cpu", "gpu"], default="cpu")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--schedules", nargs="+", default=["zb-v", "1f1b"])
    ap.add_argument("--microbatches", type=int, default=8, help="cpu mode: for the emulated run (the tiny GPT's)")
    ap.add_argument("--profile-window-end", type=int, default=20, help="gpu mode")
    ap.add_argument("--real-layouts", action="store_true",
                    help="print the layout plan picks for each real-compute run (shell assignments) and exit")
    ap.add_argument("--emulate", action="store_true",
                    help="only run the emulated-compute comparison (writes <out>/emulated.json and pictures)")
    args = ap.parse_args(argv)
    out = args.out
    if args.real_layouts:
        real_layouts()
        return
    if args.emulate:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # clean up the launched ranks when stopped
        run_emulation(out, args.pp, args.microbatches)
        run_vocab_emulation(out, args.pp, args.microbatches)
        return
    logs, its, worst = correctness(out, args.schedules)
    first, last = its[0], its[-1]
    print()
    real = vocab = None
    if args.mode == "cpu":
        rows, pictures = emulated_speed(out)
        print()
        vocab = vocab_speed(out)
        if vocab:
            print()
            pictures += [r["picture"] for r in vocab if r.get("picture")]
        real = real_cpu_speed(out)
    else:
        rows, pictures = gpu_speed(out, args.schedules, logs, args.profile_window_end)
    with open(os.path.join(out, "quickstart.json"), "w") as f:
        json.dump({"mode": args.mode, "largest_loss_diff": worst, "iterations": its,
                   "losses": {s: [logs[s][i][1] for i in its] for s in args.schedules}, "speed": rows,
                   "real_compute_cpu": real, "vocab_parallel_emulated": vocab}, f, indent=1)

    print("\n== summary ==")
    others = " and ".join(args.schedules[1:])
    where = "on CPU" if args.mode == "cpu" else f"on {args.pp} GPUs"
    ref = args.schedules[0]
    same = "the same losses as" if worst == 0.0 else f"losses within {worst:.1e} of"
    print(f"correctness: {ref} trained the GPT with {same} {others} ({last} iterations {where}; "
          f"largest |difference| {worst:.1e}; loss {logs[ref][first][1]:.3f} -> {logs[ref][last][1]:.3f})")
    kind = "emulated H100 compute" if args.mode == "cpu" else "real compute"
    base = rows[0]["label"]
    for r in rows[1:]:
        if r["predicted"]:
            print(f"speed ({kind}): {r['label']} {r['speedup_measured']:.3f}x the iteration speed of {base} measured, "
                  f"{r['speedup_predicted']:.3f}x simulated (iteration {r['measured']:.0f} ms measured, "
                  f"{r['predicted']:.0f} ms simulated: {r['error_pct']:+.1f}%)")
        else:
            print(f"speed ({kind}): {r['label']} {r['speedup_measured']:.3f}x the iteration speed of {base} measured")
    for r in (vocab or [])[1:]:
        print(f"speed (vocabulary parallelism, emulated compute): {r['label']} {r['speedup_measured']:.3f}x the "
              f"iteration speed of {vocab[0]['label']} with its best layout measured, {r['speedup_predicted']:.3f}x "
              f"simulated (iteration {r['measured']:.1f} ms measured, {r['predicted']:.1f} ms simulated: "
              f"{r['error_pct']:+.1f}%)")
    for line in real_summary(real) if real else []:
        print(line)
    for p in pictures:
        what = "emulated iteration as it ran" if args.mode == "cpu" else "schedule with the profiled times"
        exts = "(.svg; Chrome trace .trace.json)" if p.endswith("zb-v") else ""
        print(f"timeline of the {os.path.basename(p)[9:]} {what}: {p}.png {exts}".rstrip() + ", time in ms")
    print(f"logs: {out}/setup.log, " + ", ".join(f"{out}/train_{s}.log" for s in args.schedules))


if __name__ == "__main__":
    main()
