"""hla-bench: benchmark harness for long-context sequence mixers."""

__version__ = "0.1.0"
