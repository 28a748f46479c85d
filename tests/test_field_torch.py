"""Issue 17 pieces that need torch: interleaved-zb against torch.distributed.pipelining's own
ScheduleInterleavedZeroBubble helpers, and the replica gradient sync on two real gloo processes."""
import pytest

from megatron_zb.core.ir import B, F, W, Setting
from megatron_zb.core.schedules import generate


def _torch_order(p, v, m, rank):
    """torch.distributed.pipelining's own ZB1P rank order (its private helpers, idle slots dropped)."""
    S = pytest.importorskip("torch.distributed.pipelining.schedules")
    rounds = max(1, m // p)
    per_round = m // rounds
    warm = S._get_warmup_ops(rank, v, per_round, p, m, multiply_factor=1)
    total = v * m

    def fwd(step):
        return ((step // per_round) % v) * p + rank

    def bwd(step):
        return (v - 1 - ((step - warm) // per_round) % v) * p + rank
    ops = S._get_1f1b_rank_ops(v, p, warm, total - warm, warm, rank, fwd, bwd, rank, enable_zero_bubble=True)
    names = {"F": F, "I": B, "W": W}
    return [(names[a.computation_type.value], a.stage_index, a.microbatch_index) for a in ops if a is not None]


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (4, 2, 6), (4, 2, 3), (3, 2, 8), (8, 2, 16),
                                   (4, 4, 12)])
def test_interleaved_zb_is_torchs_order(p, v, m):
    sched = generate("interleaved-zb", Setting(p, m, chunks=v))
    for r in range(p):
        assert [(a.kind, a.stage, a.mb) for a in sched.orders[r]] == _torch_order(p, v, m, r)


@pytest.mark.dist
@pytest.mark.megatron
def test_replica_gradient_sync_and_start_check(rank_pool):
    res = rank_pool(__import__("tests._harness_fns", fromlist=["x"]).replica_sync_and_check, ["same", "differ"], 2,
                    timeout=240)
    for case, ranks in zip(["same", "differ"], res):
        for r in ranks:
            assert r["sums"] == {l: [float(20 * l + 3)] * 3 for l in range(4)}  # (10l+1) + (10l+2), both ranks
        if case == "same":
            assert all(r["check"] == "ok" for r in ranks)
        else:
            assert all("start with different weights" in r["check"] for r in ranks)
