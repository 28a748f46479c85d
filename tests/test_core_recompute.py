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
