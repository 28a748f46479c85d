"""`megatron-zb plan --optimizer-offload auto|trough`: the options and the lines printed after the
table (``core.optimizer.rows``, docs/optimizer_offload.md)."""
from __future__ import annotations

from typing import List

from ..argtypes import positive_float, positive_int

__all__ = ["add_optimizer_offload_args", "host_costs", "print_optimizer_offload"]

GIB = 2.0 ** 30


def add_optimizer_offload_args(pn) -> None:
    g = pn.add_argument_group("optimizer states in host memory (docs/optimizer_offload.md)")
    g.add_argument("--optimizer-offload", choices=("static", "auto", "trough"), default=None,
                   help="count every rank's optimizer step; a row that does not fit puts Adam states on the host: "
                        "one share for all ranks updated on the CPU (static, Megatron's --optimizer-offload-fraction), "
                        "each rank its own share (auto) or its own share visiting the GPU in the pipeline's troughs "
                        "(trough)")
    g.add_argument("--cpu-adam-gbps", type=positive_float("--cpu-adam-gbps"), default=None, metavar="GB/s",
                   help="memory traffic rate of a CPU Adam update per GPU (default 25: one GPU's share of the host)")
    g.add_argument("--gpu-adam-gbps", type=positive_float("--gpu-adam-gbps"), default=None, metavar="GB/s",
                   help="memory traffic rate of the fused GPU Adam update (default 2000)")
    g.add_argument("--optimizer-subgroups", type=positive_int("--optimizer-subgroups"), default=None, metavar="N",
                   help="each rank's offloaded share moves in N subgroups (default 16)")


def host_costs(args):
    if getattr(args, "optimizer_offload", None) is None:
        return None
    from ..core.optimizer.offload import HostCosts
    kw = {}
    for arg, k in (("host_link_gbps", "link_gbps"), ("cpu_adam_gbps", "cpu_update_gbps"),
                   ("gpu_adam_gbps", "gpu_update_gbps"), ("optimizer_subgroups", "subgroups")):
        v = getattr(args, arg, None)
        if v is not None:
            kw[k] = v
    return HostCosts(**kw)


def _gib(xs: List[float]) -> str:
    return " ".join(f"{x / GIB:.1f}" for x in xs)


def print_optimizer_offload(rows: List[dict], args) -> None:
    mode = getattr(args, "optimizer_offload", None)
    if mode is None:
        return
    c = host_costs(args)
    print(f"optimizer states ({mode}): each rank's optimizer step counted (GPU Adam {c.gpu_update_gbps:g} GB/s, "
          f"CPU Adam {c.cpu_update_gbps:g} GB/s, host link {c.link_gbps:g} GB/s per direction, "
          f"{c.subgroups} subgroups); rows over the budget offload each rank's own share:")
    for r in rows:
        o = r.get("optimizer_offload")
        if "error" in r or not o:
            continue
        if "error" in o:
            print(f"  {r['schedule']}: {o['error']} (per rank without, GiB: {_gib(o['peak_bytes_without'])})")
            continue
        shares = ", ".join(f"{f:.2f}" for f in o["fractions"])
        trough = [x for x in o["ranks"] if x]
        where = ""
        if trough:
            where = "; in the troughs: " + ", ".join(f"rank {x['rank']} {x['on_gpu']} on GPU/{x['on_cpu']} on CPU"
                                                     for x in trough)
        print(f"  {r['schedule']}: shares on the host per rank {shares}; peak GiB per rank without "
              f"{_gib(o['peak_bytes_without'])} -> with {_gib(o['peak_bytes_with'])}; step ms per rank "
              + " ".join(f"{1e3 * s:.1f}" for s in o["step_time_s"])
              + f"; iteration {1e3 * r['iteration_time_s']:.1f} ms (sync), "
              f"{1e3 * r['iteration_time_post_validated_s']:.1f} ms (post-validated){where}")
        print(f"    flags: {r['flags']}")
