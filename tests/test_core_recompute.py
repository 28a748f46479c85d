"""Recompute in the cost model: Megatron's uniform and block methods and megatron-zb's per-rank
counts, costed per model chunk (issue 55 item 2)."""
import dataclasses

import pytest

from megatron_zb.core.costs.chunk_costs import chunk_costs
from megatron_zb.core.costs.layout import from_counts
from megatron_zb.core.costs.model import ModelSpec
from megatron_zb.core.ir import Placement, ScheduleError

BASE = ModelSpec(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=2048, flash_attention=False)


def _costs(spec, pl=None):
    pl = pl or Placement.single(2)
    return chunk_costs(spec, from_counts([4] * pl.num_logical_stages, 0) if pl.num_logical_stages * 4 == 8
                       else from_counts([8 // pl.num_logical_stages] * pl.num_logical_stages, 0), pl, 1.0, 1.0)


def test_block_method_recomputes_the_first_layers_of_each_chunk():
    plain = _costs(BASE)
    f, b, w = BASE.layer_flops(0)
    m_b, _ = BASE.layer_activation_bytes(0)
    again_b = BASE.recomputing().layer_activation_bytes(0)[0]
    for n in (1, 2, 4):
        block = _costs(dataclasses.replace(BASE, recompute="full", recompute_method="block", recompute_num_layers=n))
        for c in range(2):
            assert block.cost_f[c] == plain.cost_f[c] and block.cost_w[c] == plain.cost_w[c]
            assert block.cost_b[c] == pytest.approx(plain.cost_b[c] + n * f)  # their forward again in B
            assert block.mem_f[c] == pytest.approx(plain.mem_f[c] - n * (m_b - again_b))  # only their input kept


def test_uniform_method_recomputes_every_layer():
    uni = _costs(dataclasses.replace(BASE, recompute="full", recompute_method="uniform", recompute_num_layers=2))
    old = _costs(dataclasses.replace(BASE, recompute="full", recompute_num_layers=2))  # uniform is the default
    assert uni == old and uni.cost_b[0] > _costs(BASE).cost_b[0]


def test_recompute_counts():
    spec = dataclasses.replace(BASE, recompute="full", recompute_method="block", recompute_counts=(3, 0))
    per = _costs(spec)
    plain = _costs(BASE)
    f = BASE.layer_flops(0)[0]
    assert per.cost_b[0] == pytest.approx(plain.cost_b[0] + 3 * f) and per.cost_b[1] == plain.cost_b[1]
    v = _costs(dataclasses.replace(spec, recompute_counts=(1, 2)), Placement.vshape(2))  # rank 0: chunks 0 and 3
    pv = _costs(BASE, Placement.vshape(2))
    assert [round(x - y, 3) for x, y in zip(v.cost_b, pv.cost_b)] == [round(k * f, 3) for k in (1, 2, 2, 1)]
    # one count per model chunk, pipeline order (a V's rank 0 holds chunks 0 and 3)
    c = _costs(dataclasses.replace(spec, recompute_counts=(2, 0, 1, 0)), Placement.vshape(2))
    assert [round(x - y, 3) for x, y in zip(c.cost_b, pv.cost_b)] == [round(k * f, 3) for k in (2, 0, 1, 0)]


@pytest.mark.parametrize("kw, match", [
    (dict(recompute="selective", recompute_method="block"), "applies to --recompute-granularity full"),
    (dict(recompute="full", recompute_method="blocky"), "uniform or block"),
    (dict(recompute="full", recompute_method="uniform", recompute_counts=(1, 1)), "--recompute-method block"),
    (dict(recompute="full", recompute_method="block", recompute_counts=(1, -1)), "counts >= 0"),
])
def test_bad_recompute_is_refused(kw, match):
    with pytest.raises(ScheduleError, match=match):
        dataclasses.replace(BASE, **kw).validate()


def test_per_rank_values_must_cover_every_rank_and_fit_the_chunks():
    spec = dataclasses.replace(BASE, recompute="full", recompute_method="block", recompute_counts=(1,))
    with pytest.raises(ScheduleError, match="one per pipeline rank"):
        _costs(spec)
    with pytest.raises(ScheduleError, match="asks 5 layers of model chunk 1, which holds 4"):
        _costs(dataclasses.replace(spec, recompute_counts=(1, 5)))


@pytest.mark.parametrize("name", ["zb-v", "v-auto", "zb-auto"])
def test_split_schedules_build_where_w_holds_more_than_f(name):
    """Full recompute: F keeps a layer's input, B recreates the layer and W keeps its GEMMs' inputs,
    so a W holds more than its F. The schedules at 1F1B's depth then take what one B adds before its
    W (``f1b_peak``); they were refused ('no schedule fits ... about' the same limit)."""
    from megatron_zb.core.schedules import generate
    from megatron_zb.core.schedules.search.auto import f1b_peak, unit
    from megatron_zb.core.ir import Setting
    from megatron_zb.core.sim.simulate import simulate
    spec = dataclasses.replace(BASE, recompute="full", recompute_method="uniform", recompute_num_layers=1)
    pl = Placement.vshape(4) if name != "zb-auto" else Placement.single(4)
    cc = chunk_costs(spec, from_counts([8 // pl.num_logical_stages] * pl.num_logical_stages, 0), pl, 1.0, 1.0)
    assert max(w - f for f, w in zip(cc.mem_f, cc.mem_w)) > 0
    st = Setting(4, 8, chunks=pl.chunks, cost_f=cc.cost_f, cost_b=cc.cost_b, cost_w=cc.cost_w, mem_f=cc.mem_f,
                 mem_w=cc.mem_w)
    res = simulate(generate(name, st), st)
    assert max(res.peak_memory) <= f1b_peak(st, pl) + 1e-9
    assert f1b_peak(st, pl) > 4 * unit(st, pl)
    plain = Setting(4, 8, chunks=pl.chunks, mem_f=[1.0], mem_w=[0.5])  # W holds less: 1F1B's P units
    assert f1b_peak(plain, pl) == pytest.approx(4 * unit(plain, pl))
