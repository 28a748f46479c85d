"""Weight-gradient deferral (B/W split): the W queue and megatron-core linear layers.

The megatron checks run in real processes (2 ranks, gloo on 127.0.0.1), all cases in one verify
launch (its ranks forked from the warm zygote server: importing megatron costs seconds per
process); see tests/_wgrad_worker.py. Set
``MZB_MCORE=0.19.2`` to run them against .venv/mcore-0.19.2 instead of the installed
megatron-core (the convention of tests/conftest.py).
"""
from __future__ import annotations


import pytest
import torch

from megatron_zb.runtime.wqueue import WQueue, WQueueError

WORLD = 2
TIMEOUT = 900  # a hang guard for the whole launch (tens of seconds quiet; it ran out at 240 s at load 50)
TOL = 1e-6  # relative L2; B+W reorders the per-microbatch sums, BW must be bit-identical

# the worker's case names (it imports megatron, so this process does not import it)
CASES = [
    "mlp_tp1", "mlp_tp1_gaf", "mlp_tp2", "mlp_tp2_gaf", "mlp_tp2_sp", "mlp_tp2_sp_gaf",
    "reuse_tp2", "reuse_tp2_gaf",
    "gpt_tp1", "gpt_tp2", "gpt_tp1_midstage", "gpt_tp2_sp_midstage",
    "gpt_dp2_ddp", "gpt_dp2_ddp_overlap", "gpt_dp2_ddp_gaf", "gpt_dp2_ddp_overlap_gaf",
    "gpt_tp2_sp_ddp_overlap_gaf", "gpt_tp2_sp_midstage_ddp_overlap",
]


# ----------------------------------------------------------------------------- WQueue (plain torch)
def test_queue_runs_one_microbatch_in_enqueue_order():
    q, log = WQueue("c0"), []
    for mb in (0, 1):
        with q.defer(mb):
            assert q.deferring and q.current_mb == mb
            q.put(lambda mb=mb: log.append((mb, "a")))
            q.put(lambda mb=mb: log.append((mb, "b")))
    assert not q.deferring and q.pending() == [0, 1] and len(q) == 4
    assert q.run(1) == 2 and log == [(1, "a"), (1, "b")]
    assert q.pending() == [0]
    q.run_all()
    assert log[2:] == [(0, "a"), (0, "b")]
    q.assert_empty()


def test_queue_errors_name_chunk_and_microbatch():
    q = WQueue("stage3")
    with pytest.raises(WQueueError, match=r"'stage3'.*microbatch 5.*nothing is queued"):
        q.run(5)
    with pytest.raises(WQueueError, match="outside defer"):
        q.put(lambda: None)
    with q.defer(2):
        with pytest.raises(WQueueError, match="nest"):
            with q.defer(3):
                pass
        with pytest.raises(WQueueError, match="during the B pass"):
            q.run(2)
    with pytest.raises(WQueueError, match="already has a deferred B"):
        with q.defer(2):
            pass
    with pytest.raises(WQueueError, match=r"'stage3'.*\[2\]"):
        q.assert_empty()
    assert q.run(2) == 0  # a B that queued nothing still has a (no-op) W
    q.assert_empty()
    with pytest.raises(WQueueError, match="must be an int"):
        with q.defer("0"):
            pass


def test_queue_fifo_work_must_follow_b_order():
    q, log = WQueue("te"), []
    for mb in (4, 7):
        with q.defer(mb):
            q.put(lambda mb=mb: log.append(mb), fifo=True)
    with pytest.raises(WQueueError, match=r"microbatch 7 before W for microbatch 4.*\[4, 7\]"):
        q.run(7)
    assert log == [] and q.pending() == [4, 7]  # nothing ran, nothing lost
    q.run(4)
    q.run(7)
    assert log == [4, 7]


# ----------------------------------------------------------------------------- delayed-wgrad modules
class _Fifo:
    """TE's delayed-wgrad store protocol: delay_wgrad_compute() and a FIFO of deferred work."""

    def __init__(self):
        self.items = []

    def delay_wgrad_compute(self):
        return True


class _DelayedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, module):
        ctx.save_for_backward(x, w)
        ctx.module = module
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        ctx.module.wgrad_store.items.append((x, g))  # like TE: always pushed, popped by backward_dw
        return g @ w, None, None  # no weight grad from backward itself


class _DelayedLinear(torch.nn.Module):
    """A stand-in following Transformer Engine's delay_wgrad_compute module protocol."""

    def __init__(self, n, seed):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n, n, generator=torch.Generator().manual_seed(seed)))
        self.wgrad_store = _Fifo()

    def forward(self, x):
        return _DelayedFn.apply(x, self.weight, self)

    def backward_dw(self):
        x, g = self.wgrad_store.items.pop(0)
        gw = g.t() @ x
        self.weight.grad = gw if self.weight.grad is None else self.weight.grad + gw


def test_delayed_wgrad_protocol_modules_run_backward_dw_at_w_or_end_of_bw():
    from megatron_zb.megatron.execution.wgrad import attach_wgrad_queue, detach_wgrad_queue

    chunk = torch.nn.Sequential(_DelayedLinear(4, 1), torch.nn.Tanh(), _DelayedLinear(4, 2))
    q = WQueue("te-chunk")
    assert attach_wgrad_queue(chunk, q) == 2
    assert attach_wgrad_queue(chunk, q) == 2  # idempotent: one hook per module
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(s)) for s in range(3)]

    def grads():
        return [chunk[0].weight.grad.clone(), chunk[2].weight.grad.clone()]

    def clear():
        for m in (chunk[0], chunk[2]):
            m.weight.grad = None

    # BW: backward_dw runs at the end of the backward; then B+W, W in B order
    for x in xs:
        chunk(x).sum().backward()
    assert all(not m.wgrad_store.items for m in (chunk[0], chunk[2]))
    ref = grads()
    clear()
    for mb, x in enumerate(xs):
        with q.defer(mb):
            chunk(x).sum().backward()
    assert chunk[0].weight.grad is None and len(chunk[0].wgrad_store.items) == 3
    with pytest.raises(WQueueError, match="B order"):
        q.run(2)
    for mb in range(3):
        q.run(mb)
    q.assert_empty()
    for a, b in zip(grads(), ref):
        torch.testing.assert_close(a, b)
    detach_wgrad_queue(chunk)
    assert not chunk[0]._forward_hooks


# ----------------------------------------------------------------------------- megatron, multi-rank


def _rank_case(name):
    """A verify rank's side: the worker's case (the worker imports megatron; this module does not)."""
    from tests import _wgrad_worker
    return _wgrad_worker.rank_case(name)


@pytest.fixture(scope="module")
def megatron_results(rank_pool):
    """Per rank: {"mcore_version", "mcore_file", "cases": {name: result}}, every case in one launch
    of ``WORLD`` ranks (forked from the warm zygote server, megatron-core of ``MZB_MCORE``)."""
    res = rank_pool(_rank_case, list(CASES), WORLD, timeout=TIMEOUT)
    out = []
    for rank in range(WORLD):
        cases = {name: res[ci][rank] for ci, name in enumerate(CASES)}
        first = cases[CASES[0]]
        out.append({"mcore_version": first["mcore_version"], "mcore_file": first["mcore_file"], "cases": cases})
    return out


@pytest.mark.megatron
@pytest.mark.dist
def test_megatron_version_is_the_requested_one(megatron_results, mcore_path, mcore_version):
    for r in megatron_results:
        if mcore_version:
            assert r["mcore_version"].startswith(mcore_version), r["mcore_file"]
        if mcore_path:
            assert r["mcore_file"].startswith(mcore_path), r["mcore_file"]


@pytest.mark.megatron
@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_megatron_b_then_shuffled_w_equals_fused_backward(megatron_results, case):
    for rank, r in enumerate(megatron_results):
        c = r["cases"][case]
        assert c["ok"], f"rank {rank} (megatron-core {r['mcore_version']}):\n{c.get('error')}"
        assert c["layers"] >= 1
        # one closure per deferrable layer and microbatch (a layer called twice is merged)
        assert c["closures"] == c["layers"] * c["microbatches"], c
        # BW is bit-identical to megatron; except a layer called twice, whose two weight grads
        # megatron sums before accumulating and BW accumulates one by one (B+W merges them)
        assert c["bw_rel"] <= (TOL if case.startswith("reuse") else 0.0), c
        assert c["bw_x_rel"] == 0.0, c
        assert c["split_rel"] <= TOL and c["split_x_rel"] == 0.0, c  # B: same input grads
        assert "microbatch 0" in c["error_message"]


# ----------------------------------------------------------------------------- Transformer Engine
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="Transformer Engine's delay_wgrad_compute needs CUDA (none here)")
def test_transformer_engine_delayed_wgrad_runs_at_w():
    te = pytest.importorskip("transformer_engine.pytorch",
                             reason="transformer_engine is not installed")
    from megatron_zb.megatron.execution.wgrad import attach_wgrad_queue

    torch.manual_seed(0)
    n = 64

    def make(delay):
        torch.manual_seed(0)
        return torch.nn.Sequential(
            te.Linear(n, 2 * n, params_dtype=torch.float32, delay_wgrad_compute=delay),
            te.Linear(2 * n, n, params_dtype=torch.float32, delay_wgrad_compute=delay)).cuda()

    ref, chunk = make(False), make(True)
    q = WQueue("te")
    assert attach_wgrad_queue(chunk, q) == 2
    xs = [torch.randn(16, n, device="cuda") for _ in range(2)]
    ref_grads = []
    for x in xs:  # per microbatch: TE's backward_dw sets .grad (no accumulation without fusion)
        for p in ref.parameters():
            p.grad = None
        ref(x).square().sum().backward()
        ref_grads.append([p.grad.clone() for p in ref.parameters()])
    for mb, x in enumerate(xs):
        with q.defer(mb):
            chunk(x).square().sum().backward()
    with pytest.raises(WQueueError, match="B order"):
        q.run(1)
    for mb in range(2):
        for p in chunk.parameters():
            p.grad = None
        q.run(mb)
        for a, b in zip([p.grad for p in chunk.parameters()], ref_grads[mb]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    q.assert_empty()
    # BW (no defer): backward_dw runs at the end of the backward
    for p in chunk.parameters():
        p.grad = None
    chunk(xs[0]).square().sum().backward()
    for a, b in zip([p.grad for p in chunk.parameters()], ref_grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="Transformer Engine's grouped linear (MoE experts) needs CUDA (none here)")
def test_transformer_engine_grouped_linear_experts_defer_to_w():
    """MoE's TE experts (TEGroupedMLP's GroupedLinear, one GEMM per local expert) follow the same
    delayed-wgrad protocol: B leaves every expert's weight gradient to W."""
    te = pytest.importorskip("transformer_engine.pytorch", reason="transformer_engine is not installed")
    from megatron_zb.megatron.execution.wgrad import attach_wgrad_queue

    n, experts = 64, 4
    splits = [5, 0, 7, 4]  # tokens per expert (an expert may get none)

    def make(delay):
        torch.manual_seed(0)
        return te.GroupedLinear(experts, n, n, params_dtype=torch.float32, delay_wgrad_compute=delay).cuda()

    ref, chunk = make(False), make(True)
    q = WQueue("te-grouped")
    assert attach_wgrad_queue(chunk, q) == 1
    x = torch.randn(sum(splits), n, device="cuda")
    ref(x, splits).square().sum().backward()
    with q.defer(0):
        chunk(x, splits).square().sum().backward()
    assert all(p.grad is None for p in chunk.parameters())  # nothing before W
    q.run(0)
    for a, b in zip(chunk.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)
    q.assert_empty()
