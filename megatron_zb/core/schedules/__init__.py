"""Schedule generators by name. Each is a pure function Setting -> Schedule.

The registry says, for every schedule, what a caller needs without generating one: its chunks per
rank, its placement style (how the model is laid out over the ranks), whether it splits the
backward into B and W, and how many model chunks a rank builds. ``core.build`` is the one way
to turn a request into a validated schedule; ``generate`` here is the bare generator."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from ..ir import Schedule, ScheduleError, Setting
from .basic import gpipe, one_f_one_b
from .bitpipe import bitpipe
from .interleaved import interleaved_1f1b
from .interleaved_zb import interleaved_zb
from .search.auto import zb_auto
from .search.vsearch import v_auto, v_half, v_min, zb_v
from .torch_peers import dualpipe_v, looped_bfs
from .vshape import gpipe_v
from .zb_handcrafted import zb_h1, zb_h2
from .zeropp import zeropp


@dataclass(frozen=True)
class ScheduleSpec:
    name: str
    generate: Callable[[Setting], Schedule]
    description: str
    chunks: Optional[int] = 1  # fixed chunks per rank; None = user's --chunks (>= 2)
    default_chunks: int = 1
    split_backward: bool = False  # uses B/W passes
    models_per_rank: Optional[int] = None  # model chunks a rank builds, where not ``chunks`` (replicas)
    # how stages sit on ranks (``ir.Placement.style``): 'single' (one stage per rank), 'looped'
    # (Megatron's interleaving, stage s on rank s % p), 'v' (rank r holds r and 2p-1-r),
    # 'bitpipe' (two V's in opposite directions, replicated stages)
    placement: str = "single"
    # searched under --memory-limit (the limit decides the schedule; with activation offload the
    # search may also take what a larger limit builds and offload it back under)
    searched: bool = False
    # a search that takes an effort (``auto.EFFORTS``): 'full', or plan's 'quick' first pass
    effort: bool = False

    def models(self, chunks: int) -> int:
        """Model chunks each rank builds for ``chunks`` chunks per rank."""
        return self.models_per_rank or chunks

    def resolve_chunks(self, chunks: Optional[int]) -> int:
        if self.chunks is None:
            c = self.default_chunks if chunks is None else chunks
            if c < 2:
                raise ScheduleError(f"{self.name} needs --chunks >= 2, got {c}")
            return c
        if chunks is not None and chunks != self.chunks:
            extra = (f" in each direction ({self.models_per_rank} model chunks per rank in all)"
                     if self.models_per_rank else "")
            raise ScheduleError(f"{self.name} uses {self.chunks} chunk(s) per rank{extra}, got --chunks {chunks}")
        return self.chunks


REGISTRY: Dict[str, ScheduleSpec] = {}


def register(spec: ScheduleSpec) -> None:
    REGISTRY[spec.name] = spec


register(ScheduleSpec("gpipe", gpipe, "all forwards, then all backwards"))
register(ScheduleSpec("1f1b", one_f_one_b, "one-forward-one-backward (Megatron's default)"))
register(ScheduleSpec("interleaved-1f1b", interleaved_1f1b,
                      "Megatron's interleaved 1F1B, v chunks per rank (looped placement)",
                      chunks=None, default_chunks=2, placement='looped'))
register(ScheduleSpec("zb-h1", zb_h1, "zero bubble H1: 1F1B memory, bubble (p-1)(F+B-W)",
                      split_backward=True))
register(ScheduleSpec("zb-h2", zb_h2, "zero bubble H2: 2p-1 activations, bubble (p-1)(F+B-2W)",
                      split_backward=True))
register(ScheduleSpec("zb-auto", zb_auto, "automatic zero bubble under --memory-limit (default p x mem-f)",
                      split_backward=True, searched=True, effort=True))
register(ScheduleSpec("zb-v", zb_v, "zero bubble on the V placement at 1F1B's peak memory",
                      chunks=2, default_chunks=2, split_backward=True, placement='v', effort=True))
register(ScheduleSpec("v-half", v_half, "V schedule at about half of 1F1B's activation memory",
                      chunks=2, default_chunks=2, split_backward=True, placement='v', effort=True))
register(ScheduleSpec("v-min", v_min, "V schedule at about a third of 1F1B's activation memory",
                      chunks=2, default_chunks=2, split_backward=True, placement='v', effort=True))
register(ScheduleSpec("v-auto", v_auto, "best V schedule under --memory-limit (default p x mem-f)",
                      chunks=2, default_chunks=2, split_backward=True, placement='v', searched=True,
                      effort=True))
register(ScheduleSpec("looped-bfs", looped_bfs, "breadth-first looped schedule (torch's LoopedBFS)",
                      chunks=None, default_chunks=2, placement='looped'))
register(ScheduleSpec("dualpipe-v", dualpipe_v, "DualPipeV's order with B/W split and overlapped F&B pairs",
                      chunks=2, default_chunks=2, split_backward=True, placement='v'))
register(ScheduleSpec("gpipe-v", gpipe_v, "GPipe on the V placement (2 chunks per rank)",
                      chunks=2, default_chunks=2, placement='v'))
register(ScheduleSpec("interleaved-zb", interleaved_zb,
                      "torch's ScheduleInterleavedZeroBubble: ZB-H1 on the looped placement, v chunks per rank",
                      chunks=None, default_chunks=2, split_backward=True, placement='looped'))
register(ScheduleSpec("zeropp", zeropp,
                      "ZeroPP: looped placement in adaptive scheduling units, F/B/W staggered, under --memory-limit",
                      chunks=None, default_chunks=2, split_backward=True, placement='looped'))
register(ScheduleSpec("bitpipe", bitpipe,
                      "BitPipe: two V pipelines in opposite directions, replicated stages, eager gradient sync",
                      chunks=2, default_chunks=2, models_per_rank=4, placement='bitpipe'))


def names() -> List[str]:
    return list(REGISTRY)


def get(name: str) -> ScheduleSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ScheduleError(f"unknown schedule {name!r}; known schedules: {', '.join(names())}") from None


def generate(name: str, setting: Setting) -> Schedule:
    """Generate a schedule by name; ``setting.chunks`` is checked against the schedule's needs."""
    spec = get(name)
    chunks = spec.resolve_chunks(setting.chunks)
    if chunks != setting.chunks:
        setting = dataclasses.replace(setting, chunks=chunks)
    return spec.generate(setting)
