"""The tools never trace back: random, mostly malformed command lines and files for every schedule
subcommand end with exit code 0, or 2 and one line on stderr (hypothesis)."""
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_zb.cli import main

NUMBERS = ["0", "-1", "1", "2", "3", "4", "0.5", "1e9", "100000", "nan", "inf", "-inf", "abc", "", "2,3", "1,,2"]
SMALL = ["0", "-1", "1", "2", "3", "4", "100000", "abc", "1.5"]


def _files(tmp):
    os.makedirs(os.path.join(tmp, "adir.json"), exist_ok=True)
    files = {
        "missing": os.path.join(tmp, "missing.json"),
        "dir": os.path.join(tmp, "adir.json"),
        "binary": os.path.join(tmp, "binary.json"),
        "junk": os.path.join(tmp, "junk.json"),
        "empty_schedule": os.path.join(tmp, "empty.json"),
        "bad_stage": os.path.join(tmp, "bad_stage.json"),
        "csv_far": os.path.join(tmp, "far.csv"),
        "csv_text": os.path.join(tmp, "text.csv"),
        "profile_list": os.path.join(tmp, "profile_list.json"),
        "profile_neg": os.path.join(tmp, "profile_neg.json"),
        "under_file": os.path.join(tmp, "junk.json", "x.json"),
        "no_folder": os.path.join(tmp, "nope", "x.png"),
    }
    with open(files["binary"], "wb") as f:
        f.write(bytes(range(256)))
    texts = {
        "junk": '{"orders": 3}',
        "empty_schedule": '{"format": "megatron-zb-schedule"}',
        "bad_stage": '{"format": "megatron-zb-schedule", "orders": [[["F", 1.5, 0]]], '
                     '"placement": {"stage_to_rank": [0, 0]}, "microbatches": 1}',
        "csv_far": "100000F0\n",
        "csv_text": "hello,world\n",
        "profile_list": '{"cost_f": [[1]], "cost_b": "x", "cost_w": 1}',
        "profile_neg": '{"cost_f": -1, "cost_b": 1, "cost_w": 1}',
    }
    for k, t in texts.items():
        with open(files[k], "w") as f:
            f.write(t)
    return files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return _files(str(tmp_path_factory.mktemp("fuzz")))


def _flag(name, values):
    return st.tuples(st.just(name), st.sampled_from(values))


def _schedule_flags(files):
    paths = list(files.values())
    return st.lists(st.one_of(
        _flag("--schedule", ["zb-h1", "zb-v", "v-auto", "bitpipe", "interleaved-1f1b", "nope", ""]),
        _flag("--load", paths),
        _flag("--stages", SMALL), _flag("--microbatches", SMALL), _flag("--chunks", SMALL),
        _flag("--cost-f", NUMBERS), _flag("--cost-b", NUMBERS), _flag("--cost-w", NUMBERS),
        _flag("--cost-comm", NUMBERS), _flag("--mem-f", NUMBERS), _flag("--mem-w", NUMBERS),
        _flag("--memory-limit", NUMBERS), _flag("--offload-ratio", ["0", "0.5", "1", "2", "auto", "x"]),
        _flag("--offload-time", NUMBERS), _flag("--offload-chunk-num", SMALL),
        _flag("--cost-optimizer", NUMBERS), _flag("--save", paths + [files["missing"]]),
    ), max_size=7)


def _check(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's --help
        rc = e.code
    err = capsys.readouterr().err
    assert rc in (0, 2), f"{argv}: exit {rc}\n{err}"
    if rc == 2:
        lines = [l for l in err.splitlines() if l.strip()]
        assert len(lines) == 1 and "Traceback" not in err, f"{argv}: {err!r}"
        assert len(lines[0]) < 400, f"{argv}: a {len(lines[0])}-character error line"


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_simulate_compare_plot_never_trace_back(files, capsys, data):
    cmd = data.draw(st.sampled_from(["simulate", "compare", "plot"]))
    flags = data.draw(_schedule_flags(files))
    argv = [cmd] + [x for kv in flags for x in kv]
    if cmd == "plot":
        argv += ["--out", data.draw(st.sampled_from([files["no_folder"], files["dir"], files["under_file"],
                                                      os.path.join(os.path.dirname(files["dir"]), "t.json"),
                                                      os.path.join(os.path.dirname(files["dir"]), "t.txt")]))]
    _check(argv, capsys)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_plan_never_traces_back(files, capsys, data):
    base = {"--num-layers": data.draw(st.sampled_from(["8", "3", "0", "x", "1"])),
            "--hidden-size": data.draw(st.sampled_from(["64", "63", "0"])),
            "--num-attention-heads": data.draw(st.sampled_from(["4", "3", "0"])),
            "--seq-length": data.draw(st.sampled_from(["64", "-1"])),
            "--pipeline-parallel-size": data.draw(st.sampled_from(["2", "1", "4", "100000", "0"])),
            "--num-microbatches": data.draw(st.sampled_from(["4", "0", "3"]))}
    extra = data.draw(st.lists(st.one_of(
        _flag("--tensor-parallel-size", ["1", "2", "3", "0"]), _flag("--efficiency", NUMBERS),
        _flag("--peak-tflops", NUMBERS), _flag("--gpu-memory-gb", NUMBERS),
        _flag("--profile", [files["profile_list"], files["profile_neg"], files["dir"], files["binary"],
                            files["missing"]]),
        _flag("--offload-ratio", ["0.5", "auto", "3"]), _flag("--host-link-gbps", NUMBERS),
        _flag("--offload-time", NUMBERS), _flag("--micro-batch-size", SMALL),
    ), max_size=4))
    argv = ["plan", "--jobs", "1"] + [x for kv in base.items() for x in kv] + [x for kv in extra for x in kv]
    _check(argv, capsys)


@pytest.mark.parametrize("argv", [
    ["--schedule", "zb-h1", "-p", "1000"],                    # 1000 processes
    ["--schedule", "zb-h1", "-p", "2", "-m", "100000"],       # far too many microbatches
    ["--schedule", "zb-h1", "-p", "2", "--memory-limit", "-1"],
    ["--schedule", "zb-h1", "-p", "2", "--memory-limit", "nan"],
    ["--schedule", "zb-h1", "-p", "2", "--lr", "nan"],
    ["--schedule", "zb-h1", "-p", "2", "--param-rtol", "-1"],
    ["--schedule", "zb-h1", "-p", "2", "--clip-grad", "inf"],
    ["--schedule", "zb-h1", "-p", "2", "--inject-nonfinite-at", "7"],
    ["--schedule", "zb-h1", "-p", "2", "--timeout", "0"],
    ["--schedule", "nope", "-p", "2"],
])
@pytest.mark.timing
def test_verify_refuses_bad_input_before_starting_ranks(argv, capsys, monkeypatch):
    from megatron_zb.verify import command
    launched = []  # the launch is the one way ranks start: refused input never reaches it

    def no_launch(*a, **k):
        launched.append(a)
        raise AssertionError("verify launched ranks for input it should have refused")
    monkeypatch.setattr(command, "run_verify_many", no_launch)
    rc = main(["verify"] + argv)
    err = capsys.readouterr().err
    assert not launched, "checked before any rank started"
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
