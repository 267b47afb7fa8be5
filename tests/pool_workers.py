"""Stand-ins for hla_bench.recall.pool._worker in the spawned processes of a recall pool (a
module of their own: the pool pickles its function by name)."""

import os
import time
from pathlib import Path

from hla_bench.recall.pool import RETRY_WITH_FEWER

# memory_bound's groups run for RUN_CHECKS x 50 ms: long against the spread of the pool's
# worker start-up (each spawned process imports torch), so groups started together overlap
RUN_CHECKS = 20


def memory_bound(group: list[dict], options: dict):
    """A "big" group runs out of memory when another group runs at any time during its own
    run, whichever started first; it then answers as run_group does: RETRY_WITH_FEWER when
    told that others may run beside it, else its runs are out of memory. Running groups
    mark themselves in the directory `group[0]["marks"]`."""
    from hla_bench.recall.pool import failed_result

    marks = Path(group[0]["marks"])
    mark = marks / str(os.getpid())
    mark.touch()
    try:
        crowded = False
        for _ in range(RUN_CHECKS):
            time.sleep(0.05)
            crowded = crowded or any(other != mark for other in marks.iterdir())
    finally:
        mark.unlink()
    if group[0]["mixer"] == "big" and crowded:
        if options["shared"]:
            return RETRY_WITH_FEWER
        return [failed_result(spec, "oom", "CUDA out of memory") for spec in group]
    return [{**spec, "status": "ok", "shared": options["shared"]} for spec in group]


def cuda_fault(group: list[dict], options: dict):
    """A "bad" group's kernels fault: beside other groups it cannot tell whose fault it was,
    alone it is its own. Every result says which process ran it and when it started."""
    from hla_bench.recall.pool import RETRY_ALONE, CudaFault, failed_result

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
