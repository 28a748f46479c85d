"""`megatron-zb plan`: FLOP and memory model, ranking, profile input, errors."""
import json
import os

import pytest

from megatron_zb.cli import main
from megatron_zb.core import plan as P
from megatron_zb.core.ir import ScheduleError

ARGS = ["plan", "--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
        "--pipeline-parallel-size", "4", "--num-microbatches", "16"]


def test_formulas():
    spec = P.ModelSpec(num_layers=4, hidden_size=1024, num_attention_heads=16, seq_length=512, micro_batch_size=2)
    f, b, w = spec.layer_flops()
    s, h, bb = 512, 1024, 2
    assert f == bb * s * h * (24 * h + 4 * s) and b == bb * s * h * (24 * h + 8 * s) and w == 24 * bb * s * h * h
    m_b, m_w = P.ModelSpec(4, 1024, 16, 512, 2, flash_attention=False).layer_activation_bytes()
    assert m_b == s * bb * (34 * h + 5 * 16 * s) and m_w == 32 * s * bb * h
    assert P.layer_split(14, 4, pad_ends=True) == [3, 4, 4, 3]


def test_plan_table_and_json(capsys):
    assert main(ARGS + ["--gpu-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "zb-v" in out and "--zero-bubble-schedule" in out
    lines = out.splitlines()
    head = next(i for i, l in enumerate(lines) if "schedule" in l and "iteration ms" in l)
    assert all(w in lines[head] for w in ("bubble", "vs 1f1b", "act GiB", "peak GiB", "fits"))
    assert all(w in lines[head + 1] for w in ("sync", "postval", "min", "max", "on rank"))
    # one ready-to-paste line for the best schedule that fits, then the others aligned
    i = next(i for i, l in enumerate(lines) if l.startswith("suggested flags ("))
    assert lines[i + 1].strip().startswith("--pipeline-model-parallel-size 4 --zero-bubble-schedule ")
    j = next((k for k, l in enumerate(lines) if l.startswith("within Megatron 1F1B's memory")), len(lines))
    assert len({l.index("--pipeline") for l in lines[i + 3:j] if "--pipeline" in l}) == 1, lines[i:j]
    if j < len(lines):  # the fastest that fits needs more than 1F1B: the fastest that needs no more, and its flags
        assert lines[j + 1].strip().startswith("--pipeline-model-parallel-size 4 --zero-bubble-schedule ")
    assert main(ARGS + ["--gpu-memory-gb", "80", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    w = d["within_1f1b_memory"]
    assert (w is None) == (j == len(lines))
    if w is not None:
        base = next(r for r in d["rows"] if r["schedule"] == "1f1b" and not r.get("vocab_parallel"))
        assert max(w["peak_bytes"]) <= max(base["peak_bytes"]) and w["throughput_vs_1f1b"] >= 1.0
    for r in (r for r in d["rows"] if r.get("memory_limit_microbatches")):  # the limit's unit is said
        assert f"--zero-bubble-memory-limit {r['memory_limit_microbatches']:g}" in r["flags"]
        assert f"{r['memory_limit_microbatches']:g} x {r['activation_unit_bytes'] / 1024 ** 3:.2f} GiB" in out
    rows = [r for r in d["rows"] if "error" not in r]
    assert rows[0]["fits"] and rows[0]["throughput_vs_1f1b"] >= 1.0
    by = {r["schedule"]: r for r in rows}
    assert max(by["zb-h2"]["activation_bytes"]) > max(by["zb-h1"]["activation_bytes"])
    assert by["1f1b"]["throughput_vs_1f1b"] == 1.0
    assert by["zb-h1"]["bubble_rate"] < by["1f1b"]["bubble_rate"]


def test_small_budget_marks_what_does_not_fit(capsys):
    assert main(ARGS + ["--gpu-memory-gb", "3", "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out)["rows"] if "error" not in r]
    assert any(not r["fits"] for r in rows)
    assert all(r["fits"] for r in rows[: sum(r["fits"] for r in rows)])  # fitting ones first


def test_no_room_for_activations_says_why_without_searching(capsys):
    """Model states over the GPU's memory on a rank, or leaving less than one microbatch's
    activations: zb-auto and v-auto have no room to search under; their rows say so (which rank,
    its states or room, the budget) instead of searching for the least memory that works (seconds
    at P=16 for Llama-3-70B); the other rows are there, not fitting."""
    assert main(ARGS + ["--gpu-memory-gb", "1", "--json", "--no-vocab-parallel"]) == 0
    rows = {r["schedule"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    for name in ("zb-auto", "v-auto"):
        assert "no room for activations under --gpu-memory-gb: rank " in rows[name]["error"]
        assert "GiB of its 1 GiB" in rows[name]["error"]
    assert not rows["1f1b"]["fits"] and not rows["zb-v"]["fits"]
    # some room, less than one microbatch's activations: no schedule holds less, so none is searched
    assert main(ARGS + ["--gpu-memory-gb", "4.6", "--json", "--no-vocab-parallel"]) == 0
    rows = {r["schedule"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    for name in ("zb-auto", "v-auto"):
        assert "GiB left beside rank " in rows[name]["error"] and "one microbatch's activations take" in rows[name]["error"]


def test_profile_costs(tmp_path, capsys):
    prof = {"cost_f": [1.0, 1, 1, 1.5], "cost_b": [1.0, 1, 1, 2], "cost_w": 0.8, "cost_comm": 0.01}
    f = tmp_path / "profile.json"
    f.write_text(json.dumps(prof))
    assert main(ARGS + ["--profile", str(f), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["costs_from"] == "profile"
    one = next(r for r in d["rows"] if r["schedule"] == "1f1b")
    assert one["makespan_s"] == pytest.approx(16 * 4.5 + 3 * (4.5) + 6 * 0.01, rel=0.2)


def test_profile_memory_is_the_measured_one(tmp_path, capsys):
    """plan --profile plans with a run's measured bytes per F and held until W (a profile window
    writes them), not the formula's: 1F1B's rank r holds P - r microbatches of its own mem-f."""
    mem_f = [3e9, 2e9, 2e9, 2.5e9]
    prof = {"cost_f": 1.0, "cost_b": 1.0, "cost_w": 1.0, "mem_f": mem_f, "mem_w": [1e9] * 4}
    f = tmp_path / "profile.json"
    f.write_text(json.dumps(prof))
    assert main(ARGS + ["--profile", str(f), "--json"]) == 0
    rows = {r["schedule"]: r for r in json.loads(capsys.readouterr().out)["rows"] if "error" not in r}
    assert rows["1f1b"]["activation_bytes"] == pytest.approx([(4 - r) * mem_f[r] for r in range(4)])
    # zb-h1: the same F's in flight, plus what deferred W's hold (mem-w): rank 1 holds 3 x 2e9 + 1e9
    assert rows["zb-h1"]["activation_bytes"] == pytest.approx([12e9, 7e9, 6e9, 5.5e9])


def _where(job):
    return os.getpid()


def test_workers_keep_each_job_and_its_family_on_one_worker():
    """plan's worker processes (``plan.Workers``): a job goes back to the worker that ran it (its
    full search goes on from what that worker remembers), the V family of one vocabulary setting
    shares one, the rows are spread over both; the workers end with the object."""
    todo = [(n, v) for n in ("zb-v", "v-auto", "v-half", "1f1b", "zb-h1", "gpipe", "zb-auto") for v in (None, 1)]
    with P.Workers(2) as w:
        first = dict(zip(todo, w.run(_where, todo)))
        later = [("v-auto", 1), ("zb-v", None), ("1f1b", 1), ("v-min", 1)]
        again = dict(zip(later, w.run(_where, later)))
        assert len(set(first.values())) == 2 and os.getpid() not in first.values()
        assert all(again[j] == first[j] for j in later if j in first)
        assert again[("v-min", 1)] == first[("zb-v", 1)]  # a family member seen later joins its family
        for v in (None, 1):
            assert len({first[(n, v)] for n in ("zb-v", "v-auto", "v-half")}) == 1
    for pid in set(first.values()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with P.Workers(1) as w:  # one job, or one process: in this one
        assert w.run(_where, todo[:2]) == [os.getpid()] * 2


def test_jobs_give_the_same_rows(capsys):
    # the schedules generated by 2 processes at once (fork) and in this one: the same rows, same order
    out = {}
    for jobs in ("1", "2"):  # (the even layout only: the rows of either layout are generated alike)
        assert main(ARGS + ["--json", "--jobs", jobs, "--no-layout-search"]) == 0
        out[jobs] = json.loads(capsys.readouterr().out)["rows"]
    assert out["1"] == out["2"]
    assert {r["schedule"] for r in out["1"]} >= {"1f1b", "zb-auto", "v-auto", "zb-v", "v-half"}
    assert main(ARGS + ["--jobs", "0"]) == 2
    assert "--jobs must be an integer >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(ScheduleError, match="jobs must be an integer >= 1"):
        P.plan(P.PlanRequest(P.ModelSpec(16, 2048, 16, 2048), 4, 16, 80), jobs=0)


def test_errors(capsys):
    assert main(["plan", "--num-layers", "4", "--hidden-size", "100", "--num-attention-heads", "3", "--seq-length", "8",
                 "--pipeline-parallel-size", "2", "--num-microbatches", "4"]) == 2
    assert "not divisible" in capsys.readouterr().err
    assert main(ARGS[:-4] + ["--pipeline-parallel-size", "1", "--num-microbatches", "4"]) == 2
    assert ">= 2" in capsys.readouterr().err
    with pytest.raises(ScheduleError, match="lacks cost_b"):
        P.profile_costs({"cost_f": [1, 1]}, 2)


def test_plan_help_documents_every_option_and_column(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = capsys.readouterr().out
    from megatron_zb.cli import build_parser
    plan = build_parser()._subparsers._group_actions[0].choices["plan"]
    for action in plan._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, f"{action.option_strings[0]} has no help text"
    for col in ("iteration ms", "sync", "postval", "bubble", "vs 1f1b", "act GiB", "peak GiB", "fits", "microbatches"):
        assert col in text


def test_moe_and_recompute_in_the_model():
    """MoE: each token through k experts (F/B/W and activations per routed copy), the experts'
    parameters spread over EP; full recompute: F keeps each block's input, B runs the forward
    again, W holds more than F kept; selective recompute: no attention scores kept."""
    base = dict(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=2048, flash_attention=False)
    dense = P.ModelSpec(**base, ffn_hidden_size=4096)
    moe = P.ModelSpec(**base, ffn_hidden_size=4096, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=2048,
                      expert_model_parallel_size=4)
    h, s = 1024, 2048
    # MLP GEMM width per token: dense 4 x 4096; MoE 2 experts x 4 x 2048 plus the router's 2 x 8
    assert moe.layer_flops()[2] - dense.layer_flops()[2] == pytest.approx(s * h * (2 * 4 * 2048 + 16 - 4 * 4096))
    assert moe.params_per_layer() == pytest.approx(4 * h * h + 2 * 2 * h * 2048 + 8 * h + 9 * h)
    (db, dw), (mb, mw) = dense.layer_activation_bytes(), moe.layer_activation_bytes()
    assert mb - db == pytest.approx(2 * s * (2 * h + 2 * 2 * 2048 - 2 * 4096))  # + k dispatched copies, k x 2f
    assert mw - dw == pytest.approx(2 * s * (2 * (2 * h + 2 * 2048) - (2 * h + 2 * 4096)))
    full = P.ModelSpec(**base, recompute="full", recompute_num_layers=2)
    fb, fw = full.layer_activation_bytes()
    assert fb == pytest.approx(2 * s * h / 2) and fw == pytest.approx(P.ModelSpec(**base).layer_activation_bytes()[1])
    assert fw > fb  # W outlives B's recomputed activations
    f, b, w = full.layer_flops()
    f0, b0, _ = P.ModelSpec(**base).layer_flops()
    assert (f, b) == (pytest.approx(f0), pytest.approx(b0 + f0))
    sel = P.ModelSpec(**base, recompute="selective").layer_activation_bytes()[0]
    assert sel == pytest.approx(P.ModelSpec(**{**base, "flash_attention": True}).layer_activation_bytes()[0])
    with pytest.raises(ScheduleError, match="moe-router-topk"):
        P.ModelSpec(**base, num_experts=2, moe_router_topk=3).validate()


def test_plan_takes_moe_and_recompute_flags(capsys):
    # the model's flags, not the layout or vocabulary parallelism, are what this compares (a quarter of the CPU)
    even = ["--no-layout-search", "--no-vocab-parallel"]
    assert main(ARGS + even + ["--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
                               "--moe-ffn-hidden-size", "1024", "--json"]) == 0
    moe = {r["schedule"]: r for r in json.loads(capsys.readouterr().out)["rows"] if "error" not in r}
    assert main(ARGS + even + ["--recompute-granularity", "full", "--json"]) == 0
    full = {r["schedule"]: r for r in json.loads(capsys.readouterr().out)["rows"] if "error" not in r}
    assert main(ARGS + even + ["--json"]) == 0
    dense = {r["schedule"]: r for r in json.loads(capsys.readouterr().out)["rows"] if "error" not in r}
    assert max(full["1f1b"]["activation_bytes"]) < 0.2 * max(dense["1f1b"]["activation_bytes"])
    assert full["1f1b"]["iteration_time_s"] > dense["1f1b"]["iteration_time_s"]  # B runs F again
    # zb-h1 under full recompute: W's holdings dominate what F keeps
    assert max(full["zb-h1"]["activation_bytes"]) > 2 * max(full["1f1b"]["activation_bytes"])
    assert moe["1f1b"]["activation_bytes"] != dense["1f1b"]["activation_bytes"]
    assert main(ARGS + ["--num-experts", "3", "--expert-model-parallel-size", "2"]) == 2


def test_readme_example_suggests_the_least_memory_of_the_equally_fast(capsys):
    """Issue 26: README's example (P=8, M=32, 32 layers, TP=2, SP, 80 GiB): among the rows that fit
    within 0.1% of the fastest, the first (and the suggested flags) needs the least memory, and
    v-auto's --zero-bubble-memory-limit is its real peak, not the GPU's room."""
    spec = P.ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=4096,
                       tensor_parallel_size=2, sequence_parallel=True)
    names = ["v-auto", "zb-v", "dualpipe-v", "zb-auto", "zb-h2", "1f1b"]
    rows = P.plan(P.PlanRequest(spec, 8, 32, 80, schedules=names))
    fit = [r for r in rows if "error" not in r and r["fits"]]
    fastest = min(r["iteration_time_s"] for r in fit)
    ties = [r for r in fit if r["iteration_time_s"] <= fastest * 1.001]
    assert len(ties) >= 2
    assert max(fit[0]["peak_bytes"]) == min(max(r["peak_bytes"]) for r in ties)
    assert fit[:len(ties)] == sorted(ties, key=lambda r: (round(max(r["peak_bytes"]), 0), r["iteration_time_s"]))
    va = next(r for r in rows if r["schedule"] == "v-auto")
    zv = next(r for r in rows if r["schedule"] == "zb-v")
    assert max(va["activation_bytes"]) <= max(zv["activation_bytes"]) + 1  # not 30.9 GiB as before
    need = max(va["activation_bytes"]) / va["activation_unit_bytes"]
    assert va["memory_limit_microbatches"] == pytest.approx(need, abs=0.011)
    assert f"--zero-bubble-memory-limit {va['memory_limit_microbatches']:g}" in va["flags"]


def test_within_1f1b_memory_picks_the_fastest_row_no_larger_than_1f1b():
    G = 1024 ** 3

    def r(name, t, peak, vocab=None, fits=True):
        return {"schedule": name, "iteration_time_s": t, "ranked_by": "iteration_time_s", "peak_bytes": [peak * G, 1.0],
                "fits": fits, "vocab_parallel": vocab, "flags": f"--zero-bubble-schedule {name}", "bubble_rate": 0.1}
    rows = [r("zb-v", 1.0, 40, vocab=1), r("v-auto", 1.1, 39), r("zb-h1", 1.3, 37), r("1f1b", 1.5, 37.4),
            r("1f1b", 1.4, 36, vocab=1), r("gpipe", 0.9, 30, fits=False)]
    asked = []

    def replan(gib, names):
        asked.append((round(gib, 3), names))
        return [r("v-auto", 1.2, 37.4), r("zb-auto", 1.25, 36.0), {"schedule": "zb-auto", "error": "x"}]
    w = P.within_1f1b_memory(rows, replan)
    assert asked == [(37.4, ["v-auto"])]  # the searched schedules again, with 1F1B's peak as the budget
    assert w["schedule"] == "v-auto" and w["iteration_time_s"] == 1.2 and w["budget_gib"] == pytest.approx(37.4)
    assert w["throughput_vs_1f1b"] == pytest.approx(1.5 / 1.2, abs=1e-4)
    # the fastest fitting row already needs no more than 1F1B: nothing to add, no search
    assert P.within_1f1b_memory([r("zb-h1", 1.3, 37), r("1f1b", 1.5, 37.4)], replan) is None
    assert P.within_1f1b_memory([r("zb-v", 1.0, 40)], replan) is None  # no 1F1B row: nothing to compare with
    assert len(asked) == 1


def test_quick_search_keeps_the_full_search_leading_rows():
    """Issue 32 item 6: plan searches the searched schedules (and places the vocabulary passes)
    quickly first and in full only the rows within ``FULL_MARGIN`` of the leader where the full
    search adds building blocks (``P.margin``); the others stay quick and say so. The leading row is
    within 0.6% of the leader with every row searched in full (at most what the full search gained
    on seven plans where it adds no block)."""
    spec = P.ModelSpec(**__import__("megatron_zb.core.costs.models", fromlist=["x"]).spec_kwargs("llama-3.2-1b",
                                                                                          seq_length=1024))
    req = P.PlanRequest(spec, 4, 8, 80, schedules=["1f1b", "zb-h1", "zb-v", "v-half", "v-min", "v-auto", "dualpipe-v"],
                        vocab=P.VocabLever("both"))
    quick = [r for r in P.plan(req) if "error" not in r]
    full = [r for r in P.plan(req.replace(search="full")) if "error" not in r]
    assert all(r.get("search_effort", "full") == "full" for r in full)
    top = quick[0]["iteration_time_s"]
    for r in quick:
        if P.margin(r, 4, 8) is not None and r["iteration_time_s"] <= top * (1 + P.margin(r, 4, 8)):
            assert r.get("search_effort", "full") == "full"
        assert r.get("search_effort") in ((None,) if r["schedule"] in ("1f1b", "zb-h1", "dualpipe-v") and
                                          not r.get("vocab_parallel") else ("quick", "full"))
    assert quick[0]["iteration_time_s"] <= full[0]["iteration_time_s"] * 1.006
    with pytest.raises(ScheduleError, match="search is one of"):
        P.plan(req.replace(search="fast"))


def test_within_1f1b_memory_searches_a_quick_choice_in_full():
    G = 1024 ** 3

    def r(name, t, peak, effort=None):
        out = {"schedule": name, "iteration_time_s": t, "ranked_by": "iteration_time_s", "peak_bytes": [peak * G],
               "fits": True, "flags": "", "bubble_rate": 0.1}
        if effort:
            out["search_effort"] = effort
        return out
    rows = [r("zb-v", 1.0, 40, "full"), r("v-half", 1.1, 30, "quick"), r("v-auto", 1.12, 39, "full"),
            r("1f1b", 1.5, 37.4)]
    asked = []

    def full(row, gib):
        asked.append((row["schedule"], gib))
        return r(row["schedule"], 1.3, 31, "full")  # slower in full: v-auto's replanned row wins
    w = P.within_1f1b_memory(rows, lambda gib, names: [r("v-auto", 1.2, 37, "full")], full)
    assert asked == [("v-half", None)] and w["schedule"] == "v-auto" and w["iteration_time_s"] == 1.2


@pytest.mark.parametrize("p", range(2, 10))
def test_plan_answers_at_every_pipeline_size(p, capsys):
    """The first command a user runs: a public model at any pipeline size from 2 to 9. A schedule that
    cannot run the setting (bitpipe at an odd size) gets its row with the reason; every other
    schedule is planned, and a row is suggested."""
    from megatron_zb.core.schedules import names
    assert main(["plan", "--model", "llama-3.2-1b", "--pipeline-parallel-size", str(p),
                 "--num-microbatches", str(p), "--jobs", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    errors = {r["schedule"]: r["error"] for r in rows if "error" in r}
    planned = {r["schedule"] for r in rows if "error" not in r}
    assert planned | set(errors) == set(names())
    assert set(errors) <= {"bitpipe"}, errors
    # bitpipe: planned at an even size (its row with vocabulary parallelism says why not), refused at an odd one
    assert ("bitpipe" in planned) == (p % 2 == 0)
    if "bitpipe" in errors:
        assert ("even number of ranks" if p % 2 else "not with replicated stages") in errors["bitpipe"]
    assert rows[0]["fits"] and "error" not in rows[0]


def test_plan_schedules_restricts_the_rows(capsys):
    """--schedules ranks those (1f1b always, the reference of 'vs 1f1b'); an unknown name: one line."""
    assert main(["plan", "--model", "llama-3.2-1b", "--pipeline-parallel-size", "3", "--num-microbatches", "6",
                 "--schedules", "zb-v", "bitpipe", "--jobs", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {r["schedule"] for r in rows} == {"zb-v", "bitpipe", "1f1b"}
    assert [r["schedule"] for r in rows if "error" in r] == ["bitpipe"]
    assert main(["plan", "--model", "llama-3.2-1b", "--pipeline-parallel-size", "3", "--num-microbatches", "6",
                 "--schedules", "zb-x"]) == 2
    assert "unknown schedule 'zb-x'" in capsys.readouterr().err


def test_the_split_backwards_cost_changes_the_ranking_at_h2048(capsys):
    """At h2048 s2048 a split backward's fixed per-layer cost (the GPU figures: 0.4 ms) is a large share
    of a layer: with it, schedules that run fused backwards overtake zb-v, and each row says what its
    split costs it; without it (0) the ranking is the free split's."""
    args = ["plan", "--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length",
            "2048", "--pipeline-parallel-size", "4", "--num-microbatches", "16", "--no-vocab-parallel", "--jobs", "1",
            "--schedules", "zb-v", "interleaved-1f1b", "--json"]
    order = {}
    for ms in ("0", "0.4"):
        assert main(args + ["--split-overhead-ms", ms]) == 0
        rows = [r for r in json.loads(capsys.readouterr().out)["rows"] if "error" not in r]
        order[ms] = [r["schedule"] for r in rows]
        by = {r["schedule"]: r for r in rows}
        if ms == "0":
            assert all("split_cost_s" not in r for r in rows)
        else:
            assert by["zb-v"]["split_cost_s"] > 0 and by["1f1b"]["split_cost_s"] == 0
            assert "--zero-bubble-split-overhead-ms 0.4" in by["zb-v"]["flags"]
            assert "--zero-bubble-split-overhead-ms" not in by["1f1b"]["flags"]
    assert order["0"].index("zb-v") < order["0"].index("interleaved-1f1b")
    assert order["0.4"].index("zb-v") > order["0.4"].index("interleaved-1f1b")
