"""Running a schedule inside megatron-core: the forward-backward function, Megatron's passes as the
executor's, gradient synchronisation and finalisation, the weight-gradient split (B/W)."""
