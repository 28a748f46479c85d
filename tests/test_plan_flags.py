"""A plan row's flags build the row's schedule: training reads them (with the model's Megatron flags)
into the same per-chunk costs, memory limit, vocabulary passes and search effort, and builds the
very schedule plan timed (issue 32: the numbers plan prints are what the run gets)."""
import argparse
import shlex

import pytest

from megatron_zb.core import plan as P
from megatron_zb.core.plan.schedule import row_schedule
from megatron_zb.megatron.execution.options import ScheduleOptions, preview
from megatron_zb.megatron.launch.args import add_zero_bubble_args
from megatron_zb.megatron.launch.flags import validate_zero_bubble_args

MODEL = dict(num_layers=16, hidden_size=1024, num_attention_heads=16, seq_length=2048, vocab_size=128256)


def _training(flags: str, p: int, m: int):
    """The schedule training builds from a row's flags and the model's Megatron flags (bf16, dropout,
    Megatron's local attention: the spec below)."""
    ap = argparse.ArgumentParser()
    add_zero_bubble_args(ap)
    for flag, kind in (("--pipeline-model-parallel-size", int), ("--num-virtual-stages-per-pipeline-rank", int),
                       ("--pipeline-model-parallel-layout", str), ("--recompute-granularity", str),
                       ("--recompute-method", str), ("--recompute-num-layers", int)):  # Megatron's own flags
        ap.add_argument(flag, type=kind)
    args = argparse.Namespace(micro_batch_size=1, bf16=True, transformer_impl="local", **MODEL,
                              **vars(ap.parse_args(shlex.split(flags))))
    built, _ = preview(ScheduleOptions(**validate_zero_bubble_args(args, before_megatron_validation=True)), p, m)
    return built


@pytest.mark.parametrize("m", [16, 24])  # P x M <= 64 (the V family searched in full near the leader) and above
def test_every_rows_flags_build_its_schedule(m):
    spec = P.ModelSpec(flash_attention=False, **MODEL)
    p = 4
    req = P.PlanRequest(spec, p, m, 40, vocab=P.VocabLever("both"))
    rows = [r for r in P.plan(req, jobs=1) if "error" not in r]
    assert {r.get("search_effort") for r in rows} >= {"quick", None}
    for r in rows:
        built = _training(r["flags"], p, m)
        sched, setting = row_schedule(req, r)
        assert [list(o) for o in built.schedule.orders] == [list(o) for o in sched.orders], r["flags"]
        # the same schedule, timed in training's units (the busiest rank's F): the row's time
        unit_s = max(setting.rank_values("cost_f", sched.placement))
        assert built.result.makespan * unit_s == pytest.approx(r["makespan_s"], rel=1e-9), r["flags"]
