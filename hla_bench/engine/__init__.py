"""The bench engine: what the `bench` and `run` commands measure and how.

- `config`: mixer specs and sweep settings (each setting, its default, kind and help declared
  once; config files and the `bench` options both read it), config files.
- `records`: the point record (its fields, types, resume key and empty value, one table).
- `timing`: timed calls, CUDA-graph replay, peak memory, percentiles, the per-point time limit.
- `runner`: the plan of points, the calls that time them, failures as results, resume.

`config` and `records` import neither torch nor the mixers, so a command can parse and
check its input before the heavy imports; `timing` and `runner` import torch.
"""
