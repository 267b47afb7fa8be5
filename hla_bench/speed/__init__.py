"""The speed wing: what the `bench` and `run` commands measure and how.

- `sweeps`: mixer specs and sweep settings (the SweepConfig: each setting, its default,
  kind and help declared once; config files and the `bench` options both read it).
- `timing`: timed calls, CUDA-graph replay, peak memory, percentiles, the per-point time limit.
- `runner`: the plan of points, the calls that time them, failures as results, resume.
- `isolate`: point groups run in child processes, so a fault ends one group, not the sweep.
- `compare`: two bench files side by side (`report --compare`).

A point's record (its fields, types, resume key and empty value) is part of the bench
file's schema: `hla_bench.results.records`. `sweeps` imports neither torch nor the mixers,
so a command can parse and check its input before the heavy imports; `timing` and `runner`
import torch.
"""
