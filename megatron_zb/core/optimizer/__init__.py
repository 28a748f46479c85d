"""Optimizer states in host memory (docs/optimizer_offload.md): each rank's share and the trough
plan's cost model (``offload``), plan's rows with them (``rows``), the trough plan in a rank's pass
order (``trough``). Pure Python."""
