"""Interleaved zero bubble: the order of torch.distributed.pipelining's
``ScheduleInterleavedZeroBubble`` (the ZB paper's ZB-H1 on Megatron's looped placement).

v model chunks per rank, stage s on rank s % p. Microbatches run in rounds: ``rounds = max(1,
m // p)`` rounds of ``m / rounds`` microbatches each (m must split evenly, as torch requires); the
k-th forward of a rank runs chunk ``(k // per_round) % v``, the k-th backward chunk ``v - 1 -
(k // per_round) % v``, each stage's microbatches in order. Rank r does ``(v-1)·per_round + p-1-r``
warm-up forwards (torch's ``multiply_factor=1``), then F and B (input gradient) alternately, then
the remaining B's; from its (r+1)-th B on, every B is followed by the W of the oldest B still
without one (rank r keeps r W's pending), and the leftover W's close the list. Torch pads the
lists with idle slots for its lock-step runtime; our runtime waits on dependencies, so the compute
order alone is the schedule.

Peak activation: ((v-1)·per_round + p) / v x mem-f on rank 0 (at most m x mem-f).
"""
from __future__ import annotations

from collections import defaultdict

from ..ir import Action, B, F, Placement, Schedule, ScheduleError, Setting, W


def rounds_of(p: int, m: int):
    rounds = max(1, m // p)
    if m % rounds:
        ok = sorted({(m // rounds) * rounds, ((m // rounds) + 1) * rounds} - {m})
        raise ScheduleError(f"interleaved-zb runs {m} microbatches in {rounds} rounds (m // pipeline size), which "
                            f"needs a multiple of {rounds} (torch's rule), e.g. {' or '.join(map(str, ok))} microbatches")
    return rounds, m // rounds


def interleaved_zb(setting: Setting) -> Schedule:
    p, m, v = setting.stages, setting.microbatches, setting.chunks
    if v is None or v < 2:
        raise ScheduleError("interleaved-zb needs --chunks >= 2 (model chunks per rank); with one chunk use zb-h1")
    rounds, per_round = rounds_of(p, m)
    total = m * v
    orders = []
    for r in range(p):
        warm = min((v - 1) * per_round + (p - 1 - r), total)

        def fwd_stage(k):
            return ((k // per_round) % v) * p + r

        def bwd_stage(k):
            return (v - 1 - ((k - warm) // per_round) % v) * p + r

        nxt_f, nxt_b, nxt_w = defaultdict(int), defaultdict(int), defaultdict(int)
        b_stages = []  # stage of every B so far, in order (the W's follow the same order)
        order = []

        def emit(kind, s, counter):
            order.append(Action(kind, s, counter[s]))
            counter[s] += 1

        def weight():
            emit(W, b_stages[sum(nxt_w.values())], nxt_w)

        for k in range(total + warm):
            if k < total:
                emit(F, fwd_stage(k), nxt_f)
            if k >= warm:
                s = bwd_stage(k)
                emit(B, s, nxt_b)
                b_stages.append(s)
                if k - warm >= r:
                    weight()
        while sum(nxt_w.values()) < len(b_stages):
            weight()
        orders.append(order)
    claim = min(float(m), ((v - 1) * per_round + p) / v)
    return Schedule("interleaved-zb", Placement.looped(p, v), m, orders,
                    {"rounds": rounds, "memory_claim": claim})
