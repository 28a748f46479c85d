"""Every schedule the core builds stays what it was: a fingerprint of the generated (and lowered)
orders over a grid of names x P x M x costs x memory limits x offload options, held against
``tests/data/schedule_fingerprints.json``.

A change that alters a schedule on purpose regenerates the file (``python
tests/test_schedule_fingerprint.py --write``) in the same commit and says which cases changed and
why; a refactoring must leave every entry as it is.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "schedule_fingerprints.json")

COSTS = {
    "unit": {},
    "f1b2w1c": {"cost_f": [1.0], "cost_b": [2.0], "cost_w": [1.0], "cost_comm": 0.1},
    "uneven": {"cost_f": "ramp", "cost_b": [1.5], "cost_w": [0.7], "mem_w": "0.9"},
}
SEARCHED = ("zb-auto", "v-auto", "zeropp")


def _costs(name: str, p: int) -> dict:
    kw = dict(COSTS[name])
    if kw.get("cost_f") == "ramp":
        kw["cost_f"] = [1.0 + 0.25 * r for r in range(p)]
    if kw.get("mem_w") == "0.9":
        kw["mem_w"] = [0.9]
    return kw


def cases():
    """(key, request fields) over the grid; the key names the case in the JSON file."""
    from megatron_zb.core import schedules
    for name in schedules.names():
        for p in (2, 4):
            for m in sorted({2, p, 2 * p + 1 if p == 2 else 2 * p}):
                for cname in COSTS:
                    limits = [None]
                    if name in SEARCHED:
                        limits += [p / 2 + 1, 2.0 * p]
                    for lim in limits:
                        yield (f"{name} p{p} m{m} {cname} lim{lim}",
                               dict(name=name, p=p, m=m, costs=_costs(cname, p), memory_limit=lim, offload=None))
                for off_name, off in (("r0.5k0.5", dict(ratio=0.5, time=0.5)),
                                      ("r1k2half", dict(ratio=1.0, time=2.0, overlap=False)),
                                      ("autok0.5", dict(ratio="auto", time=0.5)),
                                      ("r1k0.5c1", dict(ratio=1.0, time=0.5, chunks=1))):
                    lim = p / 2 + 0.5 if off["ratio"] == "auto" else None
                    yield (f"{name} p{p} m{m} unit off:{off_name}",
                           dict(name=name, p=p, m=m, costs={}, memory_limit=lim, offload=off))


def build_one(case: dict):
    """The schedule and its lowered form for one case, as the product builds them."""
    from megatron_zb.core.build import OffloadRequest, ScheduleRequest, build
    off = case["offload"]
    req = ScheduleRequest(name=case["name"], memory_limit=case["memory_limit"],
                          offload=None if off is None else OffloadRequest(**off), **case["costs"])
    built = build(req, case["p"], case["m"])
    return built.schedule, built.lowered()


def fingerprint(case: dict) -> str:
    from megatron_zb.core.ir import ScheduleError
    try:
        sched, low = build_one(case)
        text = repr((sched.placement, [[str(a) for a in o] for o in sched.orders],
                     [[str(a) for a in o] for o in low.orders]))
    except ScheduleError:
        text = "error"  # the refusal itself; its wording is the tools' business (tests/test_cli.py)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def compute() -> dict:
    return {key: fingerprint(case) for key, case in cases()}


def test_every_schedule_is_what_it_was():
    with open(DATA) as f:
        want = json.load(f)
    got = compute()
    assert set(got) == set(want), f"grid changed: added {sorted(set(got) - set(want))[:5]}, " \
                                  f"removed {sorted(set(want) - set(got))[:5]}"
    changed = sorted(k for k in got if got[k] != want[k])
    assert not changed, f"{len(changed)} of {len(got)} schedules changed, e.g. {changed[:8]}"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    if sys.argv[1:] == ["--write"]:
        fp = compute()
        with open(DATA, "w") as f:
            json.dump(fp, f, indent=0, sort_keys=True)
            f.write("\n")
        print(f"wrote {len(fp)} fingerprints to {DATA}")
    else:
        print(__doc__)
