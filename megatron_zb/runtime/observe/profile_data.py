"""The profile JSON (``runtime.observe.profiler`` writes one at the end of its window): built from every
pipeline rank's samples, saved, loaded and checked, and turned into the simulator's costs.

Per chunk (global stage) the median of each pass kind; per pipeline rank (the ``cost_*`` and
``mem_*`` lists, as ``core.ir.Setting`` wants them) the sum over the rank's chunks. Pure data
functions: no torch, no communication.
"""
from __future__ import annotations

import json
import math
import os
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

from ...core.ir import BW, DEFAULT_MEM_W_RATIO, VS, VT, VW, B, F, Placement, W

__all__ = ["ProfileError", "build_profile", "load_profile", "save_profile", "check_profile",
           "profile_to_setting_kwargs", "PROFILE_FORMAT", "PROFILE_VERSION", "AUTO_REPLAN_PREFIXES",
           "auto_replans", "median", "chunk_host_costs", "with_host_costs", "HOST_KEYS"]

PROFILE_FORMAT = "megatron-zb-profile"
PROFILE_VERSION = 1
#: schedules whose order depends on the costs: re-planned from the profile when the window ends
AUTO_REPLAN_PREFIXES = ("zb-auto", "v-auto")


class ProfileError(ValueError):
    """A profile window or profile JSON is malformed."""


def auto_replans(schedule: str) -> bool:
    """Whether a schedule is re-planned automatically from the measured costs."""
    return isinstance(schedule, str) and schedule.startswith(AUTO_REPLAN_PREFIXES)


def median(xs: Sequence[float]) -> Optional[float]:
    return float(statistics.median(xs)) if xs else None


def build_profile(rank_stats: Sequence[dict], *, schedule: Optional[str], placement: Placement,
                  microbatches: int, window: Tuple[int, int]) -> dict:
    """The profile from every pipeline rank's :meth:`PassProfiler.rank_stats` (pure function).

    Per chunk (global stage): the median of each pass kind. Per pipeline rank (the ``cost_*`` and
    ``mem_*`` lists, one value per rank): the sum over the rank's chunks. Per model chunk in pipeline
    order (``chunk_cost_*``, ``chunk_mem_*``: what the simulator takes per chunk; a replicated
    placement's logical stage averaged over its copies): each chunk's own. Where a schedule ran only fused backwards (BW), B and W are each taken as half of BW
    (``backward_split`` says so). ``mem_w`` without a W pass: DEFAULT_MEM_W_RATIO x mem_f.
    """
    p = placement.num_ranks
    by_rank = {int(s["rank"]): s for s in rank_stats}
    missing = sorted(set(range(p)) - set(by_rank))
    if missing:
        raise ProfileError(f"no samples from pipeline rank(s) {missing}")
    per_chunk = []
    cost = {k: [0.0] * p for k in ("f", "b", "w", "bw")}
    has_bw = [False] * p
    mem_f, mem_w = [0.0] * p, [0.0] * p
    mem_w_known = [True] * p
    S = placement.num_logical_stages
    chunk = {k: [0.0] * S for k in ("f", "b", "w", "bw", "mem_f", "mem_w") + HOST_KEYS}
    host = [0.0] * p  # per rank: its passes' handling and interference (s per microbatch, all chunks)
    cpu = all(by_rank[r].get("device", "cpu") != "cuda" for r in range(p))
    share = 1.0 / placement.num_paths
    counts = {k: 0 for k in (F, B, W, BW, "recv_wait", "comm_probe")}
    split_sources = set()
    for r in range(p):
        st = by_rank[r]
        times = st.get("times", {})
        for s in placement.stages_of(r):
            key = str(s)
            med = {k: median(times.get(k, {}).get(key, [])) for k in (F, B, W, BW)}
            n = {k: len(times.get(k, {}).get(key, [])) for k in (F, B, W, BW)}
            for k in n:
                counts[k] += n[k]
            f = med[F] or 0.0
            if med[B] is not None or med[W] is not None:
                b, w = med[B] or 0.0, med[W] or 0.0
                split_sources.add("measured")
            elif med[BW] is not None:
                b = w = med[BW] / 2
                split_sources.add("assumed")
            else:
                b = w = 0.0
            extra = _host_costs(st, key) if cpu else {}
            host[r] += sum(extra.get(f"{h}_{k}", 0.0) for h in ("handling", "interference") for k in "fbw")
            mf = median(st.get("mem_f", {}).get(key, []))
            mw = median(st.get("mem_w", {}).get(key, []))
            waits = st.get("recv_wait", {})
            wf, wb = waits.get(F, {}).get(key, []), waits.get(B, {}).get(key, [])
            counts["recv_wait"] += len(wf) + len(wb)
            cost["f"][r] += f
            cost["b"][r] += b
            cost["w"][r] += w
            # the fused backward: as measured where one ran, else B + W (one where the split costs nothing)
            bw = med[BW] if med[BW] is not None else b + w
            cost["bw"][r] += bw
            has_bw[r] = has_bw[r] or med[BW] is not None
            mem_f[r] += mf or 0.0
            if mw is None:
                mem_w_known[r] = False
            else:
                mem_w[r] += mw
            lg = placement.logical(s)
            for k, x in (("f", f), ("b", b), ("w", w), ("bw", bw), ("mem_f", mf or 0.0),
                         ("mem_w", mw if mw is not None else DEFAULT_MEM_W_RATIO * (mf or 0.0))) + \
                    tuple(extra.items()):
                chunk[k][lg] += x * share
            per_chunk.append({
                "stage": s, "rank": r, "chunk": placement.chunk_of(s),
                "f": f, "b": med[B], "w": med[W], "bw": med[BW],
                "samples": n, "mem_f": mf, "mem_w": mw,
                "recv_wait_f": median(wf), "recv_wait_b": median(wb),
                **({"host": extra} if extra else {}),
                "recv_wait_total_per_iter": (sum(wf) + sum(wb)) / max(1, len(st.get("iterations", [])) or 1),
            })
    if placement.replicated:  # a microbatch runs through one path's chunks: the average over paths
        k = placement.num_paths
        for lst in (cost["f"], cost["b"], cost["w"], cost["bw"], mem_f, mem_w):
            for r in range(p):
                lst[r] /= k
    for r in range(p):
        if not mem_w_known[r]:
            mem_w[r] = DEFAULT_MEM_W_RATIO * mem_f[r]
    probes = [x for r in range(p) for x in by_rank[r].get("comm_probe", [])]
    counts["comm_probe"] = len(probes)
    iters = [by_rank[r].get("iteration_s", []) for r in range(p)]
    per_iter = [max(xs) for xs in zip(*iters)] if all(iters) else []
    gaps = [by_rank[r].get("between_s", []) for r in range(p)]
    # the synchronous step starts when the last rank arrives: the rank whose forward-backward ended last (the
    # shortest gap; the others' gaps also hold their wait for it, which the simulated iteration has already)
    between = [min(xs) for xs in zip(*gaps)] if all(gaps) else []
    first = by_rank[0]
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "schedule": schedule,
        "pipeline_size": p,
        "stages": p,
        "chunks": placement.chunks,
        "microbatches": microbatches,
        "placement": placement.to_dict(),
        "window": [int(window[0]), int(window[1])],
        "iterations": len(first.get("iterations", [])),
        "device": first.get("device", "cpu"),
        "time_unit": "s",
        "cost_f": cost["f"],
        "cost_b": cost["b"],
        "cost_w": cost["w"],
        "cost_bw": cost["bw"] if any(has_bw) else None,
        "cost_comm": median(probes) or 0.0,
        "cost_comm_source": "ping-pong probe (half the median round trip)" if probes else "not measured",
        "backward_split": ("assumed B = W = BW/2 (only fused backwards ran)" if split_sources == {"assumed"}
                           else "measured" if split_sources else "none"),
        "mem_unit": "bytes",
        "mem_f": mem_f,
        "mem_w": mem_w,
        "mem_w_source": "measured" if all(mem_w_known) else
                        f"DEFAULT_MEM_W_RATIO ({DEFAULT_MEM_W_RATIO}) x mem_f where no W pass ran",
        "mem_method": first.get("mem_method"),
        "p2p_wait_per_iter": [sum(sum(v) for k in (F, B) for v in by_rank[r].get("recv_wait", {}).get(k, {}).values())
                              / max(1, len(by_rank[r].get("iterations", []))) for r in range(p)],
        "iteration_s": median(per_iter),
        # from the end of one forward-backward call to the next one's start on the rank that ended last (the
        # shortest gap): Megatron's optimizer step, gradient finalisation and the rest of its loop; per rank
        # beside it (a rank that ends earlier waits for that one); None with a one-iteration window
        "between_iterations_s": median(between),
        "between_iterations_s_per_rank": [median(g) for g in gaps],
        "samples": counts,
        "per_chunk": per_chunk,
        "chunk_cost_f": chunk["f"], "chunk_cost_b": chunk["b"], "chunk_cost_w": chunk["w"],
        "chunk_cost_bw": chunk["bw"] if any(has_bw) else None,
        "chunk_mem_f": chunk["mem_f"], "chunk_mem_w": chunk["mem_w"],
        # CPU: what a pass costs the rank beside its typical computation, seconds per pass per model chunk
        # (``_host_costs``; profile_to_setting_kwargs adds them to the pass's cost): its handling and the
        # interference it meets; none on CUDA, where the host's work overlaps the device's
        **({f"chunk_{k}": chunk[k] for k in HOST_KEYS} if cpu else {}),
        **({"host_per_microbatch": host} if cpu else {}),
        **_offload_section(by_rank, p),
        **_memory_section(by_rank, p),
        **_vocab_section(by_rank, p),
        **_length_section(by_rank),
    }


#: the per-pass costs of the host a CPU profile carries per chunk beside each pass kind's median
HOST_KEYS = tuple(f"{h}_{k}" for h in ("handling", "interference") for k in ("f", "b", "w", "bw"))
WINSOR_MADS = 5  # interference: samples above the median by more than this many MADs count as this many


def _excess(xs: Sequence[float]) -> Optional[float]:
    """How much a pass costs on average beyond its median: the mean of the samples, each capped at the
    median + WINSOR_MADS median absolute deviations (a rare stall of the host's other work is not the
    pass's), minus the median; None without samples."""
    if not xs:
        return None
    m = statistics.median(xs)
    mad = statistics.median(abs(x - m) for x in xs)
    return max(0.0, statistics.fmean(min(x, m + WINSOR_MADS * mad) for x in xs) - m)


def _host_costs(st: dict, key: str) -> Dict[str, float]:
    """One chunk's host costs per pass kind (seconds per pass), from one rank's samples:
    ``handling_*`` the median of the pass's handling (``profiler``: its messages' posting, the executor's
    bookkeeping, the hooks) and ``interference_*`` what the passes cost on average beyond their median
    (``_excess``: the rank's other threads, e.g. gloo's, and the host's other processes taking the core).
    Where only fused backwards ran, B and W each take half of BW's; where only split ones ran, BW takes
    B's + W's."""
    out = {}
    for h, stat, src in (("handling", median, st.get("handling", {})), ("interference", _excess, st.get("times", {}))):
        v = {k: stat(src.get(k, {}).get(key, [])) for k in (F, B, W, BW)}
        if v[B] is not None or v[W] is not None:
            b, w = v[B] or 0.0, v[W] or 0.0
        else:
            b = w = (v[BW] or 0.0) / 2
        out.update({f"{h}_f": v[F] or 0.0, f"{h}_b": b, f"{h}_w": w,
                    f"{h}_bw": v[BW] if v[BW] is not None else b + w})
    return out


def _length_section(by_rank: Dict[int, dict]) -> dict:
    """Variable-length batches: every pass timed with its microbatch's shape, per kind and stage
    ([tokens, sum of s^2, seconds]; ``core.costs.microbatch_costs.fit_stages`` fits them); none without."""
    out: Dict[str, Dict[str, list]] = {}
    for st in by_rank.values():
        for k, per in (st.get("length_samples") or {}).items():
            for s, xs in per.items():
                out.setdefault(k, {}).setdefault(s, []).extend(xs)
    return {"length_samples": out} if out else {}


def _vocab_section(by_rank: Dict[int, dict], p: int) -> dict:
    """Vocabulary parallelism: each rank's median VS, VT and VW (seconds), where they ran."""
    out = {}
    for kind, key in ((VS, "vocab_cost_s"), (VT, "vocab_cost_t"), (VW, "vocab_cost_w")):
        meds = [median(by_rank[r].get("times", {}).get(kind, {}).get(str(r), [])) for r in range(p)]
        if any(x is not None for x in meds):
            out[key] = [x or 0.0 for x in meds]
    return out


def _memory_section(by_rank: Dict[int, dict], p: int) -> dict:
    """Per rank, the activation peak measured in the window's last iteration and the simulator's for
    the same order from the measured per-stage bytes (``runtime.observe.memory``), and their traces."""
    mem = [by_rank[r].get("memory") for r in range(p)]
    if not all(mem):
        return {}
    return {"peak_activation_bytes_measured": [m["measured_peak_bytes"] for m in mem],
            "peak_activation_bytes_predicted": [m["predicted_peak_bytes"] for m in mem],
            "memory_method": mem[0].get("method"),
            "memory_traces": [m.get("trace", []) for m in mem]}


def _offload_section(by_rank: Dict[int, dict], p: int) -> dict:
    """``offload``: per rank, the offload manager's counts over the window (peak resident
    activation bytes, bytes per F, offloaded and reloaded bytes, host buffer bytes); absent
    without offload."""
    if not any(by_rank[r].get("offload") for r in range(p)):
        return {}
    rows = []
    for r in range(p):
        its = by_rank[r].get("offload") or []
        rows.append({"rank": r, "iterations": len(its),
                     "peak_resident_bytes": max((x["peak_resident_bytes"] for x in its), default=0),
                     "captured_bytes_per_forward": its[-1]["captured_bytes_per_forward"] if its else 0,
                     "offloaded_bytes": its[-1]["offloaded_bytes"] if its else 0,
                     "reloaded_bytes": its[-1]["reloaded_bytes"] if its else 0,
                     "host_buffer_bytes": its[-1]["host_buffer_bytes"] if its else 0,
                     "host_allocations": [x["host_allocations"] for x in its]})
    return {"offload": rows}


def save_profile(profile: dict, path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(profile, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


_REQUIRED = ("cost_f", "cost_b", "cost_w")


def load_profile(path: str) -> dict:
    """Read and check a profile JSON (this module's or any dict with per-stage cost lists)."""
    try:
        with open(path) as f:
            prof = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ProfileError(f"cannot read profile {path!r}: {e}") from None
    check_profile(prof, path)
    return prof


def check_profile(prof, where="profile"):
    if not isinstance(prof, dict):
        raise ProfileError(f"{where}: a profile is a JSON object")
    for k in _REQUIRED:
        if k not in prof:
            raise ProfileError(f"{where}: no {k} (per-stage costs as written by the profiler)")
    lens = set()
    for k in _REQUIRED + ("mem_f", "mem_w"):
        v = prof.get(k)
        if v is None:
            continue
        vs = [v] if isinstance(v, (int, float)) and not isinstance(v, bool) else v
        if not isinstance(vs, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                               and math.isfinite(x) and x >= 0 for x in vs):
            raise ProfileError(f"{where}: {k} must be a non-negative number or a list of them, got {v!r}")
        if isinstance(v, list):
            lens.add(len(v))
    if len(lens) > 1:
        raise ProfileError(f"{where}: per-stage lists have different lengths {sorted(lens)}")


VOCAB_COST_KEYS = ("vocab_cost_s", "vocab_cost_t", "vocab_cost_w")


def profile_to_setting_kwargs(profile: dict, normalize: bool = False, per_chunk: bool = False,
                              host_costs: bool = True) -> dict:
    """``cost_f/cost_b/cost_w`` (lists per stage), ``cost_comm``, ``mem_f``, ``mem_w`` for
    ``core.ir.Setting(stages, microbatches, **kwargs)``.

    ``host_costs``: where the profile measured them (CPU), each pass costs its median computation plus
    its host costs (``with_host_costs``: its handling and the interference it meets), the time the rank
    spends on the pass on average; False: the median computation alone.

    Raw: seconds and bytes, as measured. ``normalize=True``: costs in units of the mean F cost per
    rank, memory in units of the largest rank's ``mem_f`` (so ``memory_limit`` keeps its meaning
    "activations of this many microbatches of one stage"). ``per_chunk``: one value per model chunk
    (the profile's ``chunk_*`` lists, where it has them; the same units).
    """
    check_profile(profile)
    if host_costs:
        profile = with_host_costs(profile)
    as_list = lambda v: [float(x) for x in (v if isinstance(v, list) else [v])]  # noqa: E731
    cf, cb, cw = (as_list(profile[k]) for k in _REQUIRED)
    if per_chunk and profile.get("chunk_cost_f"):
        out = profile_to_setting_kwargs(profile, normalize=False)
        unit = sum(cf) / len(cf) if sum(cf) > 0 else (sum(cf + cb + cw) / (3 * len(cf)) or 1.0)
        mu = max(out["mem_f"]) if out.get("mem_f") else 1.0
        if not normalize:
            unit = mu = 1.0
        chunked = {"cost_f": [x / unit for x in as_list(profile["chunk_cost_f"])],
                   "cost_b": [x / unit for x in as_list(profile["chunk_cost_b"])],
                   "cost_w": [x / unit for x in as_list(profile["chunk_cost_w"])],
                   "cost_comm": out["cost_comm"] / unit}
        if profile.get("chunk_cost_bw"):
            chunked["cost_bw"] = [x / unit for x in as_list(profile["chunk_cost_bw"])]
        chunked.update({k: [x / unit for x in as_list(profile[k])] for k in VOCAB_COST_KEYS if profile.get(k)})
        if "mem_f" in out:
            chunked["mem_f"] = [x / mu for x in as_list(profile["chunk_mem_f"])]
            chunked["mem_w"] = [x / mu for x in as_list(profile["chunk_mem_w"])]
        return chunked
    comm = float(profile.get("cost_comm") or 0.0)
    out = {"cost_f": cf, "cost_b": cb, "cost_w": cw, "cost_comm": comm}
    if profile.get("cost_bw"):  # a fused backward measured (B + W where only the split one ran)
        out["cost_bw"] = as_list(profile["cost_bw"])
    mf = profile.get("mem_f")
    if mf is not None and sum(as_list(mf)) > 0:
        mf = as_list(mf)
        mw = as_list(profile["mem_w"]) if profile.get("mem_w") is not None else [DEFAULT_MEM_W_RATIO * x for x in mf]
        if len(mw) == 1 and len(mf) > 1:
            mw = mw * len(mf)
        if len(mf) == 1 and len(mw) > 1:
            mf = mf * len(mw)
        out["mem_f"], out["mem_w"] = mf, mw
    if normalize:
        unit = sum(cf) / len(cf) if sum(cf) > 0 else (sum(cf + cb + cw) / (3 * len(cf)) or 1.0)
        for k in ("cost_f", "cost_b", "cost_w", "cost_bw"):
            if k in out:
                out[k] = [x / unit for x in out[k]]
        out["cost_comm"] = comm / unit
        out.update({k: [x / unit for x in as_list(profile[k])] for k in VOCAB_COST_KEYS if profile.get(k)})
        if "mem_f" in out:
            mu = max(out["mem_f"])
            out["mem_f"] = [x / mu for x in out["mem_f"]]
            out["mem_w"] = [x / mu for x in out["mem_w"]]
    return out


def chunk_host_costs(profile: dict) -> Optional[Dict[str, List[float]]]:
    """Per pass kind ('f', 'b', 'w', 'bw'), each model chunk's host costs as the profile measured them
    on a CPU: its handling plus the interference it met (seconds); None where it measured none."""
    if not profile.get("chunk_handling_f"):
        return None
    return {k: [sum(x) for x in zip(profile[f"chunk_handling_{k}"], profile.get(f"chunk_interference_{k}")
                                    or [0.0] * len(profile[f"chunk_handling_{k}"]))] for k in ("f", "b", "w", "bw")}


def with_host_costs(profile: dict) -> dict:
    """The profile with each pass's host costs (``chunk_handling_*`` + ``chunk_interference_*``) added to
    its cost, in the chunk and per-rank lists (the fused backward's where the profile has one); the same
    profile without them (a CUDA profile, an older one, one they were added to already)."""
    extra = chunk_host_costs(profile)
    if extra is None or profile.get("host_costs_added"):
        return profile
    out = dict(profile, host_costs_added=True)
    for k in ("f", "b", "w", "bw"):
        if profile.get(f"chunk_cost_{k}") is not None:
            out[f"chunk_cost_{k}"] = [c + h for c, h in zip(profile[f"chunk_cost_{k}"], extra[k])]
    pl = Placement.from_dict(profile["placement"]) if profile.get("placement") else None
    if pl is not None and not pl.replicated:
        for k in ("f", "b", "w", "bw"):
            if isinstance(profile.get(f"cost_{k}"), list):
                per_rank = [sum(extra[k][pl.logical(s)] for s in pl.stages_of(r)) for r in range(pl.num_ranks)]
                out[f"cost_{k}"] = [c + h for c, h in zip(profile[f"cost_{k}"], per_rank)]
    return out
