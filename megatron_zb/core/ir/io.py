"""Schedule I/O: our JSON, and torch.distributed.pipelining's compute-only CSV.

CSV: one row per rank, one cell per action, ``<stage><type><microbatch>`` with type F (forward),
I (input gradient = our B), W (weight gradient) or B (full backward = our BW). Empty cells are
idle slots and are dropped on import. The placement is inferred from which row holds a stage.
"""
from __future__ import annotations

import csv
import io
import json
import re
from typing import List

from . import ALL_KINDS, BW, OVERLAP, Action, B, F, Placement, Schedule, ScheduleError, W

FORMAT_VERSION = 1


def to_json(schedule: Schedule) -> str:
    return json.dumps({
        "format": "megatron-zb-schedule",
        "version": FORMAT_VERSION,
        "name": schedule.name,
        "microbatches": schedule.num_microbatches,
        "placement": schedule.placement.to_dict(),
        "meta": schedule.meta,
        "orders": [[_encode(a) for a in order] for order in schedule.orders],
    })


def _encode(a: Action):
    if a.kind == OVERLAP:
        return [a.kind, _encode(a.parts[0]), _encode(a.parts[1])]
    return [a.kind, a.stage, a.mb] if a.peer is None else [a.kind, a.stage, a.mb, a.peer]


def _decode(item, where: str) -> Action:
    if isinstance(item, list) and len(item) == 3 and item[0] == OVERLAP:
        return Action.overlap(_decode(item[1], where), _decode(item[2], where))
    if not (isinstance(item, list) and len(item) in (3, 4) and item[0] in ALL_KINDS and item[0] != OVERLAP):
        raise ScheduleError(f"{where}: bad action {item!r}; expected [kind, stage, microbatch(, peer)] "
                            f"or [\"{OVERLAP}\", [F...], [B...]]")
    if not all(_is_int(x) for x in item[1:]):
        raise ScheduleError(f"{where}: bad action {item!r}; stage, microbatch and peer are integers")
    return Action(item[0], int(item[1]), int(item[2]), int(item[3]) if len(item) == 4 else None)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def from_json(text: str) -> Schedule:
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ScheduleError(f"schedule JSON is not valid JSON: {e}") from None
    if not isinstance(d, dict) or d.get("format") != "megatron-zb-schedule":
        raise ScheduleError("not a megatron-zb schedule JSON (expected \"format\": \"megatron-zb-schedule\")")
    missing = [k for k in ("orders", "placement", "microbatches") if k not in d]
    if missing:
        raise ScheduleError(f"schedule JSON lacks {', '.join(missing)} (a megatron-zb schedule has orders, placement "
                            "and microbatches)")
    if not isinstance(d["orders"], list) or not all(isinstance(row, list) for row in d["orders"]):
        raise ScheduleError("schedule JSON: orders must be a list with one list of actions per rank")
    pl = d["placement"]
    if not (isinstance(pl, dict) and isinstance(pl.get("stage_to_rank"), list)
            and all(_is_int(r) for r in pl["stage_to_rank"])
            and (pl.get("paths") is None or (isinstance(pl["paths"], list) and all(
                isinstance(p, list) and all(_is_int(x) for x in p) for p in pl["paths"])))):
        raise ScheduleError("schedule JSON: placement must be {\"stage_to_rank\": [rank of each stage, integers], "
                            "\"paths\": [[stages], ...] (optional)}")
    if not _is_int(d["microbatches"]) or d["microbatches"] < 1:
        raise ScheduleError(f"schedule JSON: microbatches must be an integer >= 1, got {d['microbatches']!r}")
    orders = []
    for r, row in enumerate(d["orders"]):
        orders.append([_decode(item, f"rank {r} position {i}") for i, item in enumerate(row)])
    meta = d.get("meta", {})
    return Schedule(str(d.get("name", "custom")), Placement.from_dict(pl), int(d["microbatches"]), orders,
                    meta if isinstance(meta, dict) else {})


_TO_TORCH = {F: "F", B: "I", W: "W", BW: "B"}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}
_CELL = re.compile(r"^\s*(\d+)\s*(F|I|W|B)\s*(\d+)\s*$")
_PAIR = re.compile(r"^\s*\(([^;()]+);([^;()]+)\)\s*OVERLAP_F_B\s*$")


def _cell(a: Action) -> str:
    if a.kind == OVERLAP:
        return f"({_cell(a.parts[0])};{_cell(a.parts[1])}){OVERLAP}"
    return f"{a.stage}{_TO_TORCH[a.kind]}{a.mb}"


def to_csv(schedule: Schedule) -> str:
    if schedule.placement.replicated:
        raise ScheduleError(f"{schedule.name} replicates stages on several ranks, which torch's CSV cannot "
                            "express (a stage lives on one rank there); save it as .json")
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    for r, order in enumerate(schedule.orders):
        w.writerow([_cell(a) for a in order if a.is_compute])
    return out.getvalue()


def from_csv(text: str, name: str = "csv") -> Schedule:
    rows = [row for row in csv.reader(io.StringIO(text))]
    while rows and not any(c.strip() for c in rows[-1]):
        rows.pop()
    if not rows:
        raise ScheduleError("CSV schedule is empty: expected one row per rank")
    orders: List[List[Action]] = []
    stage_rank = {}
    max_mb = -1
    for r, row in enumerate(rows):
        order = []
        for col, cell in enumerate(row):
            if not cell.strip():
                continue  # idle slot
            pair = _PAIR.match(cell)
            texts = [pair.group(1), pair.group(2)] if pair else [cell]
            acts = []
            for text in texts:
                mt = _CELL.match(text)
                if not mt:
                    raise ScheduleError(f"CSV row {r} (rank {r}) column {col}: cannot read {cell!r}; expected "
                                        "<stage><F|I|W|B><microbatch>, e.g. 0F3 or 1I2, or (0F3;7B1)OVERLAP_F_B")
                stage, kind, mb = int(mt.group(1)), _FROM_TORCH[mt.group(2)], int(mt.group(3))
                prev = stage_rank.setdefault(stage, r)
                if prev != r:
                    raise ScheduleError(f"CSV row {r} column {col}: stage {stage} also appears on rank {prev}; "
                                        "each stage must live on one rank")
                max_mb = max(max_mb, mb)
                acts.append(Action(kind, stage, mb))
            order.append(Action.overlap(*acts) if pair else acts[0])
        orders.append(order)
    n = max(stage_rank) + 1 if stage_rank else 0
    missing = [s for s in range(n) if s not in stage_rank]
    if missing:
        few = ", ".join(str(x) for x in missing[:5]) + (f", ... ({len(missing)} in all)" if len(missing) > 5 else "")
        raise ScheduleError(f"CSV schedule never runs stage(s) {few}; stages must be 0..{n - 1}")
    placement = infer_placement([stage_rank[s] for s in range(n)], len(orders))
    return Schedule(name, placement, max_mb + 1, orders)


def infer_placement(stage_to_rank: List[int], num_ranks: int) -> Placement:
    p = num_ranks
    st = tuple(stage_to_rank)
    if st == Placement.single(p).stage_to_rank:
        return Placement.single(p)
    if len(st) % p == 0 and st == Placement.looped(p, len(st) // p).stage_to_rank:
        return Placement.looped(p, len(st) // p)
    if len(st) == 2 * p and st == Placement.vshape(p).stage_to_rank:
        return Placement.vshape(p)
    return Placement(st, "custom")
