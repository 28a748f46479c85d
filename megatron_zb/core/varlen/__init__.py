"""Variable-length batches (docs/varlen.md): lengths files and distributions (``seqlens``), the
balancer (``balance``), list schedules for per-microbatch costs (``mb_schedule``) and one global
batch end to end (``batch``). Pure Python."""
