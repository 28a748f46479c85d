"""Runs that time schedules on real processes: emulated compute (``emulate``: passes that wait their
costs; ``emulate_vocab``: Megatron's 1F1B with its best layout against plan's best row with
vocabulary parallelism), and the GPU check's real pipeline on one GPU (``realpipe``)."""
