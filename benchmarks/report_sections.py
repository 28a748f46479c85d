"""The first sections of ``docs/results.md`` and the helpers every section uses (``benchmarks/
report.py`` assembles the page; ``report_sections_more.py`` has the later sections).

Every block function takes ``(res, names, src)``: ``res`` maps a result file's path under
``benchmarks/results/`` to its parsed JSON, ``names`` the files its pattern claimed (sorted), and
``src(name)`` gives that file's ``(command, machine kind)``. It returns markdown lines. A block that
meets a shape it does not know raises (KeyError, TypeError, ...): report.py then lists its files
under "Other results" instead. Pure Python, standard library only; the page must come out the same
from the same JSON, so every figure has a fixed format and every list a fixed order.
"""
from __future__ import annotations

import re
import statistics


def cell(x):
    """A table cell: text with its pipes escaped, on one line."""
    return str(x).replace("|", "\\|").replace("\n", " ")


def table(head, rows):
    """A markdown table (a list of lines) from a header and rows of cells."""
    out = ["| " + " | ".join(cell(h) for h in head) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]


def num(x, nd=2):
    """A number with ``nd`` decimals; ``n/a`` for a missing one."""
    return "n/a" if x is None else f"{x:.{nd}f}"


def times(x, nd=3):
    """A ratio, e.g. ``1.004x``."""
    return "n/a" if x is None else f"{x:.{nd}f}x"


def pct(x, nd=1):
    """A signed percentage, e.g. ``+2.3%``."""
    return "n/a" if x is None else f"{x:+.{nd}f}%"


def ms(seconds):
    """Seconds as milliseconds: two decimals below 10 ms, one above."""
    if seconds is None:
        return "n/a"
    v = 1e3 * seconds
    return f"{v:.2f}" if v < 10 else f"{v:.1f}"


def spread(values, fmt):
    """``median (min-max)`` of samples, each through ``fmt``."""
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


def spread_ms(samples_s):
    """Samples in seconds as ``median (min-max)`` milliseconds."""
    return spread(samples_s, ms)


def label(name):
    """A result file's short name: its path without ``.json``."""
    return name[:-5] if name.endswith(".json") else name


def provenance(src, names, tags=None):
    """Where a table comes from: per file, the command that wrote it and the machine kind."""
    out = []
    for i, n in enumerate(names):
        command, machine = src(n)
        tag = f"{tags[i]}: " if tags else ""
        out.append(f"- {tag}`{command}` on {machine} (`benchmarks/results/{n}`)")
    return out + [""]


def split_block(res, names, src):
    """One megatron-core layer: fused backward against B + W (bench_split_overhead.py)."""
    rows = []
    for n in names:
        d = res[n]
        c, med, smp = d["config"], d["median_s"], d["samples_s"]
        shape = f"h{c['hidden']} s{c['seq']} heads {c['heads']}"
        gaf = "on" if c.get("gradient_accumulation_fusion") else "off"
        rows.append([label(n), src(n)[1], shape, c.get("dtype", "fp32"), gaf, str(c["reps"]),
                     spread_ms(smp["fused"]), spread_ms(smp["b+w"]), ms(med.get("f")), ms(med["b"]), ms(med["w"]),
                     times(d["ratio_b_plus_w_over_fused"]), times(d["ratio_bw_attached_over_fused"])])
    head = ["run", "machine", "shape", "dtype", "GAF", "reps", "fused ms", "B+W ms", "F ms", "B ms", "W ms",
            "(B+W) / fused", "BW attached / fused"]
    note = ("Times per layer: median (min-max) over the repetitions; `BW attached` is the fused backward "
            "with the W queue attached. The goal is (B+W) / fused <= 1.05.")
    return provenance(src, names) + [note, ""] + table(head, rows)


def run_number(name):
    """The run number in a result file's name (``run5_gpu_check.json`` -> 5), 0 without one."""
    found = re.findall(r"\d+", name.rsplit("/", 1)[-1])
    return int(found[0]) if found else 0


def gpu_runs_block(res, names, src):
    """The GPU check's runs: each section's status, then the figures of the latest clean run."""
    names = sorted(names, key=lambda n: (n.rsplit("/", 1)[0], run_number(n), n))
    sections = []
    for n in names:
        sections += [s for s in res[n]["sections"] if s not in sections]
    rows = []
    for n in names:
        secs = res[n]["sections"]
        rows.append([label(n)] + [secs[s]["status"] if s in secs else "-" for s in sections]
                    + [num(res[n]["wall_s"], 0), "yes" if res[n].get("ok") else "no"])
    out = provenance(src, names) + table(["run"] + sections + ["wall s", "all ok"], rows)
    clean = [n for n in names if res[n].get("ok")] or names
    last = clean[-1]
    figures = []
    for name, sec in res[last]["sections"].items():
        figures += [[name, r["what"], r["measured"], r["predicted"] or "-"] for r in sec.get("rows", [])]
    out += ["", f"Figures of `{label(last)}` (the latest run that passed every section), as the check "
            "printed them:", ""]
    import report_sections_gpu  # its helpers come from here
    return out + table(["section", "what", "measured", "predicted"], figures) + report_sections_gpu.realpipe_block(
        res, names)


def traces_block(res, names, src):
    """gpu_memory_traces.py: activation peaks per rank on the GPU, measured against the simulator."""
    rows = []
    for n in names:
        for case in res[n]:
            meas, pred = case["peak_activation_bytes_measured"], case["peak_activation_bytes_predicted"]
            devs = " / ".join(pct(100.0 * (m / p - 1.0)) for m, p in zip(meas, pred))
            rows.append([label(n), case["schedule"], f"{case['pipeline_parallel_size']}",
                         " / ".join(num(m / 2 ** 20, 1) for m in meas),
                         " / ".join(num(p / 2 ** 20, 1) for p in pred), devs,
                         "yes" if case["passed"] else "no"])
    head = ["run", "schedule", "PP", "measured peak MiB per rank", "simulated MiB", "measured vs simulated",
            "exact"]
    return provenance(src, names) + table(head, rows)


def fidelity_block(res, names, src):
    """bench_runtime_fidelity.py: sleeping passes on real gloo processes against the simulator."""
    rows = []
    for n in names:
        s, hop = res[n]["summary"], res[n].get("hop_s", {})
        hops = " / ".join(f"P={p}: {num(1e3 * hop[p], 2)}" for p in sorted(hop, key=int, reverse=True))
        rows.append([label(n), src(n)[1], str(s["cases"]), str(s["errors"]),
                     f"{s['within_5pct']} of {s['cases']}", num(s["median_abs_error_pct"], 1),
                     num(s["max_abs_error_pct"], 1), num(s["max_abs_error_with_hop_pct"], 1), hops or "-"])
    head = ["run", "machine", "cases", "errors", "within 5%", "median abs error %", "max abs error %",
            "max with measured hop %", "hop ms"]
    out = provenance(src, names) + table(head, rows)
    key = (4, 8, "F=B=W=20")
    speed = {}
    for n in names:
        for r in res[n]["rows"]:
            if (r["p"], r["m"], r["costs"]) == key:
                tag = r["schedule"] + (f" x{r['chunks']} chunks" if r.get("chunks") else "")
                speed.setdefault(tag, {"sim": r["speedup_simulated"]})[n] = r["speedup_measured"]
    srows = [[t, times(v["sim"])] + [times(v.get(n)) for n in names] for t, v in speed.items()]
    out += ["", "Speed-up over 1F1B at P=4 M=8, F=B=W=20 ms (per iteration; the simulator's, then each "
            "run's measured):", ""]
    return out + table(["schedule", "simulated"] + [f"measured, {label(n)}" for n in names], srows)


def iterations_block(res, names, src):
    """bench_runtime_fidelity.py --iteration-model: synchronous against post-validated iterations."""
    rows = []
    for n in names:
        for r in res[n]["rows"]:
            rows.append([r["schedule"], str(r["p"]), str(r["m"]), r["costs"],
                         num(1e3 * r["simulated_sync_s"], 1), num(1e3 * r["measured_sync_s"], 1),
                         pct(r["error_sync_pct"]), num(1e3 * r["simulated_post_s"], 1),
                         num(1e3 * r["measured_post_s"], 1), pct(r["error_post_pct"]),
                         num(1e3 * r["validation_wait_s"], 2)])
    head = ["schedule", "P", "M", "costs (ms)", "sync simulated ms", "sync measured ms", "error",
            "post-validated simulated ms", "measured ms", "error", "wait ms"]
    note = ("Steady-state time per iteration (median over the timed iterations); `wait`: the worst rank's "
            "mean wait at its validation point.")
    return provenance(src, names) + [note, ""] + table(head, rows)


def schedules_block(res, names, src):
    """bench_schedules.py: every schedule on the settings of docs/schedules.md, and the searches' speed."""
    d = res[names[0]]
    titles = [s["title"] for s in d["settings"]]
    cells = {}
    for s in d["settings"]:
        for r in s["rows"]:
            value = f"{times(r['speedup_vs_1f1b'])} ({r['peak_memory']:g})"
            cells.setdefault(r["schedule"], {})[s["title"]] = value
    rows = [[sc] + [v.get(t, "-") for t in titles] for sc, v in cells.items()]
    out = provenance(src, names) + ["Speed-up per training iteration over 1F1B (synchronous optimizer step), "
                                    "with the peak activation per rank in parentheses (x one microbatch's stage "
                                    "activation; 1F1B: P).", ""]
    out += table(["schedule"] + titles, rows)
    speed = [[r["schedule"], str(r["p"]), str(r["m"]), num(r["cpu_seconds"], 2), num(r["bubble_rate"], 3),
              num(r["gap_to_lower_bound"], 3)] for r in d["speed"]]
    out += ["", "How long the automatic schedulers take (CPU seconds of one process):", ""]
    out += table(["schedule", "P", "M", "CPU s", "bubble", "gap to lower bound"], speed)
    limits, sweep = [], {}
    for r in d["sweep"]:
        limits += [r["limit"]] if r["limit"] not in limits else []
        sweep.setdefault(r["title"], {})[r["limit"]] = f"{num(r['bubble_rate'], 3)} ({r['peak_memory']:g})"
    sweep_titles = list(sweep)
    out += ["", "v-auto's bubble (peak) against its memory limit; 1F1B: "
            + ", ".join(f"{num(r['bubble_1f1b'], 3)} ({r['title']})" for r in _firsts(d["sweep"])) + ":", ""]
    out += table(["memory limit"] + sweep_titles,
                 [[num(lim, 2)] + [sweep[t].get(lim, "-") for t in sweep_titles] for lim in limits])
    t5 = [[r["title"], f"{r['limit_x_p']:g}", num(r["bubble_rate"], 3), num(r["paper"], 3),
           num(r["gap_to_lower_bound"], 3)] for r in d["table5"]]
    out += ["", "zb-auto on the ZB paper's Table-5 settings:", ""]
    return out + table(["setting", "limit (x P)", "bubble", "paper", "gap to lower bound"], t5)


def _firsts(rows):
    """The first row of each title, in order."""
    seen = {}
    for r in rows:
        seen.setdefault(r["title"], r)
    return list(seen.values())


def simulator_block(res, names, src):
    """bench_simulator.py: generate, simulate and validate big schedules."""
    rows = [[r["schedule"], str(r["p"]), str(r["m"]), str(r["v"]), str(r["passes"]), num(r["generate_s"], 3),
             num(r["simulate_s"], 3), num(r["validate_s"], 3)] for n in names for r in res[n]["rows"]]
    head = ["schedule", "P", "M", "chunks", "passes", "generate s", "simulate s", "validate s"]
    return provenance(src, names) + table(head, rows)


def _beats(row, variant):
    full, other = row["full"], row[variant]
    if other[0] > full[0] * (1 + 1e-9):
        return "slower"
    if other[0] < full[0] * (1 - 1e-9):
        return "faster"
    return "leaner" if other[1] < full[1] else "same"


def v_families_block(res, names, src):
    """bench_v_families.py: the V search with a building-block family left out, against the full search."""
    d = res[names[0]]
    groups = {}
    for r in d["rows"]:
        for variant in (v for v in r if v in d["variants"] and v != "full"):
            g = groups.setdefault((r["p"], r["limit"] / r["p"], variant), {"n": 0, "full_s": 0.0, "s": 0.0})
            verdict = _beats(r, variant)
            g["n"] += 1
            g[verdict] = g.get(verdict, 0) + 1
            g["full_s"] += r["full"][2]
            g["s"] += r[variant][2]
    rows = [[str(p), f"{lim:g} x P", v, str(g["n"]), str(g.get("slower", 0)), str(g.get("faster", 0)),
             str(g.get("leaner", 0)), num(g["full_s"], 1), num(g["s"], 1)]
            for (p, lim, v), g in sorted(groups.items())]
    head = ["P", "memory limit", "without", "settings", "slower than full", "faster", "leaner",
            "CPU s full", "CPU s without"]
    note = ("`none`: no building-block family; `novs`: without the unit-slot blocks; `novb`: without the "
            "real-cost blocks. `leaner`: as fast as the full search with a lower peak.")
    return provenance(src, names) + [note, ""] + table(head, rows)


def vs_authors_block(res, names, src):
    """bench_vs_authors.py: our automatic schedulers against the ZB authors' public ones."""
    d = res[names[0]]
    kinds = ["worse", "tie, less memory", "equal", "better", "theirs: none"]
    rows = []
    for part in d.values():
        for lim, c in sorted(part["by_limit"].items(), key=lambda kv: float(kv[0])):
            rows.append([part["schedule"], f"{float(lim):g} x P"] + [str(c.get(k, 0)) for k in kinds])
        rows.append([part["schedule"], "all"] + [f"**{part['counts'].get(k, 0)}**" for k in kinds])
    note = ("Settings by the makespan of ours against the authors' best schedule under the same memory "
            "limit (x P x M_B), both timed by our simulator.")
    return provenance(src, names) + [note, ""] + table(["ours", "memory limit"] + kinds, rows)


def bitpipe_authors_block(res, names, src):
    """bench_bitpipe_authors.py: our bitpipe against the BitPipe authors' own order."""
    d = res[names[0]]
    c = d["counts"]
    rows = [[str(len(d["rows"])), str(c.get("worse", 0)), str(c.get("equal", 0)), str(c.get("better", 0))]]
    return provenance(src, names) + table(["settings", "ours slower", "equal", "ours faster"], rows)


SECTIONS = (
    ("Split backward: F, B and W per layer",
     "Whether splitting a layer's backward into B and W costs anything against Megatron's fused backward.",
     (("split_overhead*.json|fbw_*.json", split_block),)),
    ("GPU check",
     "`benchmarks/gpu_check.py`: every figure only a GPU gives, each section in its own process and budget.",
     (("gpu_check*/run*_gpu_check.json", gpu_runs_block), ("gpu_check*/memory_traces*.json", traces_block))),
    ("Runtime fidelity",
     "Compute replaced by sleeps of given F/B/W, real gloo processes and p2p: measured against the simulator.",
     (("runtime_fidelity*.json", fidelity_block), ("runtime_fidelity_iterations.json", iterations_block))),
    ("Schedules and simulator speed",
     "Simulated; costs per whole stage, peak activation per rank in units of one microbatch's stage activation.",
     (("schedules.json", schedules_block), ("simulator.json", simulator_block))),
    ("V search: building-block families",
     "What each family of the V search is worth on the authors' grid.",
     (("v_families.json", v_families_block),)),
    ("Against the authors' schedulers",
     "Their public code run on the same settings, their schedules timed by our simulator.",
     (("vs_authors.json", vs_authors_block), ("bitpipe_vs_authors.json", bitpipe_authors_block))),
)
