"""The recall wing: what the `recall` command trains, how, and how its results read.

- `command`: the `recall` command (options, the plan run on a pool, the results store).
- `plan`: the recall config (file and options) checked and expanded into run specs.
- `pool`: runs planned into groups, trained on worker processes or a Dask cluster, failures
  as results.
- `train`: one group's training step, evaluation and checkpoints (`RunSpec`, `train_group`).
- `model`, `stacked`, `kernels`: the tiny LM, N of them stacked as one, their fused kernels.
- `report`: a recall file's tables, plots and published scores.
"""
