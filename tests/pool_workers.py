"""Stand-ins for hla_bench.training._worker in the spawned processes of a recall pool (a
module of their own: the pool pickles its function by name)."""

import time

from hla_bench.training import RETRY_WITH_FEWER


def memory_bound(group: list[dict], options: dict):
    """A "big" group runs out of memory whenever it starts beside another group."""
    time.sleep(0.3)
    if group[0]["mixer"] == "big" and options["shared"]:
        return RETRY_WITH_FEWER
    return [{**spec, "status": "ok", "shared": options["shared"]} for spec in group]
