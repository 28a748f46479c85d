"""The searched schedules' machinery: zb-auto's ranking, local search and ladder of limits
(``auto``), the V family's search (``vsearch``) and their building blocks, a fast timing for the
searches (``evaluate``), lower bounds (``bounds``), the exact MILP (``exact``). Pure Python."""
