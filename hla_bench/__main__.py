"""`python -m hla_bench` runs the CLI (same as the `hla-bench` script)."""

from hla_bench.cli import main

main()
