"""Child processes that never outlive the command that started them."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from pathlib import Path


def exit_with_parent(parent: int) -> None:
    """Called first in a child: the kernel kills it when the parent dies (Linux), and a
    watchdog thread exits when the parent pid changes (elsewhere, or if that failed)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True).start()


def how_it_ended(exitcode: int | None) -> str:
    """A process's end in words: `exit code 3`, `killed by SIGKILL`."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def cuda_mps_active(proc: str | Path = "/proc") -> bool:
    """Whether a CUDA MPS control daemon runs on this host. Without one, the processes that
    share a GPU take turns on it; with one, their kernels run side by side, which is what
    several recall workers per GPU need to fill it."""
    for comm in Path(proc).glob("[0-9]*/comm"):
        try:
            if comm.read_text().strip().startswith("nvidia-cuda-mps"):
                return True
        except OSError:
            continue
    return False
