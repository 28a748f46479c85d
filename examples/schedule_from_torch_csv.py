"""Bring a schedule from torch.distributed.pipelining (compute-only CSV) into megatron-zb,
check it, simulate it with your costs, and compare it with ZB-H1.

    python examples/schedule_from_torch_csv.py
"""
from megatron_zb.core.ir import io
from megatron_zb.core.ir import Setting
from megatron_zb.core.schedules import generate
from megatron_zb.core.sim.simulate import simulate
from megatron_zb.core.sim.validate import validate

# a 2-rank ZB1P-like order as torch writes it: I = input gradient (our B), W = weight gradient
CSV = """0F0,0F1,0I0,0W0,0F2,0I1,0W1,0F3,0I2,0W2,0I3,0W3
1F0,1I0,1F1,1I1,1W0,1F2,1I2,1W1,1F3,1I3,1W2,1W3
"""

sched = io.from_csv(CSV, name="from-torch")
setting = Setting(stages=2, microbatches=sched.num_microbatches, cost_f=1.0, cost_b=1.2, cost_w=0.8)
validate(sched, setting)
mine = simulate(sched, setting)
zb = simulate(generate("zb-h1", setting), setting)
print(f"torch CSV schedule: makespan {mine.makespan:g}, bubble {mine.bubble_rate:.3f}, peak {mine.peak_memory}")
print(f"zb-h1             : makespan {zb.makespan:g}, bubble {zb.bubble_rate:.3f}, peak {zb.peak_memory}")
print("as megatron-zb JSON:", io.to_json(sched)[:120], "...")
