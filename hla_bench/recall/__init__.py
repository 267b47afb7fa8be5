"""The recall wing: what the `recall` command trains, how, and how its results read.

`command`: the command; `schema`: the config's keys (defaults, checks, help); `plan`: a
config checked and expanded into run specs; `pool`: groups of runs on worker processes or
Dask, failures as results; `train`: one group's training (`RunSpec`, `train_group`);
`model`, `stacked`, `kernels`: the tiny LM, N stacked as one, their fused kernels;
`report`: a recall file's tables, plots and published scores.
"""
