"""The verification harness's processes: the launcher (``launch``: N gloo processes, never
hanging), the ranks' side (``zygote``: import once, fork, reap), the test suite's warm zygote
(``zygote_server``), what the two exchange (``rankio``), ranks sharing a GPU (``cuda_gloo``: gloo
messages staged through the host; ``green_context``: a rank's share of the SMs)."""
