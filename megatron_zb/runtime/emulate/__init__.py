"""Emulated compute: passes that wait their costs (``sleep_passes``) and vocabulary passes that do
the same with real collectives for barriers (``sleep_vocab``)."""
