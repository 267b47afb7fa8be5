"""How busy each GPU was while a sweep ran, sampled from nvidia-smi.

`GpuUse()` starts a daemon thread that reads every GPU's utilisation and memory in use
(`nvidia-smi --query-gpu=index,utilization.gpu,memory.used`) every `interval` seconds, until
`stop()`; `summary()` gives, per GPU, the number of samples, the mean and median utilisation
and the most memory in use. Utilisation is nvidia-smi's: the share of its last sample period
during which some kernel ran on the GPU. Under CUDA MPS the kernels of several processes
overlap and count once, so it says how much of the time the GPU was busy, not how much of
it the kernels used.

Without nvidia-smi (or when it fails) the summary says why instead; a sweep never stops
for it.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading

QUERY = ["--query-gpu=index,utilization.gpu,memory.used", "--format=csv,noheader,nounits"]
INTERVAL_S = 2.0


def read_gpus(timeout: float = 10.0) -> list[tuple[int, float, float]] | str:
    """One sample: (index, utilisation %, memory used MiB) per GPU, or why there is none."""
    command = shutil.which("nvidia-smi")
    if command is None:
        return "nvidia-smi not found"
    try:
        done = subprocess.run([command, *QUERY], capture_output=True, text=True,
                              timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"nvidia-smi failed: {type(error).__name__}"
    if done.returncode != 0:
        return f"nvidia-smi exited {done.returncode}: {done.stderr.strip()[:200]}"
    rows = []
    for line in done.stdout.splitlines():
        fields = [field.strip() for field in line.split(",")]
        try:
            rows.append((int(fields[0]), float(fields[1]), float(fields[2])))
        except (IndexError, ValueError):
            continue  # "[N/A]" or a line of another shape: not a sample
    return rows or f"nvidia-smi gave no sample: {done.stdout.strip()[:200]!r}"


class GpuUse:
    """Samples every `interval` seconds on a daemon thread from construction to `stop()`."""

    def __init__(self, interval: float = INTERVAL_S):
        self.interval = interval
        self.samples: dict[int, list[tuple[float, float]]] = {}
        self.problem: str | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-use", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            sample = read_gpus()
            with self._lock:
                if isinstance(sample, str):
                    self.problem = sample
                else:
                    for index, utilization, memory in sample:
                        self.samples.setdefault(index, []).append((utilization, memory))
            if self._stopped.wait(self.interval):
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=15)

    def summary(self) -> list[dict] | dict:
        """Per GPU: index, samples, utilization_mean and utilization_median (%),
        memory_used_max_mib; or {"unavailable": why} when no sample was read."""
        with self._lock:
            samples = {index: list(rows) for index, rows in self.samples.items()}
            problem = self.problem
        if not samples:
            return {"unavailable": problem or "no sample yet"}
        return [{"index": index, "samples": len(rows),
                 "utilization_mean": round(statistics.fmean(u for u, _ in rows), 1),
                 "utilization_median": round(statistics.median(u for u, _ in rows), 1),
                 "memory_used_max_mib": max(m for _, m in rows)}
                for index, rows in sorted(samples.items())]
