"""Validator errors name rank, position and pass; JSON and torch-CSV round trips."""
import pytest

from megatron_zb.core.ir import io as sio
from megatron_zb.core.ir import B, BW, F, W, Action, Placement, Schedule, ScheduleError, Setting
from megatron_zb.core.schedules import generate, names, get
from megatron_zb.core.sim.simulate import simulate
from megatron_zb.core.sim.validate import validate


def two_rank(orders, m=1):
    return Schedule("t", Placement.single(2), m, orders)


def test_deadlock_named():
    s = two_rank([[Action(BW, 0, 0), Action(F, 0, 0)], [Action(F, 1, 0), Action(BW, 1, 0)]])
    with pytest.raises(ScheduleError, match=r"rank 0 at position 0 waits in BW0.0"):
        validate(s)


def test_deadlock_names_the_pass_that_comes_too_late():
    import pickle
    from megatron_zb.core.sim.simulate import Deadlock
    # rank 0 runs F0.1 only after BW0.0, which needs rank 1's B1.0, which rank 1 runs after F1.1,
    # which needs F0.1: a cycle across the two ranks; the message names both waits
    s = two_rank([[Action(F, 0, 0), Action(BW, 0, 0), Action(F, 0, 1), Action(BW, 0, 1)],
                  [Action(F, 1, 0), Action(F, 1, 1), Action(BW, 1, 0), Action(BW, 1, 1)]], m=2)
    with pytest.raises(Deadlock) as ei:
        simulate(s, Setting(2, 2))
    msg = str(ei.value)
    assert msg.startswith("schedule deadlocks: B1.0 at rank 1 position 2 comes too late: rank 0 position 1 (BW0.0) "
                          "waits for it, while rank 1 position 1 (F1.1) waits for F0.1 from rank 0; stuck:"), msg
    assert str(pickle.loads(pickle.dumps(ei.value))) == msg


def test_missing_and_duplicate_and_wrong_rank():
    with pytest.raises(ScheduleError, match="missing W"):
        validate(two_rank([[Action(F, 0, 0), Action(B, 0, 0)], [Action(F, 1, 0), Action(BW, 1, 0)]]))
    with pytest.raises(ScheduleError, match="appears twice"):
        validate(two_rank([[Action(F, 0, 0), Action(F, 0, 0), Action(BW, 0, 0)], [Action(F, 1, 0), Action(BW, 1, 0)]]))
    with pytest.raises(ScheduleError, match=r"rank 1 position 0: F0.0 belongs to stage 0, which is placed on rank 0"):
        validate(two_rank([[Action(BW, 0, 0)], [Action(F, 0, 0), Action(F, 1, 0), Action(BW, 1, 0)]]))
    with pytest.raises(ScheduleError, match="both BW and B/W"):
        validate(two_rank([[Action(F, 0, 0), Action(B, 0, 0), Action(W, 0, 0), Action(BW, 0, 0)],
                           [Action(F, 1, 0), Action(BW, 1, 0)]]))
    with pytest.raises(ScheduleError, match="microbatch 3"):
        validate(two_rank([[Action(F, 0, 3)], []]))


def test_w_before_b_deadlocks():
    s = two_rank([[Action(F, 0, 0), Action(W, 0, 0), Action(B, 0, 0)], [Action(F, 1, 0), Action(BW, 1, 0)]])
    with pytest.raises(ScheduleError, match="W0.0"):
        validate(s)


def test_memory_limit():
    st = Setting(4, 8, memory_limit=3)
    with pytest.raises(ScheduleError, match=r"rank 0 position 3: F0.3 raises activation memory to 4, over the limit 3"):
        validate(generate("1f1b", st), st)
    validate(generate("1f1b", Setting(4, 8, memory_limit=4)), Setting(4, 8, memory_limit=4))


@pytest.mark.parametrize("name", names())
def test_json_round_trip(name):
    m = 8 if name == "bitpipe" else 6  # bitpipe: microbatches in units of the pipeline size
    st = Setting(4, m, chunks=get(name).default_chunks if get(name).chunks is None else None)
    s = generate(name, st)
    s2 = sio.from_json(sio.to_json(s))
    assert s2.orders == s.orders and s2.placement == s.placement and s2.num_microbatches == m
    assert s2.name == s.name


@pytest.mark.parametrize("name", [n for n in names() if get(n).models_per_rank is None])  # no replicas in CSV
def test_csv_round_trip(name):
    st = Setting(4, 6, chunks=get(name).default_chunks if get(name).chunks is None else None)
    s = generate(name, st)
    s2 = sio.from_csv(sio.to_csv(s))
    assert s2.orders == s.orders
    assert s2.placement.stage_to_rank == s.placement.stage_to_rank
    assert s2.placement.style == s.placement.style
    st2 = Setting(4, 6, chunks=s2.placement.chunks)
    assert simulate(s2, st2).makespan == simulate(s, st2).makespan


def test_csv_torch_format():
    text = "0F0,0F1,,0I0,0W0,0I1,0W1\n1F0,1B0,1F1,1B1\n"
    s = sio.from_csv(text)
    assert s.orders[0][2] == Action(B, 0, 0) and s.orders[0][3] == Action(W, 0, 0)
    assert s.orders[1][1] == Action(BW, 1, 0)
    validate(s)
    assert sio.to_csv(s).splitlines()[0] == "0F0,0F1,0I0,0W0,0I1,0W1"


def test_csv_errors():
    with pytest.raises(ScheduleError, match="cannot read 'X1'"):
        sio.from_csv("0F0,X1\n")
    with pytest.raises(ScheduleError, match="stage 0 also appears on rank 0"):
        sio.from_csv("0F0\n0B0\n")
    with pytest.raises(ScheduleError, match="empty"):
        sio.from_csv("\n")


def test_json_errors():
    with pytest.raises(ScheduleError, match="not valid JSON"):
        sio.from_json("{")
    with pytest.raises(ScheduleError, match="not a megatron-zb schedule"):
        sio.from_json("{}")


def test_setting_errors():
    with pytest.raises(ScheduleError, match="stages"):
        Setting(0, 4)
    with pytest.raises(ScheduleError, match="one value or one per stage"):
        Setting(4, 4, cost_f=[1, 2])
    with pytest.raises(ScheduleError, match="non-negative"):
        Setting(4, 4, cost_b=-1)
    assert Setting(4, 4, mem_w=2).mem_w == [2.0] * 4  # W holds more than F kept: full recompute
    with pytest.raises(ScheduleError, match="mem-w"):
        Setting(4, 4, mem_w=-1)


def test_overlap_pairs_round_trip_torch_format():
    s = generate("dualpipe-v", Setting(2, 6))
    text = sio.to_csv(s)
    assert "OVERLAP_F_B" in text and "(0F" in text
    s2 = sio.from_csv(text)
    assert s2.orders == s.orders
    assert sio.from_json(sio.to_json(s)).orders == s.orders
    with pytest.raises(ScheduleError, match="forward and a backward"):
        sio.from_csv("(0B0;1F0)OVERLAP_F_B\n")
