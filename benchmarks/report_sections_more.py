"""The later sections of ``docs/results.md``: offload, memory, vocabulary parallelism, variable
lengths, MoE, optimizer offload, plan speed, faults, exact optimum, the field, the test figures, real compute.

Same conventions as ``report_sections.py`` (whose helpers these blocks use): each block takes
``(res, names, src)`` and returns markdown lines, raising on a shape it does not know.
"""
from __future__ import annotations

from report_sections import label, num, pct, provenance, spread, table, times


def offload_block(res, names, src):
    """bench_offload.py: simulated time and peak activation per schedule and offload ratio."""
    d = res[names[0]]
    out = provenance(src, names)
    for k in sorted({r["offload_time"] for r in d["rows"]}):
        cols, cells = [], {}
        for r in (r for r in d["rows"] if r["offload_time"] == k):
            col = f"ratio {r['ratio']:g}" + (", half duplex" if r["duplex"] != "full" else "")
            cols += [col] if col not in cols else []
            slower = f" (time {pct(100.0 * r['time_increase'])})" if r["time_increase"] > 1e-9 else ""
            cells.setdefault(r["schedule"], {})[col] = f"{r['peak']:g}{slower}"
        rows = [[sc] + [v.get(c, "-") for c in cols] for sc, v in cells.items()]
        out += [f"K = {k:g} (one stage activation's copy over F + B), P={d['stages']} M={d['microbatches']}: "
                "peak activation per offload ratio (and the time added, where offload adds any):", ""]
        out += table(["schedule"] + cols, rows) + [""]
    return out[:-1]


def offload_table5_block(res, names, src):
    """bench_offload_table5.py: the ZB paper's Table-5 settings at half of 1F1B's memory, with offload."""
    d = res[names[0]]
    cells, scheds = {}, []
    for r in d["rows"]:
        scheds += [r["schedule"]] if r["schedule"] not in scheds else []
        cells.setdefault((r["model"], r["stages"], r["microbatches"]), {})[r["schedule"]] = (
            f"{num(100.0 * r['bubble'], 2)}% (peak {num(r['peak'], 2)} of {r['limit']:g}, {r['cpu_s']:.1f} s)")
    rows = [[m, str(p), str(mb)] + [v.get(s, "-") for s in scheds] for (m, p, mb), v in cells.items()]
    note = ("Bubble with activation offload at a memory limit of P/2 (1F1B's peak is P), K = "
            f"{d['offload_time']:g}; in parentheses the peak and the CPU seconds of the search.")
    return provenance(src, names) + [note, ""] + table(["model", "P", "M"] + scheds, rows)


def memory_block(res, names, src):
    """bench_memory.py: each rank's activation peak measured, simulated and by plan's formula."""
    d = res[names[0]]
    rows = [[r["schedule"], "yes" if r["passed"] else "no",
             " / ".join(num(b / 1024, 0) for b in r["measured_bytes"]),
             pct(100.0 * max(r["simulated_dev"], key=abs)), pct(100.0 * max(r["plan_dev"], key=abs))]
            for r in d["rows"]]
    head = ["schedule", "exact", "measured peak KiB per rank", "simulated: worst deviation",
            "plan's formula: worst deviation"]
    note = f"PP={d['pp']}, M={d['microbatches']}, the tiny GPT of `megatron-zb verify` on CPU processes."
    return provenance(src, names) + [note, ""] + table(head, rows)


def vocab_paper_block(res, names, src):
    """bench_vocab_paper.py: the vocabulary-parallelism paper's setting, ours simulated beside theirs.
    A second run (e.g. ``--split-vocab-embedding``) adds its VP-1 peak as a column."""
    rows = []
    for r in res[names[0]]["results"]:
        ours, theirs = r["ours"], r["theirs"]
        rows.append([str(r["seq"]), str(r["vocab"]),
                     times(ours["vocab-1"]["gain_vs_baseline"], 2), times(theirs["vocab-1"]["vs_baseline"], 2),
                     times(ours["vocab-2"]["gain_vs_baseline"], 2), times(theirs["vocab-2"]["vs_baseline"], 2),
                     times(ours["zb-v + vocab-1"]["gain_vs_baseline"], 2),
                     f"{num(ours['baseline']['peak_gb'], 1)} / {num(theirs['baseline']['peak_gb'], 1)}",
                     f"{num(ours['vocab-1']['peak_gb'], 1)} / {num(theirs['vocab-1']['peak_gb'], 1)}"])
    head = ["seq", "vocab", "1F1B+VP-1 ours", "theirs", "1F1B+VP-2 ours", "theirs", "ZB-V+VP ours",
            "baseline peak GB ours / theirs", "VP-1 peak GB ours / theirs"]
    for n in names[1:]:
        head.append(f"VP-1 peak GB ours, {label(n)}")
        peaks = {(r["seq"], r["vocab"]): r["ours"]["vocab-1"]["peak_gb"] for r in res[n]["results"]}
        for row in rows:
            row.append(num(peaks.get((int(row[0]), int(row[1]))), 1))
    note = ("Throughput over their baseline (1F1B, the output layer on the last stage); theirs measured on 8 "
            "A100s (their artifact), ours simulated.")
    return provenance(src, names) + [note, ""] + table(head, rows)


def vocab_runs_block(res, names, src):
    """bench_vocab_cpu.py and the quickstart's emulated run: Megatron's 1F1B against plan's VP row."""
    out = provenance(src, names)
    rows = []
    for n in names:
        for r in res[n]["rows"]:
            measured = r.get("rounds_ms") or r.get("per_iteration")
            rng = r.get("speedup_rounds") or r.get("speedup_measured_range")
            rows.append([label(n), r["label"], spread(measured, lambda v: num(v, 0)),
                         num(r.get("predicted_ms", r.get("predicted")), 0), pct(r["error_pct"]),
                         f"{times(r['speedup_measured'])} ({times(min(rng))}-{times(max(rng))})",
                         times(r["speedup_predicted"])])
    head = ["run", "schedule", "ms per iteration, median (min-max)", "simulated ms", "error",
            "speed-up measured (spread)", "simulated"]
    return out + table(head, rows)


def varlen_block(res, names, src):
    """bench_varlen.py: variable-length batches, Megatron's 1F1B against balanced schedules."""
    out, rows, emu = provenance(src, names), [], []
    for n in names:
        for s in res[n]["settings"]:
            tag = f"P={s['stages']} D={s['data_parallel_size']}, {s['sequences']} seqs, {s['distribution']}"
            best = max((r for r in s["rows"] if r["balanced"]), key=lambda r: r["speedup_vs_megatron_1f1b"])
            base = next(r for r in s["rows"] if r["schedule"] == "1f1b" and not r["balanced"])
            plan = s["planning_ms"]["total"]
            if n == names[0]:
                rows.append([tag, num(base["iteration_ms"] / 1e3, 2), best["schedule"],
                             times(best["speedup_vs_megatron_1f1b"], 2), times(best["speedup_vs_unbalanced"], 2),
                             f"{num(plan['mean'], 1)} (max {num(plan['max'], 1)})"])
            emu += [[label(n), tag, e["schedule"], "yes" if e["balanced"] else "no", num(e["measured_ms"], 0),
                     num(e["simulated_ms"], 0), pct(e["error_pct"]), times(e["speedup_measured"], 2)]
                    for e in s.get("emulated", [])]
    out += ["Simulated, mean over the batches:", ""]
    out += table(["setting", "Megatron 1F1B s", "best balanced", "over Megatron 1F1B",
                  "over itself unbalanced", "planning ms per rank"], rows)
    out += ["", "Emulated (real processes, each pass a wait of its cost) against the simulator:", ""]
    return out + table(["run", "setting", "schedule", "balanced", "measured ms", "simulated ms", "error",
                        "speed-up over 1F1B"], emu)


def moe_overlap_block(res, names, src):
    """bench_moe_overlap.py: EP all-to-all overlap against Megatron's combined 1F1B."""
    cols, cells = [], {}
    for r in res[names[0]]["results"]:
        col = f"P={r['stages']} M={r['microbatches']}, a2a {r['a2a_share']:g}"
        cols.append(col)
        emulated = {e["schedule"]: e for e in r.get("emulated", [])}
        for s in r["simulated"]:
            e = emulated.get(s["schedule"])
            emu = f", emulated {times(e['speedup_vs_anchor'])}" if e else ""
            value = f"{times(s['speedup_vs_anchor'])}{emu} ({s['peak_activation']:g})"
            cells.setdefault(s["schedule"], {})[col] = value
    note = ("Speed-up over Megatron's combined 1F1B, simulated (and emulated on real processes where run), "
            "with the peak activation in parentheses; a2a: the all-to-all's share of a pass.")
    rows = [[sc] + [v.get(c, "-") for c in cols] for sc, v in cells.items()]
    return provenance(src, names) + [note, ""] + table(["schedule"] + cols, rows)


def moe_recompute_block(res, names, src):
    """bench_moe_recompute.py: schedule family x model feature, exact against the reference."""
    cells, scheds = {}, []
    for c in res[names[0]]["cells"]:
        scheds += [c["schedule"]] if c["schedule"] not in scheds else []
        if c.get("refused"):
            val = "refused"
        else:
            val = f"{c['max_rel_grad_diff']:.1e}" if c.get("passed") else "FAILED"
        cells.setdefault(c["feature"], {})[c["schedule"]] = val
    rows = [[f] + [v.get(s, "-") for s in scheds] for f, v in sorted(cells.items())]
    note = "Max relative gradient difference against the non-pipelined reference (PP=2, CPU processes)."
    return provenance(src, names) + [note, ""] + table(["feature"] + scheds, rows)


def optimizer_offload_block(res, names, src):
    """bench_optimizer_offload.py: optimizer states in host memory, per schedule."""
    d = res[names[0]]

    def way(r, k):
        if not r[k]["fits"]:
            return "does not fit"
        return f"{num(r[k]['iteration_s'], 2)} s, {num(r[k]['peak_gib'], 1)} GiB"
    rows = [[r["schedule"], num(r["peak_without_gib"], 1), "yes" if r["fits_without"] else "no",
             way(r, "static"), way(r, "auto"), way(r, "trough")] for r in d["rows"]]
    h = d["headline"]
    note = (f"{d['model']}, TP={d['tensor_parallel_size']}, PP={d['pipeline_parallel_size']}, "
            f"M={d['num_microbatches']}, sequence {d['seq_length']}, {d['gpu_memory_gb']:g} GiB per GPU, "
            f"simulated. Fastest that fits only with trough offload: {h['fastest_only_with_trough']} "
            f"{times(h['speedup'])} the best that fits without ({h['best_without']}).")
    head = ["schedule", "peak without GiB", "fits without", "static offload", "per-rank shares", "trough"]
    return provenance(src, names) + [note, ""] + table(head, rows)


def plan_speed_block(res, names, src):
    """bench_plan_speed.py (default mode): plan's CPU seconds per mode."""
    rows = [[str(r["p"]), str(r["m"]), r["mode"], num(r["cpu_s"], 2), r["best"]["schedule"],
             str(r["best"]["vocab"] or "-"), num(r["best"]["iteration_time_s"], 3)]
            for n in names for r in res[n]["results"]]
    head = ["P", "M", "vocabulary rows", "CPU s", "best", "VP", "iteration s"]
    return provenance(src, names) + table(head, rows)


def plan_commands_block(res, names, src):
    """bench_plan_speed.py --commands: the plan command lines' CPU seconds, one column per run."""
    cols, cells, tags = [], {}, []
    for n in names:
        tag = label(n).replace("plan_speed_commands", "").strip("_") or "latest"
        tags.append(tag)
        for r in res[n]["results"]:
            col = f"{tag}, {'full' if 'full' in r['search'] else 'quick'}, jobs {r['jobs']}"
            cols += [col] if col not in cols else []
            runs = r.get("cpu_s_runs")
            val = spread(runs, lambda v: num(v, 2)) if runs else num(r["cpu_s"], 2)
            cells.setdefault((r["model"], r["p"], r["m"]), {})[col] = val
    rows = [[m, str(p), str(mb)] + [v.get(c, "-") for c in cols] for (m, p, mb), v in cells.items()]
    out = provenance(src, names, tags) + ["CPU seconds of one `megatron-zb plan` (median (min-max) where "
                                          "it was run several times):", ""]
    out += table(["model", "P", "M"] + cols, rows)
    best = [[r["model"], str(r["p"]), str(r["m"]), r["best"]["schedule"], str(r["best"]["vocab"] or "-"),
             r["best"]["layout"], num(r["best"]["iteration_ms"], 1), num(r["best"]["peak_gib"], 1),
             "yes" if r["best"]["fits"] else "no"] for r in res[names[0]]["results"]]
    out += ["", f"The best row of `{label(names[0])}`:", ""]
    return out + table(["model", "P", "M", "schedule", "VP", "layout", "iteration ms", "peak GiB", "fits"], best)


def plan_gaps_block(res, names, src):
    """bench_plan_speed.py --gaps: the full search's gain over plan's quick pass, row by row."""
    rows = []
    for r in res[names[0]]["results"]:
        worst = max(r["rows"].items(), key=lambda kv: (kv[1]["quick_over_full"], kv[0]))
        rows.append([r["model"], str(r["p"]), str(r["m"]), num(r["cpu_s"]["quick"], 2), num(r["cpu_s"]["full"], 2),
                     str(len(r["rows"])), f"{worst[0]}: {pct(100.0 * worst[1]['quick_over_full'], 2)}"])
    head = ["model", "P", "M", "quick CPU s", "full CPU s", "rows", "largest quick row over full"]
    return provenance(src, names) + table(head, rows)


def faults_block(res, names, src):
    """bench_faults.py: how fast a stopped or killed rank ends the job."""
    d = res[names[0]]
    what = {"stop.first_error_s": "SIGSTOP a rank: first error line", "stop.job_end_s": "SIGSTOP a rank: job over",
            "kill.job_end_s": "SIGKILL a rank: job over", "launcher.ranks_gone_s": "SIGKILL torchrun: ranks gone"}
    rows = [[what.get(k, k), num(v["median"], 2), num(v["max"], 2)] for k, v in d["summary"].items()]
    note = f"zb-v, PP={d['pp']}, `--zero-bubble-timeout {d['timeout_s']:g}`, {d['trials']} trials, wall seconds."
    return provenance(src, names) + [note, ""] + table(["event", "median s", "max s"], rows)


def exact_block(res, names, src):
    """bench_exact.py: the automatic schedulers against the exact MILP on small settings."""
    d = res[names[0]]
    rows = [[s["schedule"], str(s["settings"]), str(s["proven_optimal"]), str(s["heuristic_optimal"]),
             pct(100.0 * s["worst_gap_to_optimum"], 2)] for s in d["summary"]]
    head = ["schedule", "settings", "optimum proven", "heuristic optimal", "worst gap to the optimum"]
    note = f"MILP (HiGHS) with a node limit of {d['node_limit']}; the gap only where the optimum is proven."
    return provenance(src, names) + [note, ""] + table(head, rows)


def field_block(res, names, src):
    """bench_field.py: BitPipe, ZeroPP, interleaved ZB against interleaved 1F1B, ZB-V, DualPipeV."""
    d = res[names[0]]
    titles = [s["setting"] for s in d["settings"]]
    cells = {}
    for s in d["settings"]:
        for r in s["rows"]:
            extra = f", {r['weight_copies']:g} weight copies" if r["weight_copies"] != 1 else ""
            value = f"{num(r['bubble_rate'], 3)} ({r['peak_activation']:g}{extra})"
            cells.setdefault(r["schedule"], {})[s["setting"]] = value
    out = provenance(src, names) + ["Bubble rate (peak activation per rank, x one microbatch's 1F1B stage "
                                    "activation):", ""]
    out += table(["schedule"] + titles, [[sc] + [v.get(t, "-") for t in titles] for sc, v in cells.items()])
    grid = [[g["costs"], str(g["p"]), str(g["m"])] + [num(g.get(k), 3) for k in
            ("authors", "bitpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")]
            for g in d["bitpipe_grid"] if g["p"] in (8, 16)]
    out += ["", "bitpipe by P and M (bubble; the grid's P = 8 and 16):", ""]
    out += table(["costs", "P", "M", "BitPipe authors", "bitpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"],
                 grid)
    cols, paper = [p["setting"] for p in d["paper"]], {}
    for p in d["paper"]:
        for r in p["rows"]:
            paper.setdefault(r["schedule"], {})[p["setting"]] = (
                f"{times(r['throughput_vs_1f1b'])} ({num(r['iteration_time_s'], 3)} s, "
                f"{num(max(r['peak_bytes']) / 2 ** 30, 1)} GiB{'' if r['fits'] else ', does not fit'})")
    out += ["", "The BitPipe paper's models, throughput over 1F1B (iteration, peak per rank; plan's FLOPs model, "
            "A100 80 GB at 50% of peak, an assumption):", ""]
    return out + table(["schedule"] + cols, [[sc] + [v.get(c, "-") for c in cols] for sc, v in paper.items()])


def test_figures_block(res, names, src):
    """bench_test_figures.py: the wall-clock figures the tests used to assert."""
    def show(v):
        return " / ".join(num(x, 3) for x in v) if isinstance(v, list) else num(v, 3)
    rows = [[p["part"], f["figure"], show(f["value"]), f["old_bound"], "yes" if f["within_old_bound"] else "no",
             "-".join(num(x, 1) for x in p["load_average_before_after"])]
            for p in res[names[0]]["results"] for f in p["figures"]]
    head = ["part", "figure", "value", "old test bound", "within", "load average"]
    return provenance(src, names) + table(head, rows)


_ATTR_GROUPS = ("compute", "waits", "messages", "executor", "hooks", "step", "gc")
_ATTR_LABELS = {"megatron": "Megatron's own 1F1B", "1f1b": "megatron-zb 1f1b", "zb-h1": "megatron-zb zb-h1",
                "zb-v": "megatron-zb zb-v"}


def attribution_block(res, names, src):
    """bench_attribution.py: a real-compute iteration per rank, measured beside the simulation, per schedule;
    each schedule's iteration against its simulation; each pass beside Megatron's own."""
    out = provenance(src, names)
    for n in names:
        d = res[n]
        lo, hi = d["load_average"]
        out += [f"The host's load average during the rounds: {lo:.1f}-{hi:.1f} (2 cores; the run's own two ranks count 2). "
                f"Per rank, ms per iteration (median over the iterations from {d['timed_from']} on, median over "
                f"{d['rounds']} rounds; the groups' medians need not add up); simulated: the run's profile with "
                "host costs (compute = each pass's median + its handling + interference; waits = idle), the step "
                "as profiled; off core: time the rank was runnable but another thread or process had its core:", ""]
        rows = []
        for s, v in d["schedules"].items():
            for r, (m, sim) in enumerate(zip(v["measured"], v["simulated"])):
                rows.append([_ATTR_LABELS.get(s, s), f"rank {r} measured", num(1e3 * m["iteration"], 1)]
                            + [num(1e3 * m[g], 1) for g in _ATTR_GROUPS] + [num(1e3 * m["off_core"], 1)])
                rows.append(["", f"rank {r} simulated", num(1e3 * sim["iteration"], 1)]
                            + [num(1e3 * sim[g], 1) if sim.get(g) is not None else "-" for g in _ATTR_GROUPS] + ["-"])
        out += table(["schedule", "", "iteration"] + list(_ATTR_GROUPS) + ["off core"], rows) + [""]
        rows = []
        for s, v in d["schedules"].items():
            meas, sim = v["measured"][0]["iteration"], v["simulated"][0]["iteration"]
            bare = v["simulated_without_host_costs"][0]["iteration"]
            old = v.get("simulated_from_zb_h1_medians")
            rows.append([_ATTR_LABELS.get(s, s), spread(v["measured_rounds_ms"], lambda x: num(x, 0)), num(1e3 * sim, 0),
                         pct(100 * (meas / sim - 1)), num(1e3 * bare, 0), pct(100 * (meas / bare - 1)),
                         f"{num(1e3 * old[0]['iteration'], 0)} ({pct(100 * (meas / old[0]['iteration'] - 1))})"
                         if old else "-", times(v["jitter_factor"])])
        out += ["Each schedule's iteration: measured (median of the rounds, min-max), simulated with the host costs, "
                "without them, Megatron's own 1F1B as timed with zb-h1's profile (split B and W, medians), and what "
                "drawing each pass's duration from the window's samples adds to a replay of the schedule:", ""]
        out += table(["schedule", "measured ms", "simulated", "error", "without host costs", "error",
                      "from zb-h1's profile", "jitter replay"], rows) + [""]
        rows = [[_ATTR_LABELS.get(p["schedule"], p["schedule"]), str(p["stage"]), p["kind"], num(p["measured_ms"], 1),
                 num(p.get("profile_ms"), 1)] + ([num(p["megatron_ms"], 1), pct(p["vs_megatron_pct"])]
                                                 if p.get("megatron_ms") is not None else ["-", "-"])
                for p in d["passes"] if p["schedule"] != "megatron"]
        out += ["Each pass, ms (median per pass, median over rounds), beside the profile's median and Megatron's own "
                "pass on the same stage (F beside F; BW and B+W beside its fused BW):", ""]
        out += table(["schedule", "stage", "pass", "measured", "profile", "Megatron's", "vs Megatron's"], rows) + [""]
    return out[:-1]


SECTIONS = (
    ("Activation offload", "Activations streamed to host memory, simulated (memory in units of one "
     "microbatch's stage activation, time in units of F).",
     (("offload.json", offload_block), ("offload_table5.json", offload_table5_block))),
    ("Memory as measured", "Each pipeline rank's activation peak in a real run against the simulator and plan.",
     (("memory.json", memory_block),)),
    ("Vocabulary parallelism",
     "The output layer and loss spread over the pipeline ranks (`--enable-vocab-parallel`).",
     (("vocab_paper*.json", vocab_paper_block), ("vocab_*.json", vocab_runs_block))),
    ("Variable-length batches", "Megatron's 1F1B with sequential microbatches against per-microbatch schedules "
     "with the global batch balanced over the data-parallel replicas.",
     (("varlen*.json", varlen_block),)),
    ("MoE", "Expert-parallel all-to-all overlap, and every schedule family with MoE and recompute.",
     (("moe_overlap.json", moe_overlap_block), ("moe_recompute.json", moe_recompute_block))),
    ("Optimizer offload", "Optimizer states in host memory: static, per rank, or visiting the GPU in the troughs.",
     (("optimizer_offload.json", optimizer_offload_block),)),
    ("Plan speed", "What `megatron-zb plan` costs in CPU seconds (the box is shared: CPU, not wall, time).",
     (("plan_speed.json", plan_speed_block), ("plan_speed_commands*.json", plan_commands_block),
      ("plan_search_gaps.json", plan_gaps_block))),
    ("Faults", "Fault handling of the training entry point, wall-clock on a CPU job.",
     (("faults.json", faults_block),)),
    ("Exact optimum", "How far the automatic schedulers are from the proven optimum on small settings.",
     (("exact.json", exact_block),)),
    ("The field: BitPipe, ZeroPP, interleaved ZB", "Simulated against interleaved 1F1B, ZB-V and DualPipeV.",
     (("field.json", field_block),)),
    ("Figures the tests used to assert", "Wall-clock figures measured beside the host's load instead of asserted.",
     (("test_figures.json", test_figures_block),)),
    ("Real compute: where the time goes", "A real-compute iteration (the main job's CPU run: 2 ranks, 8 microbatches) "
     "split per rank into compute, waits, message handling, the executor, hooks and Megatron's step, beside the "
     "simulator fed by the run's profile (docs/real_compute.md).",
     (("attribution*.json", attribution_block),)),
)
