"""The speed-ups of issue 32 item 6 keep every result: incremental timing of a local-search move,
the coded simulator path, the remembered searches, plan's layout pruning, and the V round
heuristic on layouts whose ranks hold unequal chunks."""
from __future__ import annotations

import dataclasses
import random

import pytest

from megatron_zb.core.sim import iteration, simulate as sim
from megatron_zb.core.plan import PlanRequest
from megatron_zb.core.plan import row as plan_row
from megatron_zb.core.build import ScheduleRequest, build
from megatron_zb.core.ir import Placement, Setting
from megatron_zb.core.sim.iteration import iteration_times
from megatron_zb.core.costs.model import ModelSpec
from megatron_zb.core.schedules import generate, names
from megatron_zb.core.schedules.search.evaluate import Coder
from megatron_zb.core.schedules.search.greedy import best_of
from megatron_zb.core.schedules.search.improve import _moves
from megatron_zb.core.schedules.search.vrounds import v_round_variants
from megatron_zb.core.sim.validate import validate


def _random_costs(rr: random.Random, n: int) -> dict:
    return dict(cost_f=[rr.choice([0.0, 0.5, 1.0, 1.3]) for _ in range(n)],
                cost_b=[rr.choice([0.0, 1.0, 2.0]) for _ in range(n)],
                cost_w=[rr.choice([0.0, 0.4, 1.0]) for _ in range(n)], cost_comm=rr.choice([0.0, 0.1]))


@pytest.mark.parametrize("seed", range(4))
def test_retime_of_a_move_is_the_full_timing(seed):
    rr = random.Random(seed)
    for pl in (Placement.vshape(4), Placement.single(4)):
        st = Setting(4, 6, chunks=pl.chunks, **_random_costs(rr, pl.num_stages))
        s = best_of(st, pl, 2.0 * 4, "x")
        coder = Coder(st, pl, 6)
        orders = coder.encode(s.orders)
        t = coder.time(orders)
        for k, (r, first, last, new) in enumerate(_moves(coder, orders, t, 3, True)):
            if k > 60:
                break
            trial = list(orders)
            trial[r] = new
            want = coder.time(trial)
            got = coder.retime(trial, t, r, first, None, last, orders)
            assert (got is None) == (want is None)
            if want is not None:
                full = coder.full(got)
                assert (full.start, full.end, full.spans) == (want.start, want.end, want.spans)
            cut = coder.retime(trial, t, r, first, t.makespan, last, orders)
            assert cut is not None or want is None or want.makespan > t.makespan


@pytest.mark.parametrize("name", [n for n in names() if n not in ("zb-auto", "v-auto", "zb-v", "v-half", "v-min")])
def test_coded_simulation_is_the_simulators(name, monkeypatch):
    for p, m, costs in ((2, 3, {}), (4, 8, dict(cost_f=[1.0, 1.25, 1.5, 1.75], cost_b=[1.5], cost_comm=0.1))):
        try:
            b = build(ScheduleRequest(name, **costs), p, m)
        except Exception:  # noqa: BLE001 - a schedule that does not take this P or M
            continue
        fast = sim.simulate(b.schedule, b.setting)
        fast_it = iteration_times(b.schedule, b.setting, 0.3)
        with monkeypatch.context() as mp:
            mp.setattr(sim.Plain, "timeline", lambda self, release=None: None)
            mp.setattr(iteration, "_plain_iterations", lambda *a: None)
            slow = sim.simulate(b.schedule, b.setting)
            slow_it = iteration_times(b.schedule, b.setting, 0.3)
        assert [[(t.action, t.start, t.end) for t in tl] for tl in fast.timeline] == \
            [[(t.action, t.start, t.end) for t in tl] for tl in slow.timeline]
        assert (fast.makespan, fast.spans, fast.peak_memory) == (slow.makespan, slow.spans, slow.peak_memory)
        assert (fast_it.iteration_time, fast_it.iteration_time_post_validated, fast_it.windows) == \
            (slow_it.iteration_time, slow_it.iteration_time_post_validated, slow_it.windows)


def _llama_like(p: int, m: int) -> Setting:
    """The V layout plan balances for a Llama-shaped model: chunk 0 the embedding alone (no
    compute), chunks 1-2 three layers, the rest two, the last with the output layer and loss."""
    layers = [0] + [3, 3] + [2] * (2 * p - 4) + [2]
    f = [0.0036 * n for n in layers]
    f[-1] += 0.0087
    mf = [0.16 * n for n in layers]
    mf[0], mf[-1] = 0.01, mf[-1] + 0.66
    unit = max(mf[r] + mf[2 * p - 1 - r] for r in range(p))
    return Setting(p, m, chunks=2, cost_f=f, cost_b=[1.15 * x for x in f], cost_w=[0.85 * x for x in f],
                   mem_f=[x / unit for x in mf], mem_w=[0.6 * x / unit for x in mf])


@pytest.mark.parametrize("limit", [4.0, 6.0, 2.6])
def test_v_rounds_handle_ranks_with_heavier_chunks(limit):
    st = _llama_like(4, 12)
    found = v_round_variants(st, limit, "x", keep=2)
    assert found
    for s in found:
        r = validate(s, st)
        assert max(r.peak_memory) <= limit + 1e-9
        assert s.meta["timing"][0] == pytest.approx(r.makespan, abs=1e-9)


def test_remembered_searches_are_the_searches_and_copies():
    st = Setting(4, 8, cost_f=[1.0, 1.2, 0.9, 1.1], cost_b=[2.0], cost_comm=0.05)
    zbv = generate("zb-v", st)
    vauto = generate("v-auto", dataclasses.replace(st, memory_limit=4.0))  # zb-v's limit: 1F1B's peak
    assert [[str(a) for a in o] for o in zbv.orders] == [[str(a) for a in o] for o in vauto.orders]
    again = generate("zb-v", st)
    assert again is not zbv and again.orders == zbv.orders and again.orders[0] is not zbv.orders[0]
    again.orders[0].clear()
    assert generate("zb-v", st).orders == zbv.orders


@pytest.mark.parametrize("vocab", [None, 1])
@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-auto", "v-half", "interleaved-1f1b"])
def test_plan_builds_only_the_layouts_that_can_win(name, vocab, monkeypatch):
    spec = ModelSpec(num_layers=16, hidden_size=1024, num_attention_heads=16, seq_length=2048, vocab_size=128256,
                     ffn_hidden_size=4096)
    req = PlanRequest(spec, 4, 8, 80)
    pruned = plan_row.row(name, vocab, req)
    monkeypatch.setattr(plan_row._Bounds, "busy", lambda self, k: 0.0)  # every layout built, in order
    monkeypatch.setattr(plan_row._Bounds, "above", lambda self, k, t: False)
    assert plan_row.row(name, vocab, req) == pruned


def _fast_and_slow(schedule, setting, monkeypatch):
    fast = (sim.simulate(schedule, setting), iteration_times(schedule, setting, 0.3))
    with monkeypatch.context() as mp:
        mp.setattr(sim.Plain, "timeline", lambda self, release=None: None)
        mp.setattr(iteration, "_plain_iterations", lambda *a: None)
        slow = (sim.simulate(schedule, setting), iteration_times(schedule, setting, 0.3))
    return fast, slow


def _same_times(fast, slow):
    (f, fi), (s, si) = fast, slow
    assert [[(t.action, t.start, t.end) for t in tl] for tl in f.timeline] == \
        [[(t.action, t.start, t.end) for t in tl] for tl in s.timeline]
    assert (f.makespan, f.spans, f.peak_memory) == (s.makespan, s.spans, s.peak_memory)
    assert (fi.iteration_time, fi.iteration_time_post_validated, fi.windows) == \
        (si.iteration_time, si.iteration_time_post_validated, si.windows)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "v-half", "interleaved-1f1b", "gpipe", "dualpipe-v"])
@pytest.mark.parametrize("barriers", [1, 2])
@pytest.mark.parametrize("embedding", [False, True])
def test_coded_simulation_of_vocabulary_passes_is_the_simulators(name, barriers, embedding, monkeypatch):
    from megatron_zb.core.ir.vocab import VocabSetting
    rr = random.Random(len(name) + 10 * barriers + 100 * embedding)
    for p, m in ((2, 3), (4, 8)):
        vs = VocabSetting(barriers=barriers, cost_s=[rr.choice([0.1, 0.3]) for _ in range(p)], cost_t=0.2,
                          cost_w=[rr.choice([0.0, 0.2, 0.5]) for _ in range(p)], cost_comm=rr.choice([0.0, 0.15]),
                          mem_s=0.5, mem_w=0.25, embedding=embedding,
                          cost_i=[rr.choice([0.05, 0.1]) for _ in range(p)], cost_g=0.07,
                          cost_ci=rr.choice([0.0, 0.12]), cost_cg=rr.choice([0.0, 0.09]), mem_i=0.1)
        req = ScheduleRequest(name, cost_f=[1.0 + 0.25 * r for r in range(p)], cost_b=[1.5], cost_comm=0.1, vocab=vs)
        b = build(req, p, m)
        flat = b.schedule.flat()
        coded = sim.Plain([[a for a in o if a.is_compute] for o in flat.orders], flat.placement, b.setting)
        assert coded.ok == (barriers == 1)  # two barriers: simulate's own loop (the link's order)
        _same_times(*_fast_and_slow(b.schedule, b.setting, monkeypatch))


def _every_variant(schedule, setting, memory_limit):
    """place_vocab as it was: every variant placed and simulated."""
    from megatron_zb.core.passes.vocab import add_vocab, delay_backwards
    from megatron_zb.core.passes.vocab_place import VARIANTS
    best, best_key = None, None
    for k, cap in VARIANTS:
        try:
            s = add_vocab(delay_backwards(schedule, abs(k), only_loss=k < 0), setting, w_cap=cap)
            res = sim.simulate(s, setting)
        except Exception:  # noqa: BLE001 - a variant that cannot be placed
            continue
        peak = max(res.peak_memory)
        key = (memory_limit is not None and peak > memory_limit + 1e-9, round(res.makespan, 9), round(peak, 9), k, cap)
        if best_key is None or key < best_key:
            best, best_key = s, key
    best.meta = dict(best.meta, vocab_variant={"delay": best_key[3], "w_cap": best_key[4]})
    return best


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "interleaved-1f1b", "gpipe"])
def test_vocabulary_placement_tries_each_distinct_variant_once(name):
    from megatron_zb.core.ir.vocab import VocabSetting
    from megatron_zb.core.passes.vocab_place import place_vocab
    rr = random.Random(len(name))
    for p, m in ((2, 3), (4, 8)):
        for barriers in (1, 2):
            b = build(ScheduleRequest(name, cost_f=[1.0 + 0.25 * r for r in range(p)], cost_b=[1.5], cost_comm=0.1),
                      p, m)
            vs = VocabSetting(barriers=barriers, cost_s=[rr.choice([0.1, 0.3]) for _ in range(p)], cost_t=0.2,
                              cost_w=[rr.choice([0.0, 0.2, 0.5]) for _ in range(p)], cost_comm=rr.choice([0.0, 0.15]),
                              mem_s=0.5, mem_w=0.25)
            st = dataclasses.replace(b.setting, vocab=vs)
            for limit in (None, 2.5, 100.0):
                want = _every_variant(b.schedule, st, limit)
                for _ in range(2):  # computed, then remembered
                    got = place_vocab(b.schedule, st, limit)
                    assert (got.name, got.placement, got.num_microbatches, got.orders, got.meta) == \
                        (want.name, want.placement, want.num_microbatches, want.orders, want.meta)


@pytest.mark.parametrize("p, m", [(4, 8), (4, 5), (4, 11)])
def test_building_blocks_remembered_across_limits_are_the_blocks(p, m, monkeypatch):
    from megatron_zb.core.ir.memo import Memo
    from megatron_zb.core.schedules.search import vslots
    limits = [2 * p, p + 1, p + 3, p]

    def fresh(limit):  # every block built anew for this limit alone
        monkeypatch.setattr(vslots, "_ORDERS", Memo(8))
        monkeypatch.setattr(vslots, "_BUILT", Memo(4096))
        return vslots._orders(p, m, limit)

    want = {limit: fresh(limit) for limit in limits}
    monkeypatch.setattr(vslots, "_BUILT", Memo(4096))
    for limit in limits:  # one memory of blocks for every limit, in turn
        monkeypatch.setattr(vslots, "_ORDERS", Memo(8))
        assert vslots._orders(p, m, limit) == want[limit]


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-v", "v-half", "interleaved-1f1b", "bitpipe", "dualpipe-v"])
@pytest.mark.parametrize("barriers", [None, 1, 2])
def test_makespan_and_peak_are_the_simulations(name, barriers):
    """``makespan_and_peak`` (Plain's times, no timeline) gives simulate's floats, with vocabulary
    passes (one barrier: Plain; two: simulate's own loop) and without, replicated stages too."""
    from megatron_zb.core.ir.vocab import VocabSetting
    if barriers is not None and name == "bitpipe":
        pytest.skip("vocabulary parallelism: not with replicated stages")
    rr = random.Random(len(name) + 7 * (barriers or 0))
    for p, m in ((2, 4), (4, 8)):
        vs = None if barriers is None else VocabSetting(
            barriers=barriers, cost_s=[rr.choice([0.1, 0.3]) for _ in range(p)], cost_t=0.2,
            cost_w=[rr.choice([0.0, 0.2, 0.5]) for _ in range(p)], cost_comm=rr.choice([0.0, 0.15]),
            mem_s=0.5, mem_w=0.25)
        b = build(ScheduleRequest(name, cost_f=[1.0 + 0.25 * r for r in range(p)], cost_b=[1.5], cost_comm=0.1,
                                  vocab=vs), p, m)
        res = sim.simulate(b.schedule, b.setting)
        assert sim.makespan_and_peak(b.schedule, b.setting) == (res.makespan, max(res.peak_memory))
