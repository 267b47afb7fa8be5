"""Registers the built-in mixers (imported by `hla_bench.registry` on first use)."""
