"""Orders users know from torch.distributed.pipelining: LoopedBFS and DualPipeV.

looped-bfs: looped placement (stage s on rank s % p, v chunks per rank); every rank runs all
forwards of its first stage, then of the next, ..., then the backwards (fused) of its stages in
reverse, microbatches in reverse (breadth-first).

dualpipe-v: DualPipeV's order on the V placement (phase 0 = stage r, phase 1 = stage 2p-1-r)
in its eight steps (built for max(m, 2p) microbatches; with m < 2p the extra ones are dropped): (1) 2(p-r-1) F0; (2) r+1 x (F0, F1); (3) p-r-1 x
(B1 split, W, F1); (4) m-2p+r+1 x (F0 with B1, F1 with B0), the overlapped pairs; (5) p-r-1 x
(B1, F1 with B0); (6) r+1 x (B1, B0), switching to split backwards half-way (odd ranks before B1,
even ranks before B0); (7) p-r-1 x (W, B0 split); (8) r+1 x W. A split backward queues its W
(first in, first out); an unsplit one is a fused BW. The overlapped F&B pairs are compound
``OVERLAP_F_B`` actions (torch writes them ``(1F1;2B0)OVERLAP_F_B``): a runtime with an overlap
hook runs their two passes together; without one they run one after the other, which is what
the simulator assumes.
"""
from __future__ import annotations

from collections import deque

from ..ir import BW, Action, B, F, Placement, Schedule, ScheduleError, Setting, W


def looped_bfs(setting: Setting) -> Schedule:
    p, m, v = setting.stages, setting.microbatches, setting.chunks
    if v is None or v < 2:
        raise ScheduleError("looped-bfs needs --chunks >= 2 (model chunks per rank)")
    orders = []
    for r in range(p):
        stages = [c * p + r for c in range(v)]
        order = [Action(F, s, mb) for s in stages for mb in range(m)]
        order += [Action(BW, s, mb) for s in reversed(stages) for mb in reversed(range(m))]
        orders.append(order)
    return Schedule("looped-bfs", Placement.looped(p, v), m, orders, {"memory_claim": m * 1.0})


def dualpipe_v(setting: Setting) -> Schedule:
    p, m_real = setting.stages, setting.microbatches
    m = max(m_real, 2 * p)  # fewer microbatches: build for 2p, then drop the extra ones
    orders = []
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        nxt = {"F0": 0, "F1": 0, "B0": 0, "B1": 0}
        wq = deque()
        order = []

        def f(phase):
            key = f"F{phase}"
            order.append(Action(F, s0 if phase == 0 else s1, nxt[key]))
            nxt[key] += 1

        def b(phase, split=False):
            key = f"B{phase}"
            s = s0 if phase == 0 else s1
            order.append(Action(B if split else BW, s, nxt[key]))
            if split:
                wq.append((s, nxt[key]))
            nxt[key] += 1

        def w():
            s, mb = wq.popleft()
            order.append(Action(W, s, mb))

        def fb(fphase, bphase):
            f(fphase)
            b(bphase)
            order[-2:] = [Action.overlap(order[-2], order[-1])]

        for _ in range(2 * (p - r - 1)):
            f(0)
        for _ in range(r + 1):
            f(0)
            f(1)
        for _ in range(p - r - 1):
            b(1, split=True)
            w()
            f(1)
        for _ in range(m - 2 * p + r + 1):
            fb(0, 1)
            fb(1, 0)
        for _ in range(p - r - 1):
            b(1)
            fb(1, 0)
        zb = False
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                zb = True
            b(1, split=zb)
            if i == (r + 1) // 2 and r % 2 == 0:
                zb = True
            b(0, split=zb)
        for _ in range(p - r - 1):
            w()
            b(0, split=True)
        while wq:
            w()
        orders.append(order)
    if m_real < m:  # drop the extra microbatches (a pair losing one pass becomes that pass)
        for r, order in enumerate(orders):
            kept = []
            for a in order:
                if a.parts is None:
                    if a.mb < m_real:
                        kept.append(a)
                    continue
                live = [x for x in a.parts if x.mb < m_real]
                kept += [a] if len(live) == 2 else live
            orders[r] = kept
    return Schedule("dualpipe-v", Placement.vshape(p), m_real, orders)
