"""The correctness harness: the rank launcher, ``run_verify`` and ``megatron-zb verify``.

Pipelined runs use megatron's own schedules (pseudo-schedules ``megatron-1f1b`` and
``megatron-interleaved``) and the harness's naive ``sequential`` executor (any placement, V
included), so the harness is proven independently of megatron-zb's schedules. Each group of
cases shares one launch (process start + megatron import once). A known megatron bug (PP=2 +
interleaving + batched p2p) is the negative control: the harness must fail it.
"""
from __future__ import annotations

import json
import math
import sys
import time

import pytest

from megatron_zb import verify as V
from megatron_zb.verify.processes import launch as L
from tests import _harness_fns as H
from tests._host import overload


# -- launcher ----------------------------------------------------------------------------------

@pytest.mark.dist
@pytest.mark.timing
def test_launch_results_per_rank_and_cases():
    res = L.run_cases(H.allreduce_rank, [{"add": 0}, {"add": 10}], 3, L.LaunchOptions(cpu_shims=False, timeout=120))
    assert [[r["rank"] for r in case] for case in res] == [[0, 1, 2], [0, 1, 2]]
    assert [r["pid"] for r in res[0]] == [r["pid"] for r in res[1]]  # one launch runs every case
    assert [case[0]["sum"] for case in res] == [3.0, 33.0]
    assert all(r["world"] == 3 and r["threads"] == 1 for case in res for r in case)
    assert str(res[0][2]["tensor"].dtype) == "torch.bfloat16" and res[0][2]["tensor"].tolist() == [0.0, 2.0, 4.0]
    assert L.launch(H.sleep_then_return, 2, 0.01, options=L.LaunchOptions(cpu_shims=False)) == [0.01, 0.01]


@pytest.mark.dist
def test_launch_reraises_rank_exception_with_its_traceback():
    with pytest.raises(L.RankError) as ei:
        L.run_cases(H.raise_on_rank1_in_case1, [0, 1, 2], 2, L.LaunchOptions(cpu_shims=False, timeout=120))
    e = ei.value
    assert e.rank == 1 and e.case == 1 and e.exc_type == "ValueError"
    assert "boom from rank one" in str(e) and "raise_on_rank1_in_case1" in e.rank_traceback


@pytest.mark.dist
@pytest.mark.timing
def test_launch_reports_a_failure_before_the_ranks_start(monkeypatch):
    # a function the ranks cannot import (its module exists only in this process): every rank
    # reports the error; nothing hangs
    import types
    mod = types.ModuleType("mzb_only_in_the_parent")
    exec("def fn(case):\n    return case\n", mod.__dict__)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    with pytest.raises(L.RankError) as ei:  # not a LaunchTimeout: nothing hung until the 60 s timeout
        L.run_cases(mod.fn, [0], 2, L.LaunchOptions(cpu_shims=False, timeout=60))
    assert ei.value.exc_type == "ModuleNotFoundError" and "before the rank started" in str(ei.value)
    assert "rank 1 also failed" in str(ei.value)


@pytest.mark.dist
@pytest.mark.timing
def test_launch_timeout_names_the_stuck_rank_and_its_status():
    # the ranks must reach the hang before the timeout: 5 s on a quiet host, longer on a busy one
    # (at load 30 the ranks' start took longer than 5 s once: no status to name yet)
    timeout = 5 * min(overload(), 8)
    t = time.time()
    with pytest.raises(L.LaunchTimeout) as ei:
        L.run_cases(H.hang_on_rank1, [None], 2, L.LaunchOptions(cpu_shims=False, timeout=timeout))
    e = ei.value
    assert time.time() - t < 40 * overload()  # killed, not hung (slack for a busy host)
    assert 1 in e.ranks
    assert e.statuses[1] == "waiting RECV_F stage 1 mb 0 from rank 0"
    assert "rank 1: last status: waiting RECV_F stage 1 mb 0 from rank 0" in str(e)
    assert "hang_on_rank1" in e.logs[1]  # faulthandler's stack dump of the stuck rank


def test_resolve_mcore_path(monkeypatch, tmp_path):
    monkeypatch.delenv("MZB_MCORE_PATH", raising=False)
    monkeypatch.setenv("MZB_MCORE", "installed")
    assert L.resolve_mcore_path() is None
    monkeypatch.setenv("MZB_MCORE", "0.0.0-missing")
    with pytest.raises(L.LaunchError, match="no megatron/core"):
        L.resolve_mcore_path()
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    assert L.resolve_mcore_path(str(tmp_path)) == str(tmp_path)


# -- input validation --------------------------------------------------------------------------

@pytest.mark.parametrize("args, kw, msg", [
    (("megatron-1f1b", 1), {}, ">= 2"),
    (("megatron-1f1b", 0), {}, "integer >= 1"),
    (("megatron-interleaved", 2), {"num_microbatches": 3}, "divisible"),
    (("no-such-schedule", 2), {}, "unknown schedule"),
    (("megatron-1f1b", 2), {"sequence_parallel": True}, "tensor-parallel"),
    (("megatron-1f1b", 2), {"num_layers": 3}, "cannot be split"),
    (("sequential", 2), {"placement": "zigzag"}, "placement"),
    (("megatron-1f1b", 2), {"bogus_option": 1}, "unknown verify option"),
    (("zb-h1", 1), {}, "has no pipeline: schedule zb-h1 would not run"),
    (("zb-v", 1), {}, "has no pipeline: schedule zb-v would not run"),
])
def test_make_case_rejects_bad_input(args, kw, msg):
    with pytest.raises(V.VerifyUsageError, match=msg):
        V.make_case(*args, **kw)


def test_make_case_defaults():
    c = V.make_case("megatron-interleaved", 4)
    assert (c.placement, c.chunks, c.num_layers, c.num_microbatches) == ("looped", 2, 8, 8)
    c = V.make_case("sequential", 2, placement="v")
    assert (c.chunks, c.num_layers, c.world_size) == (2, 4, 2)
    c = V.make_case("zb-h1", 4, 2)  # a core schedule: placement from the schedule core
    assert (c.placement, c.chunks, c.world_size) == ("single", 1, 8)


@pytest.mark.parametrize("argv", [
    [],
    ["--schedule", "megatron-1f1b"],
    ["--schedule", "megatron-1f1b", "-p", "0"],
    ["--schedule", "megatron-1f1b", "-p", "two"],
    ["--schedule", "nope", "-p", "2"],
    ["--schedule", "megatron-1f1b", "-p", "2", "--placement", "v"],
    ["--schedule", "megatron-1f1b", "-p", "2", "--mcore-path", "/nonexistent"],
    ["--schedule", "megatron-1f1b", "-p", "2", "--sequence-parallel"],
    ["--schedule", "zb-h1", "-p", "1"],
    ["--schedule", "zb-v", "-p", "1"],
])
def test_cli_bad_input_exit_2_one_line(argv, capsys):
    assert V.main_verify(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err


# -- PP=2: megatron's schedules and the sequential executor, one launch --------------------------

PP2 = {
    "1f1b": dict(schedule="megatron-1f1b"),
    "1f1b-no-ddp": dict(schedule="megatron-1f1b", ddp=False),
    "1f1b-overlap-grad-reduce": dict(schedule="megatron-1f1b", overlap_grad_reduce=True),
    "1f1b-forward-only": dict(schedule="megatron-1f1b", forward_only=True),
    "1f1b-variable-seq": dict(schedule="megatron-1f1b", variable_seq_lengths=True),
    "1f1b-grad-acc-fusion": dict(schedule="megatron-1f1b", gradient_accumulation_fusion=True),
    "1f1b-per-token-loss": dict(schedule="megatron-1f1b", config_overrides={"calculate_per_token_loss": True}),
    "1f1b-untied": dict(schedule="megatron-1f1b", tie_embeddings=False),
    "interleaved": dict(schedule="megatron-interleaved", num_microbatches=6),
    "seq-v": dict(schedule="sequential", placement="v"),
    "seq-v-no-ddp-per-token": dict(schedule="sequential", placement="v", ddp=False,
                                   config_overrides={"calculate_per_token_loss": True}),
    "seq-v-uneven": dict(schedule="sequential", placement="v", num_layers=6, allow_padding_num_layers=True),
    # negative control: megatron's batched p2p at PP=2 + VPP swaps activations and gradients
    "BUG-interleaved-batched-p2p": dict(schedule="megatron-interleaved",
                                        config_overrides={"overlap_p2p_comm": False, "batch_p2p_comm": True}),
}


def _cases(table, p, t=1):
    out = []
    for label, kw in table.items():
        kw = dict(kw)
        out.append(V.make_case(kw.pop("schedule"), p, t, iterations=kw.pop("iterations", 3), label=label, **kw))
    return out


@pytest.fixture(scope="module")
def pp2(mcore_path):
    res = V.run_verify_many(_cases(PP2, 2), timeout=300, mcore_path=mcore_path, raise_errors=True)
    return {r["case"].split(":")[0]: r for r in res}


def _check_result(r, iterations=3):
    for k in ("passed", "max_rel_grad_diff", "max_abs_loss_diff", "schedule", "losses", "timing"):
        assert k in r
    assert len(r["losses"]) == iterations and len(r["reference_losses"]) == iterations
    assert all(math.isfinite(x) and 3.0 < x < 6.0 for x in r["losses"])
    assert r["timing"]["median_iteration_ms"] > 0
    json.dumps(r)  # JSON-serialisable


@pytest.mark.dist
@pytest.mark.megatron
@pytest.mark.parametrize("label", [k for k in PP2 if not k.startswith("BUG")])
def test_pp2_matches_reference(pp2, label, mcore_version):
    r = pp2[label]
    _check_result(r)
    assert r["passed"], r
    if mcore_version:
        assert r["megatron_core"].startswith(mcore_version)
    assert r["max_abs_loss_diff"] <= V.DEFAULT_LOSS_ATOL
    if "forward-only" in label:
        assert r["max_rel_grad_diff"] is None
    else:
        assert r["max_rel_grad_diff"] <= V.DEFAULT_GRAD_RTOL
    # iterations differ (new data, SGD step in between)
    assert len(set(round(x, 6) for x in r["losses"])) == 3


@pytest.mark.dist
@pytest.mark.megatron
def test_pp2_negative_control_is_caught(pp2):
    r = pp2["BUG-interleaved-batched-p2p"]
    assert not r["passed"]
    assert r["max_rel_grad_diff"] > 1.0  # not a rounding difference
    assert r["worst_param"]["param"]


@pytest.mark.dist
@pytest.mark.megatron
def test_pp2_reference_is_shared(pp2):
    # identical model and data: every case sees the same reference (computed once per launch)
    a, b = pp2["1f1b"], pp2["seq-v"]
    assert a["reference_losses"] == b["reference_losses"]
    assert pp2["1f1b-untied"]["reference_losses"] != a["reference_losses"]


# -- PP=4 and TP=2 x PP=2 ------------------------------------------------------------------------

PP4 = {
    "1f1b": dict(schedule="megatron-1f1b"),
    "interleaved-batched-p2p": dict(schedule="megatron-interleaved"),  # PP=4: the default is fine
    "seq-v": dict(schedule="sequential", placement="v"),
    # the install() path: a stand-in install() returns the sequential executor through megatron's
    # get_forward_backward_func(); the placement (V) comes from the schedule core's 'gpipe-v'
    "installed-gpipe-v": dict(schedule="gpipe-v", schedule_options={"flag": 1}),
}

TP2PP2 = {
    "1f1b-sp": dict(schedule="megatron-1f1b", sequence_parallel=True),
    "1f1b-overlap-grad-reduce": dict(schedule="megatron-1f1b", overlap_grad_reduce=True, iterations=2),
    "interleaved-sp": dict(schedule="megatron-interleaved", sequence_parallel=True),
    "seq-v-sp": dict(schedule="sequential", placement="v", sequence_parallel=True),
}


@pytest.mark.dist
@pytest.mark.megatron
def test_pp4_and_the_install_path(rank_pool):
    cases = _cases(PP4, 4)
    per_case = rank_pool(H.rank_case_with_stub_install, cases, 4, timeout=300)
    res = [V.compare(c, ranks) for c, ranks in zip(cases, per_case)]
    bad = [r for r in res if not r["passed"]]
    assert not bad, [(r["case"], r["max_rel_grad_diff"], r["max_abs_loss_diff"], r["problems"]) for r in bad]
    for r, kw in zip(res, PP4.values()):
        _check_result(r)
    installed = per_case[-1]
    assert installed[0]["stub_calls"] == [["gpipe-v", 2, None, ["flag", "measure_memory"]], "uninstall"]
    assert [r["stages"] for r in installed] == [[0, 7], [1, 6], [2, 5], [3, 4]]  # V placement
    assert all(r["stub_calls"] == [] for r in per_case[0])  # pseudo-schedules never call install


@pytest.mark.dist
@pytest.mark.megatron
def test_tp2_pp2_matches_reference(mcore_path):
    res = V.run_verify_many(_cases(TP2PP2, 2, 2), timeout=300, mcore_path=mcore_path, raise_errors=True)
    bad = [r for r in res if not r["passed"]]
    assert not bad, [(r["case"], r["max_rel_grad_diff"], r["max_abs_loss_diff"], r["problems"]) for r in bad]
    for r, kw in zip(res, TP2PP2.values()):
        _check_result(r, kw.get("iterations", 3))
        assert r["pipeline_parallel_size"] == 2 and r["tensor_parallel_size"] == 2


# -- the CLI end to end ------------------------------------------------------------------------

@pytest.mark.dist
@pytest.mark.megatron
def test_cli_verify_json_last_line(capsys, mcore_path):
    argv = ["--schedule", "sequential", "--placement", "v", "--pipeline-parallel-size", "2",
            "--num-microbatches", "3", "--iterations", "2", "--json"]
    if mcore_path:
        argv += ["--mcore-path", mcore_path]
    rc = V.main_verify(argv)
    out = capsys.readouterr().out.strip().splitlines()
    d = json.loads(out[-1])
    assert rc == 0 and d["passed"] is True
    assert d["schedule"] == "sequential" and len(d["losses"]) == 2
    assert d["max_rel_grad_diff"] <= V.DEFAULT_GRAD_RTOL and d["max_abs_loss_diff"] <= V.DEFAULT_LOSS_ATOL
    assert any(line.startswith("PASSED") for line in out[:-1])


# Every registered schedule through install() and megatron's API: tests/test_runtime_megatron.py.
