"""The simulator: when each pass of a schedule runs (``simulate``; ``plain``: its fast path), whether a
schedule is valid (``validate``), its messages (``lower``), the time per training iteration
(``iteration``), the host link offload runs on (``hostlink``) and what a split backward costs
(``split``). Pure Python."""
