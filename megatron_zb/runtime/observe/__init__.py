"""What the runtime measures: passes, waits and memory over a window (``profiler``; its JSON:
``profile_data``), activation memory per pass (``memory``), each rank's progress in the job's store
(``progress``), stacks of a stuck rank (``stack_dump``), this device's host link and matmul speed
(``measure``)."""
