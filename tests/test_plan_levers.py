"""The memory levers searched together (issue 55): properties of plan's answer on a public model
shape under budgets from roomy to tight, and Megatron's best fitting configuration as the reference."""
import dataclasses

import pytest

from megatron_zb.core import plan as P
from megatron_zb.core.costs.model import ModelSpec
from megatron_zb.core.costs.models import spec_kwargs
from megatron_zb.core.plan.baseline import megatron_baseline
from megatron_zb.core.schedules import get
from megatron_zb.core.schedules.search.auto import TIE

SPEC = ModelSpec(**spec_kwargs("llama-3.2-1b", seq_length=4096), split_overhead_s=0.4e-3)
KEY = "iteration_time_s"
# a fixed-memory schedule of each family, one searched under the limit, Megatron's two
SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zb-v", "v-half", "dualpipe-v", "v-auto")


def _plan(gb, **kw):
    return P.plan(P.PlanRequest(SPEC, 4, 8, gb, schedules=SCHEDULES, vocab=P.VocabLever("both", embedding=True), **kw),
                  jobs=1)


def _best(rows):
    fit = [r for r in rows if "error" not in r and r["fits"]]
    return fit[0] if fit else None


@pytest.fixture(scope="module")
def plans():
    out = {}
    for gb in (12.0, 8.0):
        out[gb, "plain"] = _plan(gb)
        out[gb, "offload"] = _plan(gb, offload=P.OffloadLever("auto", host_link_gbps=50.0))
    return out


@pytest.mark.parametrize("gb", [12.0, 8.0])
def test_a_lever_added_never_makes_the_best_fitting_row_worse(plans, gb):
    plain, off = _best(plans[gb, "plain"]), _best(plans[gb, "offload"])
    assert plain is not None and off is not None
    assert off[KEY] <= plain[KEY] * (1 + 1e-9)


@pytest.mark.parametrize("gb", [12.0, 8.0])
@pytest.mark.parametrize("how", ["plain", "offload"])
def test_the_suggested_row_is_the_fastest_that_fits(plans, gb, how):
    rows = [r for r in plans[gb, how] if "error" not in r]
    fit = [r for r in rows if r["fits"]]
    assert rows[0] is fit[0] and all(fit[0][KEY] <= r[KEY] * (1 + TIE) for r in fit)


@pytest.mark.parametrize("gb", [12.0, 8.0])
def test_a_vocab_row_of_a_fixed_memory_schedule_is_never_slower_than_its_plain_twin(plans, gb):
    rows = [r for r in plans[gb, "plain"] if "error" not in r and r["fits"]]
    plain = {r["schedule"]: r for r in rows if not r.get("vocab_parallel") and not r.get("recompute_layers")}
    for r in rows:
        twin = plain.get(r["schedule"])
        if r.get("vocab_parallel") and twin is not None and not get(r["schedule"]).searched \
                and not r.get("recompute_layers"):
            assert r[KEY] <= twin[KEY] * (1 + TIE), (r["schedule"], r[KEY], twin[KEY])


def test_a_vocab_row_made_to_fit_is_placed_again_with_its_own_levers():
    """vocab_twins places a quick +vocab row's passes again in full with the recompute and offload
    fit_rows gave it (a row built without them would not fit: the search would be wasted), and the
    row kept carries those levers' flags."""
    from megatron_zb.core.plan.levers import vocab_twins
    req = P.PlanRequest(SPEC, 4, 8, 8.0, offload=P.OffloadLever("auto", host_link_gbps=50.0))
    base = dict(fits=True, flags="--x", layout="Et|t|t|tL")
    plain = dict(base, schedule="zb-h1", iteration_time_s=1.0, recompute_layers=[1, 0, 0, 0])
    vocab = dict(base, schedule="zb-h1", vocab_parallel=1, iteration_time_s=1.2, search_effort="quick",
                 recompute_layers=[2, 1, 0, 0], offload={"time": 0.0})
    asked = []

    def build(name, v, r, effort):
        asked.append((name, v, r, effort))
        return dict(base, schedule=name, vocab_parallel=v, iteration_time_s=1.1, search_effort=effort)

    out = vocab_twins([plain, vocab], req, build)
    (name, v, r, effort), = asked
    assert (name, v, effort) == ("zb-h1", 1, "full")
    assert r.model.recompute_counts == (2, 1, 0, 0) and r.offload == req.offload  # the row's own levers
    assert r.layout == "Et|t|t|tL"  # and layout
    assert out[0] is plain and out[1]["iteration_time_s"] == 1.1 and out[1]["recompute_layers"] == [2, 1, 0, 0]
    assert "--zero-bubble-recompute-num-layers 2,1,0,0" in out[1]["flags"]
    # a row that fit without offload under 'auto' is placed again without it
    asked.clear()
    vocab_twins([plain, {k: x for k, x in vocab.items() if k != "offload"}], req, build)
    assert asked[0][2].offload is None


def test_recompute_makes_a_row_fit_and_its_flags_say_so(plans):
    rc = [r for r in plans[8.0, "plain"] if "error" not in r and r.get("recompute_layers") and r["fits"]]
    assert rc
    for r in rc:
        assert "--recompute-granularity full --recompute-method block" in r["flags"]
        counts = r["recompute_layers"]
        assert (f"--zero-bubble-recompute-num-layers {','.join(map(str, counts))}" in r["flags"]) == \
            (len(set(counts)) > 1)


def test_megatron_baseline_between_full_recompute_and_no_memory_limit():
    for gb in (12.0, 10.0):
        req = P.PlanRequest(SPEC, 4, 8, gb)
        base, why = megatron_baseline(req)
        assert base is not None and why is None and base["fits"]
        assert "--zero-bubble" not in base["flags"]
        full = dataclasses.replace(SPEC, recompute="full", recompute_method="uniform")
        slowest = P.one_row("1f1b", None, req.replace(model=full), "full", False)
        assert base[KEY] <= slowest[KEY] * (1 + 1e-9)
        roomy = min(P.one_row(n, None, req.replace(gpu_memory_gb=1000.0, interleave_chunks=v), "full", False)[KEY]
                    for n, v in (("1f1b", 2), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4)))
        assert base[KEY] >= roomy * (1 - 1e-9)
    base, why = megatron_baseline(P.PlanRequest(SPEC, 4, 8, 6.0))
    assert base is None and "no configuration of Megatron's own" in why


def test_plan_json_has_the_baseline_and_each_rows_speedup_over_it(capsys):
    import json

    from megatron_zb.cli import main
    assert main(["plan", "--model", "llama-3.2-1b", "--pipeline-parallel-size", "4", "--num-microbatches", "8",
                 "--gpu-memory-gb", "12", "--jobs", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    base = d["megatron_baseline"]
    assert set(base) >= {"schedule", "flags", "iteration_time_s", "peak_bytes", "fits"} and d["megatron_baseline_reason"] is None
    for r in d["rows"]:
        if "error" not in r:
            assert r["speedup_vs_megatron"] == round(base["iteration_time_s"] / r["iteration_time_s"], 4)
    assert main(["plan", "--model", "llama-3.2-1b", "--pipeline-parallel-size", "4", "--num-microbatches", "8",
                 "--gpu-memory-gb", "12", "--jobs", "1"]) == 0
    assert "vs Megatron: against Megatron's best configuration that fits" in capsys.readouterr().out


def test_an_interleaved_row_takes_the_faster_of_2_and_4_chunks_per_rank_and_its_flags_build_it():
    """Chunks per rank are a lever too: an interleaved row tries CHUNK_CHOICES (fits first, then time),
    a layout or --num-virtual-stages-per-pipeline-rank pins the count, and the row's schedule is
    rebuilt with its own count (row_schedule), the same time."""
    from megatron_zb.core.plan.schedule import row_schedule
    from megatron_zb.core.sim.iteration import iteration_times
    req = P.PlanRequest(SPEC, 4, 8, 1000.0)
    assert P.CHUNK_CHOICES == (2, 4) and req.interleave_chunks is None
    each = {v: P.one_row("interleaved-zb", None, req.replace(interleave_chunks=v)) for v in P.CHUNK_CHOICES}
    r = P.one_row("interleaved-zb", None, req)
    best = min(each.values(), key=lambda x: (x[KEY], x["chunks"]))
    assert (r["chunks"], r[KEY]) == (best["chunks"], best[KEY])
    for v, x in each.items():
        assert x["chunks"] == v and f"--num-virtual-stages-per-pipeline-rank {v}" in x["flags"]
        assert len(x["layers_per_stage"]) == 4 * v
        assert P.one_row("interleaved-zb", None, req.replace(layout=x["layout"]))["chunks"] == v
        sched, st = row_schedule(req, x)
        assert st.chunks == v and iteration_times(sched, st, 0.0).iteration_time == pytest.approx(x[KEY], rel=1e-9)
    # a recompute variant keeps the row's own chunks: its counts are per model chunk of that layout
    from megatron_zb.core.plan import levers
    four = each[4]
    tight = req.replace(gpu_memory_gb=max(four["peak_bytes"]) / 1024 ** 3 - 0.3)
    done = levers._recompute(dict(four, fits=False), tight,
                             lambda n, v, q, fit_only=False: P.one_row(n, v, q, "full", True, fit_only))
    assert done is not None
    row, counts = done
    assert row["chunks"] == 4 and len(counts) == 16 and row["fits"]


def test_plan_takes_megatrons_virtual_stages_flag(capsys):
    from megatron_zb.cli import main
    import json
    args = ["plan", "--model", "llama-3.2-1b", "--pipeline-parallel-size", "4", "--num-microbatches", "8",
            "--schedules", "interleaved-zb", "--no-vocab-parallel", "--jobs", "1"]
    assert main(args + ["--num-virtual-stages-per-pipeline-rank", "4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["chunks"] for r in rows if r["schedule"] == "interleaved-zb"] == [4]
    assert main(args) == 0
    assert "interleaved-zb x" in capsys.readouterr().out  # the table names the count
    assert main(args + ["--num-virtual-stages-per-pipeline-rank", "5"]) == 0  # more chunks than layers: its row says so
    assert "interleaved-zb    n/a: 16 layers < 20 model chunks" in capsys.readouterr().out
    assert main(args + ["--num-virtual-stages-per-pipeline-rank", "1"]) == 2
    err = capsys.readouterr().err
    assert "--num-virtual-stages-per-pipeline-rank is 2 or more" in err and len(err.strip().splitlines()) <= 2


def test_a_row_far_behind_the_rows_the_levers_made_fit_is_not_searched_again_in_full(plans):
    """The levers come before plan's full searches: at 8 GiB the quick v-auto +vocab row fits but lies
    far behind the row recompute made fit, so it keeps its quick search (searched in full before the
    levers, it cost seconds for a row that could not lead)."""
    rows = [r for r in plans[8.0, "plain"] if "error" not in r]
    best = _best(rows)
    assert best.get("recompute_layers")
    auto = next(r for r in rows if r["schedule"] == "v-auto" and r.get("vocab_parallel"))
    assert P.margin(auto, 4, 8) is not None
    assert auto["fits"] and auto["search_effort"] == "quick" and auto[KEY] > best[KEY] * (1 + P.FULL_MARGIN)


def test_a_lever_variant_that_may_lead_is_searched_again_in_full_with_its_levers(monkeypatch):
    """A quick row made to fit by recompute that leads is searched again in full with the same
    recompute per chunk (its flags and schedule those of the full search)."""
    calls = []
    one = P.one_row

    def spy(name, vocab, req, effort="full", tighten=True, fit_only=False):
        calls.append((name, effort, req.model.recompute_counts))
        return one(name, vocab, req, effort, tighten, fit_only)

    monkeypatch.setattr(P, "one_row", spy)
    rows = P.plan(P.PlanRequest(SPEC, 4, 8, 8.0, schedules=("v-half", "v-min"),
                                vocab=P.VocabLever("on", embedding=True)), jobs=1)
    best = _best(rows)
    assert best["schedule"] == "v-half" and best["search_effort"] == "full" and best.get("recompute_layers")
    counts = tuple(best["recompute_layers"])
    assert ("v-half", "quick", counts) in calls and ("v-half", "full", counts) in calls
    assert ("v-half", "full", None) not in calls  # the row without its levers is not searched in full
    assert "--zero-bubble-search-effort" not in best["flags"] and "--recompute-num-layers" in best["flags"]


def test_front_light_moves_a_layer_from_each_ranks_first_chunk_to_its_second():
    from megatron_zb.core.costs.layout import parse
    from megatron_zb.core.costs.layout_search import front_light
    lay = parse("Ett|(tt|)*15,(t*3|)*15,t*3L", 8)
    light = front_light(lay, 8)
    assert str(light) == "Et|(t|)*7,(t*3|)*23,t*3L"
    per_rank = [sum(light.layers()[r::8]) for r in range(8)]
    assert per_rank == [sum(lay.layers()[r::8]) for r in range(8)]  # every rank keeps its layers
    assert front_light(parse("Et|(t|)*30,tL", 8), 8) is None  # one layer per chunk: none to give up
    assert front_light(parse("Et*4|(t*4|)*6,t*4L", 8), 8) is None  # one chunk per rank


def test_a_looped_row_fits_with_its_first_chunks_lighter_where_recompute_alone_does_not():
    """At 7 GiB no recompute of interleaved 1F1B +vocab's balanced layout fits (raised a layer at a
    time, ``RAISES`` times); its layout with each rank's first chunk a layer lighter, with recompute,
    does, and the row's flags carry that layout (Megatron's own flag)."""
    rows = P.plan(P.PlanRequest(SPEC, 4, 8, 7.0, schedules=("interleaved-1f1b",), interleave_chunks=2,
                                vocab=P.VocabLever("on", embedding=True)), jobs=1)
    best = _best(rows)
    assert best is not None and best["layout"] == "Et|(t|)*3,(t*3|)*3,t*3L" and best.get("recompute_layers")
    assert best["front_light"]
    assert "--pipeline-model-parallel-layout 'Et|(t|)*3,(t*3|)*3,t*3L'" in best["flags"]
    assert max(best["peak_bytes"]) <= 7.0 * 1024 ** 3


def test_the_lighter_first_chunks_only_on_plans_own_layouts_of_a_looped_placement():
    """The lever's request (plan's rows and Megatron's baseline): the row's chunks per rank, never the
    user's layout nor under --no-layout-search, nothing where a chunk holds one layer or the
    placement is not looped."""
    from megatron_zb.core.plan.levers import light_request
    req = P.PlanRequest(SPEC, 4, 8, 7.0)
    row = {"schedule": "interleaved-1f1b", "chunks": 2, "layout": "Ett|(tt|)*6,ttL"}
    light = light_request(row, req)
    assert light.layout == "Et|(t|)*3,(t*3|)*3,t*3L" and light.interleave_chunks == 2
    assert light_request(row, req.replace(layout="Ett|(tt|)*6,ttL")) is None  # the user's layout stays
    assert light_request(row, req.replace(layout_search=False)) is None  # --no-layout-search: the even split
    assert light_request(dict(row, chunks=4, layout="Et|(t|)*14,tL"), req) is None
    assert light_request({"schedule": "zb-v", "chunks": 2, "layout": "Et*4|(t*4|)*2,t*4L"}, req) is None


def test_rank_shifts_move_a_layer_between_the_chunks_of_the_ranks_holding_the_ends():
    from megatron_zb.core.costs.layout import parse
    from megatron_zb.core.costs.layout_search import rank_shifts
    from megatron_zb.core.ir import Placement
    v = Placement.vshape(4)  # rank 0 holds the first and the last chunk
    assert [str(x) for x in rank_shifts(parse("Et*4|(t*4|)*6,t*4L", 4), v)] == \
        ["Et*3|(t*4|)*6,t*5L", "Et*5|(t*4|)*6,t*3L"]
    looped = Placement.looped(2, 2)  # rank 0 holds stages 0 and 2, rank 1 (the loss) 1 and 3
    assert [x.layers() for x in rank_shifts(parse("Ett|tt|tt|ttL", 2), looped)] == [[1, 1, 3, 3], [3, 3, 1, 1]]
    assert rank_shifts(parse("Et|t|t|tL", 2), looped) == []  # every chunk keeps a layer
    assert rank_shifts(parse("Et*4|t*4L", 2), Placement.looped(2, 1)) == []  # one chunk per rank


def test_a_vocab_twin_slower_than_its_plain_twin_tries_the_layouts_one_layer_away():
    """A +vocab row of a fixed-memory schedule, searched in full and slower than its plain twin, is
    built quickly on the layouts ``rank_shifts`` finds and on its twin's layout until one is as fast
    as the twin; the fastest that fits replaces it (a row with a lever keeps its layout: its recompute
    counts are per chunk of it)."""
    from megatron_zb.core.plan.levers import vocab_twins
    spec = dataclasses.replace(SPEC, num_layers=16)
    req = P.PlanRequest(spec, 4, 8, 80.0)
    base = dict(fits=True, flags="--x", chunks=2, search_effort="full")
    plain = dict(base, schedule="v-half", iteration_time_s=1.0, layout="Et*4|(tt|)*6,t*4L")
    vocab = dict(base, schedule="v-half", vocab_parallel=1, iteration_time_s=1.2, layout="Ett|(tt|)*6,ttL")
    asked, fast = [], {}

    def build(name, v, r, effort):
        asked.append((r.layout, effort))
        return dict(base, schedule=name, vocab_parallel=v, layout=r.layout, search_effort=effort,
                    iteration_time_s=fast.get(r.layout, 1.1 + 0.01 * len(asked)))

    fast[plain["layout"]] = 0.95
    out = vocab_twins([plain, vocab], req, build)
    layouts = [lay for lay, _ in asked]
    assert {effort for _, effort in asked} == {"quick"}
    assert layouts[:2] == ["Et|(tt|)*6,t*3L", "Et*3|(tt|)*6,tL"] and layouts[-1] == plain["layout"]
    assert vocab["layout"] not in layouts and len(set(layouts)) == len(layouts)
    assert out[1]["layout"] == plain["layout"] and out[1]["iteration_time_s"] == 0.95
    asked.clear()
    fast["Et|(tt|)*6,t*3L"] = 0.9  # as fast as the twin at the first: the others are not built
    assert vocab_twins([plain, vocab], req, build)[1]["iteration_time_s"] == 0.9 and len(asked) == 1
    asked.clear()
    vocab_twins([plain, dict(vocab, recompute_layers=[1] * 8)], req, build)
    assert asked == []
    vocab_twins([plain, vocab], dataclasses.replace(req, microbatches=128), build)  # P x M over SHIFTS_UP_TO
    assert asked == []
    vocab_twins([plain, vocab], req.replace(search="full"), build)  # a plan searching every row in full
    assert asked and {effort for _, effort in asked} == {"full"}
