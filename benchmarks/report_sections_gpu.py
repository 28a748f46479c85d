"""The GPU check's realpipe table on ``docs/results.md`` (``report_sections.gpu_runs_block`` appends it
under the GPU check's runs): a real pipeline on one GPU, P ranks as processes each in a green context
of 1/P of the SMs, every schedule's time per iteration and allocator peak beside the simulator's
prediction from that run's own profile (``benchmarks/gpu_check_realpipe.py`` writes the figures).

Shown from the latest run (by run number) whose realpipe section measured at least one case, whatever
its status (a case skipped for time or an error is a row that says so). Pure Python, standard library;
a figure missing prints ``n/a``."""
from __future__ import annotations

from report_sections import label, ms, num, pct, run_number, table, times


def _measured(run) -> bool:
    return any(c.get("measured_s") for c in run.get("cases", []))


def latest_realpipe(res, names):
    """(name, its realpipe section) of the latest run with a measured realpipe case, or (None, None)."""
    found = (None, None)
    for n in sorted(names, key=lambda n: (n.rsplit("/", 1)[0], run_number(n), n)):
        sec = res[n]["sections"].get("realpipe")
        if sec and any(_measured(r) for r in (sec.get("figures") or {}).get("runs", [])):
            found = (n, sec)
    return found


def _gib_max(xs):
    vals = [x for x in (xs or []) if x is not None]
    return num(max(vals) / 2 ** 30, 2) if vals else "n/a"


def _green(run) -> str:
    g, pr, p = run.get("green"), run.get("probe") or {}, run["p"]
    share = f"{g['num_sms']} of {g['total_sms']} SMs per rank" if g else "no green context"
    conc = pr.get("concurrency")
    return (f"P={p}: {share}; ranks at once against one at a time: concurrency {num(conc, 2)} of {p} "
            f"({p}: a real pipeline, 1: the ranks took turns); a matmul in the share at "
            f"{times(pr.get('share_speed'))} the whole GPU's speed; backward against forward "
            f"{times(pr.get('backward_ratio'))}")


def realpipe_block(res, names):
    """Markdown lines for the latest realpipe figures among the GPU check runs ``names`` (none: [])."""
    name, sec = latest_realpipe(res, names)
    if name is None:
        return []
    out = ["", f"A real pipeline on one GPU (`{label(name)}`, realpipe {sec['status']}): P ranks as processes, "
           "each in a CUDA green context of 1/P of the SMs; time per iteration (the slowest rank's, median of "
           "the timed iterations) and the CUDA allocator's peak above the iteration's start (the fullest rank), "
           "against the simulator fed by the same run's profile (its activations only). Speed-ups over "
           "Megatron's own 1F1B.", ""]
    rows = []
    for run in sec["figures"]["runs"]:
        out.append(f"- {_green(run)}" + (f"; launch: {run['error']}" if run.get("error") else ""))
        for c in run.get("cases", []):
            head = [str(run["p"]), str(run["m"]), c["case"]]
            if c.get("skipped"):
                rows.append(head + [f"skipped: {c['skipped']}"] + ["-"] * 7)
                continue
            rows.append(head + [ms(c.get("measured_s")), ms(c.get("simulated_s")), pct(c.get("error_pct")),
                                times(c.get("speedup_measured")), times(c.get("speedup_simulated")),
                                _gib_max(c.get("peak_bytes")), _gib_max(c.get("predicted_peak_bytes"))])
    head = ["P", "M", "schedule", "measured ms", "simulated ms", "error", "x 1F1B measured", "x 1F1B simulated",
            "peak GiB", "simulated activations GiB"]
    return out + [""] + table(head, rows)
