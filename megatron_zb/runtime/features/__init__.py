"""Runtime features that hook into the executor (``runtime.hooks``) or run its feature passes:
activation offload (``offload``), optimizer post-validation (``postval``), optimizer states
through the troughs (``optim_trough``), the replicas' gradient all-reduce (``replica``), the
vocabulary passes on a rank's output shard (``vocab``) and input shard (``vocab_input``)."""
