"""Launching a run: megatron-zb's flags and their checks, the start-up before Megatron trains, the
session around Megatron's training loop, the model chunks built for a placement, errors inside ranks."""
