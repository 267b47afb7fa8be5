"""The results layer both wings share: results files (`store`: atomic writes, locks,
resume; `load`: the one loader and its checks; `bench_files`: the bench schema, `records`:
a bench point's record), the index of a results folder, the console tables, the figures
and the colours of the mixers. It imports neither wing: what both wings write, this layer
reads and checks."""
