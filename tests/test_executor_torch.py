"""Executor + lowering + p2p on real gloo processes with a plain-torch model, every schedule:
losses and gradients equal the single-process reference."""

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from megatron_zb.core.ir import ScheduleError
from megatron_zb.core.schedules import get, names

from tests import _toy_pipeline as toy
from tests._host import overload
from tests._ports import free_port

pytestmark = pytest.mark.dist




def run_cases(rank_pool, world, cases, timeout=900):
    """{rank: [(status, payload) per case]}: every case on ``world`` ranks of one verify launch
    (forked from the warm torch-only server where there is one: no rank imports torch again)."""
    made = {k: s for k, s in toy._SCHEDULES.items() if k[1] == world}  # generated here once (_applies)
    res = rank_pool(toy.rank_case, [{"args": c, "schedules": made} for c in cases], world, timeout=timeout,
                    cpu_shims=False)
    return {r: [res[ci][r] for ci in range(len(cases))] for r in range(world)}


def _applies(name, world, m, chunks):
    try:
        toy.generated(name, world, m, chunks)
        return True
    except ScheduleError:  # a microbatch-count rule of the schedule (e.g. interleaved-zb's rounds)
        return False


def _cases(world):
    cases = []
    for name in names():
        if get(name).models_per_rank is not None:
            continue  # replicated stages (bitpipe): the megatron tests cover them
        chunks = 2 if get(name).chunks is None else None
        for m in (1, world - 1 or 1, 2 * world + 1):
            if _applies(name, world, m, chunks):
                cases.append((name, m, chunks, False))
        if _applies(name, world, world + 1, chunks):
            cases.append((name, world + 1, chunks, True))
    return cases


@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_matches_reference(rank_pool, world):
    cases = _cases(world)
    results = run_cases(rank_pool, world, cases)
    for ci, (name, m, chunks, fwd_only) in enumerate(cases):
        spec = get(name)
        v = chunks or spec.chunks or 1
        nst = world * v
        ref_losses, ref_grads = toy.reference(nst, m)
        losses, grads = {}, {}
        for r in range(world):
            status, payload = results[r][ci]
            assert status == "ok", f"{name} m={m} rank {r}:\n{payload}"
            losses.update(payload[0])
            grads.update(payload[1])
        assert [losses[i] for i in range(m)] == pytest.approx(ref_losses, rel=1e-6), name
        if fwd_only:
            assert all(g is None for gs in grads.values() for g in gs)
            continue
        for s in range(nst):
            for g, rg in zip(grads[s], ref_grads[s]):
                np.testing.assert_allclose(g, rg, rtol=1e-5, atol=1e-6, err_msg=f"{name} m={m} stage {s}")


def test_every_schedule_with_offload_matches_reference(rank_pool):
    # activations go to "host" buffers (CPU test mode) and come back before their B; W reuses
    # the retained graph, whose saved tensors are the reloaded ones. Ratios 1 and 0.5 alternate.
    world = 4
    cases = []
    for i, name in enumerate(names()):
        if get(name).models_per_rank is not None:
            continue  # replicated stages (bitpipe): not with offload here
        chunks = 2 if get(name).chunks is None else None
        m = next(m for m in (2 * world + 1, 2 * world) if _applies(name, world, m, chunks))
        cases.append((name, m, chunks, False, None, 60, 1.0 if i % 2 == 0 else 0.5))
    results = run_cases(rank_pool, world, cases)
    for ci, (name, m, chunks, *_rest) in enumerate(cases):
        ratio = _rest[-1]
        v = chunks or get(name).chunks or 1
        nst = world * v
        ref_losses, ref_grads = toy.reference(nst, m)
        losses, grads, moved = {}, {}, 0
        for r in range(world):
            status, payload = results[r][ci]
            assert status == "ok", f"{name} offload {ratio} rank {r}:\n{payload}"
            losses.update(payload[0])
            grads.update(payload[1])
            moved += payload[2]["offloaded_parts"]
            assert payload[2]["offloaded_parts"] == payload[2]["reloaded_parts"]
        assert moved > 0, name
        assert [losses[i] for i in range(m)] == pytest.approx(ref_losses, rel=1e-6), name
        for s in range(nst):
            for g, rg in zip(grads[s], ref_grads[s]):
                np.testing.assert_allclose(g, rg, rtol=1e-5, atol=1e-6, err_msg=f"{name} offload stage {s}")


@pytest.mark.timing
def test_stuck_peer_times_out_naming_rank_pass_and_peer(rank_pool):
    # rank 0 never sends: rank 1 must fail after the timeout, naming itself, the pass and the peer
    results = run_cases(rank_pool, 2, [("zb-h1", 2, None, False, 0, 3)])
    status, payload = results[1][0]
    assert status == "err"
    # rank 0 times out too (it waits for a gradient that never comes); if its process group closes
    # the pair's connection before rank 1's own timeout fires, rank 1 reports PeerLost (a
    # PipelineTimeout) with the same facts
    assert "PipelineTimeout: " in payload or "PeerLost: " in payload, payload
    assert "pipeline rank 1 (global rank 1) waited" in payload
    assert "for the input of F1.0 from pipeline rank 0" in payload


@pytest.mark.parametrize("mode, doing", [
    ("wait", "for the input of F1.0 from"),
    ("post", "to post the receive of the input of F1.0 from"),
    ("send", "to send the output of F1.0 to"),
])
@pytest.mark.timing
def test_a_peer_that_exits_is_named_without_waiting_for_the_timeout(mode, doing):
    # rank 0's process ends (as it does after its own timeout) while rank 1 waits for it, or before
    # rank 1 posts a receive from it or sends to it: rank 1 fails at once with PeerLost (a
    # PipelineTimeout), naming itself, the pass and the peer, never with the transport's raw error
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=toy._lost_peer_worker, args=(r, port, q, mode)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        msg, waited = q.get(timeout=600)  # a hang guard: the ranks import torch first (minutes at load 50)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert msg.startswith("PeerLost: pipeline rank 1 (global rank 1) "), msg
    assert (f"{doing} pipeline rank 0 (global rank 0) and lost the "
            "connection to it; that rank is stuck or has failed (transport:") in msg, msg
    assert waited < min(30 * overload(), 50), waited  # at once: not the 60 s timeout (slack for a busy host)
