"""Pictures and traces of simulated schedules (no torch, no megatron).

* ``plot_timeline(result, path)``: a PNG or SVG timeline in the style of the zero-bubble papers'
  figures: one row per rank (rank 0 on top), one box per pass coloured by kind, chunks 1+ of
  multi-chunk (interleaved / V) schedules drawn in a darker, hatched shade of the same colour.
* ``chrome_trace(result)`` / ``write_chrome_trace(result, path)``: Chrome-trace JSON that
  chrome://tracing and https://ui.perfetto.dev open; one process per rank, one complete ("X")
  event per pass (``ts``/``dur`` in microseconds, as the format defines them).
* ``save(result, path)``: picks one of the above from the file extension.
* With activation offload (``core.passes.offload``) each rank gets a host-link lane under its passes:
  offloads (D2H) in its upper half, reloads (H2D) in its lower half; in the trace they are the
  rank's threads 1 and 2.

Every function takes ``time_unit``, the unit of the costs the result was simulated with:
``"ms"`` (the default: the CLI's costs are read as milliseconds), ``"s"`` (a profile written while
training) or ``"us"``. The picture's time axis says its unit (ms for ``"s"`` and ``"ms"``); the
trace converts to microseconds and records the unit in its metadata.

matplotlib is imported only when a picture is drawn, through its object-oriented API with the
Agg canvas: nothing here switches the global backend or opens a window.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, List, Optional, Tuple

from .core.ir import B, BW, F, W
from .core.sim.simulate import SimResult, Timed

PICTURE_EXTENSIONS = (".png", ".svg")
TRACE_EXTENSIONS = (".json",)
ALLOWED_EXTENSIONS = PICTURE_EXTENSIONS + TRACE_EXTENSIONS

# Base colour per kind (chunk 0). Chunks 1+ are darkened and hatched.
KIND_COLORS: Dict[str, str] = {
    F: "#4C8BE2",   # blue
    B: "#2BA89A",   # teal
    W: "#A77BD8",   # violet
    BW: "#F0923A",  # orange
}
_KIND_ORDER = (F, B, W, BW)
# host-link transfers of activation offload (lane under each rank)
D2H_COLOR = "#D9705B"  # offload (device to host)
H2D_COLOR = "#6BAF5B"  # reload (host to device)
_HATCHES = ("", "/", "\\", "x", ".", "+")

# Unit of the costs -> microseconds (Chrome trace) and the unit the picture's axis shows.
TIME_UNITS = ("s", "ms", "us")
_US_PER = {"s": 1e6, "ms": 1e3, "us": 1.0}
_AXIS = {"s": ("ms", 1e3), "ms": ("ms", 1.0), "us": ("us", 1.0)}  # shown unit, factor

_LABEL_MAX = 4000  # never draw more labels than this (keeps huge schedules fast)


# ---------------------------------------------------------------------------------------------
# helpers


def _chunk_maps(result: SimResult) -> List[Dict[int, int]]:
    """Per rank: stage -> chunk index (0 = the rank's earliest stage in pipeline order).

    Same definition as ``Placement.chunk_of``, recovered from the stages each rank ran.
    """
    maps = []
    for tl in result.timeline:
        stages = sorted({t.action.stage for t in tl})
        maps.append({s: i for i, s in enumerate(stages)})
    return maps


def _shade(color: str, chunk: int) -> Tuple[float, float, float]:
    """Chunk 0: the base colour; chunk c >= 1: progressively darker."""
    from matplotlib.colors import to_rgb

    r, g, b = to_rgb(color)
    if chunk <= 0:
        return (r, g, b)
    k = max(0.35, 0.72 - 0.12 * (chunk - 1))  # fraction of the base colour kept
    return (r * k, g * k, b * k)


def _hatch(chunk: int) -> str:
    return _HATCHES[chunk % len(_HATCHES)] if chunk > 0 else ""


def _check_unit(time_unit: str) -> None:
    if time_unit not in TIME_UNITS:
        raise ValueError(f"time_unit must be one of {', '.join(TIME_UNITS)}, got {time_unit!r}")


def _default_title(result: SimResult, time_unit: str = "ms") -> str:
    extra = f", v={result.chunks}" if result.chunks > 1 else ""
    shown, k = _AXIS[time_unit]
    return (f"{result.schedule} (p={result.stages}, m={result.microbatches}{extra}): "
            f"makespan {result.makespan * k:.4g} {shown}, bubble {100.0 * result.bubble_rate:.1f}%")


# ---------------------------------------------------------------------------------------------
# picture


def plot_timeline(result: SimResult, path: str, title: Optional[str] = None, time_unit: str = "ms",
                  memory: Optional[List[List[dict]]] = None) -> None:
    """Draw ``result`` as a timeline picture; the format (.png or .svg) follows ``path``.
    ``time_unit``: the unit of the result's times (the axis shows ms for "s" and "ms").
    ``memory``: per rank, a run's measured activation trace (``runtime.observe.memory``: one
    ``{"pass": "F3.0", "bytes": ..., "predicted": ...}`` per pass): drawn under the timeline, each
    value at the end of its pass on this timeline, the prediction dashed."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in PICTURE_EXTENSIONS:
        raise ValueError(f"plot_timeline writes {', '.join(PICTURE_EXTENSIONS)} files, got {path!r}")
    _check_unit(time_unit)
    shown, k = _AXIS[time_unit]

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    nranks = len(result.timeline)
    default_title = _default_title(result, time_unit)
    if k != 1.0:  # draw in the unit the axis shows
        result = dataclasses.replace(result, timeline=[[t._replace(start=t.start * k, end=t.end * k)
                                                         for t in tl] for tl in result.timeline])
    passes = [t for tl in result.timeline for t in tl]
    t0 = min((t.start for t in passes), default=0.0)
    t1 = max((t.end for t in passes), default=1.0)
    if t1 <= t0:
        t1 = t0 + 1.0
    span = t1 - t0
    per_rank = max((len(tl) for tl in result.timeline), default=0)

    # Size: wide enough that boxes of long schedules stay visible, capped for huge ones.
    width_in = min(32.0, max(10.0, 8.0 + per_rank / 30.0))
    row_in = 0.42 if nranks <= 16 else 0.3
    bottom_in, top_in = 0.6, 0.45
    mem_in = 2.0 if memory else 0.0  # the memory panel under the timeline
    height_in = max(2.0, bottom_in + top_in + row_in * nranks) + mem_in
    dpi = 110
    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.06, (bottom_in + mem_in) / height_in, 0.80,
                       1.0 - (bottom_in + top_in + mem_in) / height_in))

    transfers = _transfers(result)
    bar_h = 0.8 if not transfers else 0.56
    bar_y = 0.0 if not transfers else -0.12  # compute bar centre relative to the rank's row
    chunk_maps = _chunk_maps(result)
    groups: Dict[Tuple[str, int], List[Timed]] = {}
    for r, tl in enumerate(result.timeline):
        for t in tl:
            groups.setdefault((t.action.kind, chunk_maps[r].get(t.action.stage, 0)), []).append(t)

    # White separators between boxes, unless boxes are so narrow the edges would swamp them.
    ax_w_px = 0.80 * width_in * dpi
    px_per_unit = ax_w_px / span
    widths = sorted(t.end - t.start for t in passes)
    typical_px = widths[len(widths) // 2] * px_per_unit if widths else 0.0
    edge_w = 0.5 if typical_px >= 8 else (0.25 if typical_px >= 4 else 0.0)
    handles = []
    multi_chunk = result.chunks > 1 or any(c > 0 for (_, c) in groups)
    for kind in sorted({k for k, _ in groups}, key=lambda k: (_KIND_ORDER + (k,)).index(k)):
        for chunk in sorted(c for k, c in groups if k == kind):
            ts = groups[(kind, chunk)]
            verts = []
            for t in ts:
                y0 = t.rank + bar_y - bar_h / 2
                y1 = t.rank + bar_y + bar_h / 2
                verts.append(((t.start, y0), (t.start, y1), (t.end, y1), (t.end, y0)))
            color = _shade(KIND_COLORS.get(kind, "#999999"), chunk)
            hatch = _hatch(chunk)
            coll = PolyCollection(verts, facecolors=[color], edgecolors="white",
                                  linewidths=edge_w, hatch=hatch or None)
            ax.add_collection(coll)
            label = f"{kind} chunk {chunk}" if multi_chunk else kind
            handles.append(Patch(facecolor=color, edgecolor="white", hatch=hatch or None,
                                 label=label))

    if transfers:  # the host-link lane: D2H in its upper half, H2D in its lower half
        for back, color, label in ((False, D2H_COLOR, "offload (D2H)"), (True, H2D_COLOR, "reload (H2D)")):
            y_lo = 0.18 + (0.12 if back else 0.0)
            verts = [((tr.start, tr.rank + y_lo), (tr.start, tr.rank + y_lo + 0.11), (tr.end, tr.rank + y_lo + 0.11),
                      (tr.end, tr.rank + y_lo)) for tr in transfers if tr.action.kind.startswith("RELOAD") == back]
            if verts:
                ax.add_collection(PolyCollection(verts, facecolors=[color], edgecolors="white",
                                                 linewidths=min(edge_w, 0.25)))
                handles.append(Patch(facecolor=color, edgecolor="white", label=label))

    # Microbatch labels (F, B, W and BW boxes alike) where the box is wide and tall enough; a
    # smaller font for narrow boxes (W is often the narrowest).
    ax_h_px = (height_in - bottom_in - top_in) * dpi
    row_px = ax_h_px / max(nranks, 1) * bar_h
    big = 7.0 if row_px >= 14 else 6.0
    drawn = 0
    for t in passes:
        text = str(t.action.mb)
        box_px = (t.end - t.start) * px_per_unit
        size = next((fs for fs in (big, 5.0) if box_px >= fs * dpi / 72.0 * 0.62 * len(text) + 2
                     and row_px >= fs * dpi / 72.0 * 1.1), None)
        if size is None:
            continue
        if drawn >= _LABEL_MAX:
            break
        chunk = chunk_maps[t.rank].get(t.action.stage, 0)
        ax.text((t.start + t.end) / 2, t.rank + bar_y, text, ha="center", va="center",
                fontsize=size, color="white" if chunk > 0 else "black", clip_on=True)
        drawn += 1

    if transfers:
        t1 = max(t1, max(tr.end for tr in transfers))
    ax.set_xlim(t0, t1)
    ax.set_ylim(nranks - 0.5, -0.5)  # rank 0 on top
    ax.set_yticks(range(nranks))
    ax.set_yticklabels([f"rank {r}" for r in range(nranks)],
                       fontsize=8 if nranks <= 16 else 6)
    ax.set_xlabel(f"time ({shown})")
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(title if title is not None else default_title, fontsize=10)
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  fontsize=8, frameon=False, borderaxespad=0.0)
    if memory:
        mx = fig.add_axes((0.06, 0.45 / height_in, 0.80, (mem_in - 0.55) / height_in))
        _draw_memory(mx, result, memory, (t0, t1))
        ax.set_xlabel("")
        mx.set_xlabel(f"time ({shown})")
    fig.savefig(path, format=ext[1:])


def _draw_memory(mx, result: SimResult, memory: List[List[dict]], xlim) -> None:
    """Each rank's measured activation MiB after each of its passes, placed at that pass's end on
    the simulated timeline (steps), and the simulator's prediction dashed."""
    import matplotlib.colors as mcolors
    palette = list(mcolors.TABLEAU_COLORS.values())
    for r, (tl, trace) in enumerate(zip(result.timeline, memory)):
        ends = {f"{t.action.kind}{t.action.stage}.{t.action.mb}": t.end for t in tl if t.action.is_compute}
        pts = [(ends[row["pass"]], row["bytes"] / 2**20, row.get("predicted", 0) / 2**20)
               for row in trace if row.get("pass") in ends]
        if not pts:
            continue
        pts.sort()
        xs = [xlim[0]] + [x for x, _, _ in pts]
        color = palette[r % len(palette)]
        mx.step(xs, [0.0] + [m for _, m, _ in pts], where="post", color=color, linewidth=1.0, label=f"rank {r}")
        mx.step(xs, [0.0] + [p for _, _, p in pts], where="post", color=color, linewidth=0.8, linestyle="--")
    mx.set_xlim(*xlim)
    mx.set_ylabel("activations (MiB)", fontsize=8)
    mx.tick_params(labelsize=7)
    mx.grid(color="#dddddd", linewidth=0.5)
    for side in ("top", "right"):
        mx.spines[side].set_visible(False)
    mx.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False,
              title="dashed: predicted", title_fontsize=7)


# ---------------------------------------------------------------------------------------------
# Chrome trace / Perfetto


def _transfers(result: SimResult) -> list:
    """The host-link transfers of a simulation with activation offload (empty without)."""
    off = getattr(result, "offload", None)
    return [tr for tl in off.transfers for tr in tl] if off is not None else []


def chrome_trace(result: SimResult, time_unit: str = "ms") -> dict:
    """Chrome-trace JSON object: pid = rank (named "rank r"), one "X" event per pass; ``ts`` and
    ``dur`` in microseconds, converted from ``time_unit`` (the unit of the result's times)."""
    _check_unit(time_unit)
    per = _US_PER[time_unit]

    def _us(x: float) -> float:
        return round(float(x) * per, 6)

    events: List[dict] = []
    chunk_maps = _chunk_maps(result)
    for r in range(len(result.timeline)):
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                       "args": {"name": f"rank {r}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0,
                       "args": {"sort_index": r}})
        events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 0,
                       "args": {"name": f"rank {r}"}})
    for r, tl in enumerate(result.timeline):
        for t in tl:
            a = t.action
            events.append({
                "name": f"{a.kind}{a.mb}",
                "cat": a.kind,
                "ph": "X",
                "ts": _us(t.start),
                "dur": _us(t.end - t.start),
                "pid": r,
                "tid": 0,
                "args": {"stage": a.stage, "microbatch": a.mb,
                         "chunk": chunk_maps[r].get(a.stage, 0)},
            })
    lanes = set()
    for tr in _transfers(result):
        tid = 2 if tr.action.kind.startswith("RELOAD") else 1
        if (tr.rank, tid) not in lanes:
            lanes.add((tr.rank, tid))
            events.append({"ph": "M", "name": "thread_name", "pid": tr.rank, "tid": tid,
                           "args": {"name": "host link: reload (H2D)" if tid == 2 else "host link: offload (D2H)"}})
        a = tr.action
        events.append({"name": f"{a.kind}{a.mb}", "cat": a.kind, "ph": "X", "ts": _us(tr.start),
                       "dur": _us(tr.end - tr.start), "pid": tr.rank, "tid": tid,
                       "args": {"stage": a.stage, "microbatch": a.mb, "issued": _us(tr.issue)}})
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "schedule": result.schedule,
            "stages": result.stages,
            "microbatches": result.microbatches,
            "chunks": result.chunks,
            "makespan": result.makespan,
            "makespan_unit": time_unit,
            "bubble_rate": result.bubble_rate,
            "time_unit": time_unit,
            "note": f"costs and makespan in {time_unit}; event ts/dur in microseconds",
        },
    }


def write_chrome_trace(result: SimResult, path: str, time_unit: str = "ms") -> None:
    trace = chrome_trace(result, time_unit)
    with open(path, "w") as f:
        json.dump(trace, f)


# ---------------------------------------------------------------------------------------------


def save(result: SimResult, path: str, title: Optional[str] = None, time_unit: str = "ms",
         memory: Optional[List[List[dict]]] = None) -> None:
    """Write ``result`` to ``path``: .png/.svg -> timeline picture (with ``memory``: the measured
    activation curve under it), .json -> Chrome trace. ``time_unit``: the unit of the result's times
    ("ms", "s" or "us")."""
    ext = os.path.splitext(path)[1].lower()
    if ext in PICTURE_EXTENSIONS:
        plot_timeline(result, path, title=title, time_unit=time_unit, memory=memory)
    elif ext in TRACE_EXTENSIONS:
        write_chrome_trace(result, path, time_unit=time_unit)
    else:
        raise ValueError(f"cannot save a timeline as {path!r}: the extension must be one of "
                         f"{', '.join(ALLOWED_EXTENSIONS)}")
