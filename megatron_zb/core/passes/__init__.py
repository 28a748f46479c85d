"""Passes over a generated schedule, schedule in and schedule out, each refusing what it cannot
combine with: activation offload (``offload``; ``offload_search``: the schedule to offload under a
limit), vocabulary parallelism's passes placed (``vocab``, ``vocab_place``), MoE's overlapped F&B
pairs (``pairing``), a split backward fused where it costs (``fuse``). ``core.build`` chains them.
Pure Python."""
