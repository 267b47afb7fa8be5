"""The results layer both wings share: results files (`store`: atomic writes, locks,
resume; `bench_files`: the bench schema), the index of a results folder, the console
tables, the figures and the colours of the mixers."""
