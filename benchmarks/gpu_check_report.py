"""The GPU check's short report (``benchmarks/gpu_check.py``): one line per section as it ends, and
the markdown table written beside the JSON. Each section's record holds ``rows`` of
``{"what", "measured", "predicted"}`` (text, ready to print); a section without rows shows its plan
or its error. No torch."""
from __future__ import annotations

__all__ = ["one_line", "markdown", "gib", "ms", "pct"]

MARK = {"ok": "ok", "dry-run": "dry-run", "failed": "FAILED", "error": "ERROR", "timeout": "TIMEOUT",
        "skipped": "skipped"}


def gib(x) -> str:
    return "-" if x is None else f"{x / 2 ** 30:.2f} GiB"


def ms(x) -> str:
    return "-" if x is None else f"{1e3 * x:.2f} ms"


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def one_line(name: str, rec: dict) -> str:
    status = MARK.get(rec.get("status"), rec.get("status"))
    tail = f": {rec['error']}" if rec.get("error") else ""
    problems = rec.get("problems") or []
    if problems:
        tail += f": {problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
    return f"[gpu check] {name:<10} {status:<8} {rec.get('wall_s', 0):6.1f} s of {rec.get('budget_s', 0):.0f}{tail}"


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(report: dict) -> str:
    env = (report.get("sections", {}).get("env") or {}).get("figures") or {}
    where = ", ".join(x for x in (env.get("gpu") or ("no GPU" if env else ""), env.get("torch") and f"torch {env['torch']}",
                                  env.get("megatron_core") and f"megatron-core {env['megatron_core']}") if x)
    mode = "dry run (CPU; plans and predictions, no GPU figures)" if report.get("dry_run") else \
        ("tiny CPU run (no figures worth keeping)" if report.get("tiny") else "GPU run")
    lines = [f"# GPU check: {mode}", "",
             f"{where or 'machine unknown'}; started {report.get('started')}, {report.get('wall_s')} s of a "
             f"{report.get('budget_s'):g} s budget; every figure in `gpu_check.json`, every section's output in "
             f"`gpu_check.log`. Command: `{report.get('command')}`", "",
             "| section | status | s | what | measured | predicted (simulator / plan) |",
             "|---|---|---|---|---|---|"]
    for name, rec in report.get("sections", {}).items():
        status = MARK.get(rec.get("status"), rec.get("status"))
        rows = rec.get("rows") or []
        if rec.get("error"):
            rows = rows + [{"what": "error", "measured": rec["error"], "predicted": ""}]
        for p in rec.get("problems") or []:
            rows = rows + [{"what": "problem", "measured": p, "predicted": ""}]
        if not rows:
            rows = [{"what": "plan", "measured": "; ".join(f"{k}: {v}" for k, v in (rec.get("plan") or {}).items())[:300],
                     "predicted": ""}]
        for i, r in enumerate(rows):
            head = (f"{name} | {status} | {rec.get('wall_s', '')}" if i == 0 else " | | ")
            lines.append(f"| {head} | {_cell(r.get('what', ''))} | {_cell(r.get('measured', ''))} | "
                         f"{_cell(r.get('predicted', ''))} |")
    lines.append("")
    lines.append("Overall: " + ("every section passed" if report.get("ok") else "NOT every section passed")
                 + (" (interrupted)" if report.get("interrupted") else "") + ".")
    return "\n".join(lines) + "\n"
