"""Rank code for tests/test_postval.py (module-level, so launched ranks can import it). No megatron."""
from __future__ import annotations


def channel_case(case):
    import torch
    import torch.distributed as dist

    from megatron_zb.runtime.features.postval import PostValidation, ValidationTimeout
    world, me = dist.get_world_size(), dist.get_rank()
    pp = dist.new_group(list(range(world)))
    pv = PostValidation(timeout_s=case["timeout"])
    if case["kind"] == "rounds":
        fulls, verdicts = [], []
        for it in range(3):
            local = torch.tensor([float(me + 1 + it), 2.0, 1.0 if (me == 1 and it == 1) else 0.0],
                                 dtype=torch.float64)
            pv.submit(pp, it, local, judge=lambda full: fulls.append(full.tolist()) or full[2].item() == 0,
                      recover=lambda: verdicts.append("recovered"))
            assert pv.due
            ok = pv.validate()
            verdicts.append(ok)
            if not ok:
                pv.recover()
        return {"fulls": fulls, "verdicts": verdicts, "rollbacks": pv.rollbacks}
    if case["kind"] == "silent-last-rank":
        pv.channel(pp)  # creating the channel is collective; the last rank then never steps
        if me == world - 1:
            return {"skipped": True}
        pv.submit(pp, 5, torch.zeros(3, dtype=torch.float64), judge=lambda f: True, recover=lambda: None)
        try:
            pv.validate()
        except ValidationTimeout as e:
            return {"error": str(e)}
        return {"error": None}
    raise ValueError(case)


def drain_case(case):
    import torch.distributed as dist

    from megatron_zb.core.ir import Setting
    from megatron_zb.core.sim.lower import lower
    from megatron_zb.core.schedules import generate
    from megatron_zb.runtime.executor import execute, rank_pairs
    from megatron_zb.runtime.hooks import Hook
    from megatron_zb.runtime.p2p import P2P, PairGroups
    from megatron_zb.runtime.emulate.sleep_passes import sleep_passes
    world, me = dist.get_world_size(), dist.get_rank()
    st = Setting(world, case["m"], chunks=2)
    low = lower(generate(case["schedule"], st))
    pl = low.placement
    pairs = {(pl.rank_of(s), pl.rank_of(s + 1)) for s in range(pl.num_stages - 1)}
    p2p = P2P(PairGroups(list(range(world)), pairs), me, timeout_s=30)
    passes = sleep_passes(st, me, pl, unit=0.0)
    calls, done = [], []
    orig_fwd = passes.forward

    def forward(stage, mb, inp):
        done.append(("F", stage, mb))
        return orig_fwd(stage, mb, inp)
    passes.forward = forward
    overlap = rank_pairs(low, me)

    class Verdict(Hook):
        def validate(self):
            calls.append(len(done))
            return case["verdict"]
    first = execute(low.orders[me], me, pl, passes, p2p, overlap_pairs=overlap, hooks=[Verdict()])
    computed = len(done)
    again = execute(low.orders[me], me, pl, passes, p2p, overlap_pairs=overlap)  # still matched
    passes_before_b = next(i for i, a in enumerate([a for a in low.flat().orders[me] if a.is_compute])
                           if a.kind in ("B", "BW"))
    return {"completed": first, "again": again, "calls": calls, "computed": computed,
            "forwards_before_first_b": passes_before_b}
