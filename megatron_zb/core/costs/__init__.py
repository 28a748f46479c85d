"""What a model costs: its per-layer FLOPs and activation bytes (``model``, ``model_shapes``; named
public models in ``models``), its layout over the pipeline (``layout``, ``layout_search``), each model
chunk's costs (``chunk_costs``) and each microbatch's where lengths differ (``microbatch_costs``).
Pure Python."""
