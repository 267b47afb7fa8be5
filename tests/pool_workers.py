"""Stand-ins for hla_bench.training._worker in the spawned processes of a recall pool (a
module of their own: the pool pickles its function by name)."""

import os
import time

from hla_bench.training import RETRY_WITH_FEWER


def memory_bound(group: list[dict], options: dict):
    """A "big" group runs out of memory whenever it starts beside another group."""
    time.sleep(0.3)
    if group[0]["mixer"] == "big" and options["shared"]:
        return RETRY_WITH_FEWER
    return [{**spec, "status": "ok", "shared": options["shared"]} for spec in group]


def cuda_fault(group: list[dict], options: dict):
    """A "bad" group's kernels fault: beside other groups it cannot tell whose fault it was,
    alone it is its own. Every result says which process ran it and when it started."""
    from hla_bench.training import RETRY_ALONE, CudaFault, failed_result

    started = time.time()
    time.sleep(0.3)
    seen = {"pid": os.getpid(), "started": started, "isolated": options["isolated"]}
    if group[0]["mixer"] == "bad":
        if not options["isolated"]:
            return RETRY_ALONE
        return CudaFault([{**failed_result(spec, "error", "AcceleratorError: CUDA error: "
                                           "device-side assert triggered"), **seen}
                          for spec in group])
    return [{**spec, "status": "ok", **seen} for spec in group]
