"""Optimizer post-validation, pipeline side (runtime/features/postval.py, the executor's validation point)
with real gloo processes and no megatron; Megatron's optimizer with it: tests/test_postval_megatron.py."""
from __future__ import annotations

import time

import pytest
import torch

from megatron_zb.runtime.features.postval import Replay, combine, replayable
from tests import _postval_fns as F
from tests._host import overload


def test_combine_sums_and_ors():
    a = torch.tensor([1.0, 2.0, 0.0, 1.0], dtype=torch.float64)
    b = torch.tensor([3.0, 4.0, 1.0, 0.0], dtype=torch.float64)
    assert combine(a, b).tolist() == [4.0, 6.0, 1.0, 1.0]


def test_replay_records_then_replays_then_continues():
    it = iter(range(10))
    r = Replay(it)
    assert [next(r) for _ in range(3)] == [0, 1, 2]
    r.rewind()
    assert [next(r) for _ in range(5)] == [0, 1, 2, 3, 4]
    shared = iter("abc")
    a, b, c = replayable([shared, shared, None])
    assert a is b and c is None and next(a) == "a" and next(b) == "b"


@pytest.mark.dist
@pytest.mark.timing
def test_channel_rounds_and_a_silent_rank_times_out(rank_pool):
    t0 = time.time()
    res = rank_pool(F.channel_case, [{"kind": "rounds", "timeout": 30},
                                     {"kind": "silent-last-rank", "timeout": 3}], 3, timeout=120, cpu_shims=False)
    rounds, silent = res
    for r in rounds:  # every rank sees the full reduction of every step, in order
        assert r["fulls"] == [[6.0, 6.0, 0.0], [9.0, 6.0, 1.0], [12.0, 6.0, 0.0]]
        assert r["verdicts"] == [True, False, "recovered", True] and r["rollbacks"] == 1
    assert silent[2] == {"skipped": True}
    e0, e1 = silent[0]["error"], silent[1]["error"]
    assert e0 and "pipeline rank 0" in e0 and "iteration 5" in e0 and "from pipeline rank 1" in e0
    assert e1 and "pipeline rank 1" in e1 and "the full result from pipeline rank 2" in e1
    assert time.time() - t0 < 100 * overload()  # timed out, never hung (slack for a busy host)


@pytest.mark.dist
def test_rejected_step_drains_the_iteration(rank_pool):
    # zb-v (V turn-around handed over locally) and dualpipe-v (overlapped F&B pairs), one launch
    cases = [{"schedule": s, "m": 6, "verdict": v} for s in ("zb-v", "dualpipe-v") for v in (False, True)]
    res = rank_pool(F.drain_case, cases, 3, timeout=120, cpu_shims=False)
    for case, ranks in zip(cases, res):
        for r in ranks:
            assert len(r["calls"]) == 1 and r["again"] is True
            if case["verdict"]:
                assert r["completed"] is True and r["computed"] > r["calls"][0]
            else:
                # validated before the first backward: only the forwards before it ran, then
                # every message still flowed (the next run on the same links matches)
                assert r["completed"] is False and r["computed"] == r["calls"][0]
                assert r["calls"][0] <= r["forwards_before_first_b"]


@pytest.mark.parametrize("kw, msg", [
    (dict(clip_grad=1.0), "needs Megatron's optimizer"),
    (dict(optimizer="adam", inject_nonfinite_at=1), "FP32Optimizer never checks"),
    (dict(optimizer="adam", inject_nonfinite_at=7, fp16=True), "iteration 0..2"),
    (dict(optimizer="adam", bf16=True, fp16=True), "exclusive"),
    (dict(optimizer="lamb"), "adam or sgd"),
    (dict(post_validation=True, ddp=False), "DDP"),
])
def test_verify_optimizer_options_rejected(kw, msg):
    from megatron_zb import verify as V
    with pytest.raises(V.VerifyUsageError, match=msg):
        V.make_case("zb-h2", 2, **kw)
    with pytest.raises(V.VerifyUsageError, match="post-validation runs a megatron-zb schedule"):
        V.make_case("megatron-1f1b", 2, post_validation=True)


def test_verify_optimizer_defaults():
    from megatron_zb import verify as V
    c = V.make_case("zb-v", 2, post_validation=True, bf16=True, inject_nonfinite_at=1)
    assert c.optimizer == "adam" and c.loss_scale == 1.0 and c.param_rtol == 0.1 and c.loss_atol == 5e-3
    assert "post-validation" in c.describe() and "inf@1" in c.describe()


@pytest.mark.parametrize("argv", [["--clip-grad", "1"], ["--optimizer", "adam", "--inject-nonfinite-at", "0"],
                                  ["--optimizer", "nadam"]])
def test_verify_cli_optimizer_bad_input(argv, capsys):
    from megatron_zb import verify as V
    assert V.main_verify(["--schedule", "zb-h2", "-p", "2"] + argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
