"""How far a computed output is from an operator's float64 reference (its naive.py): the one
error measure of the tests, `hla-bench verify` and the benchmarks."""

from __future__ import annotations

import torch

NORMS = ("max", "fro")


def relative_error(output: torch.Tensor, reference: torch.Tensor, *, norm: str = "max") -> float:
    """|output - reference| / |reference| in float64, on the reference's device.

    norm "max": largest absolute difference over the reference's largest magnitude (every
    entry is held to a share of the largest one); "fro": the ratio of Frobenius norms (an
    average over entries, for tolerances set on whole tensors such as gradients).
    """
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    reference = reference.detach().double()
    difference = output.detach().to(reference.device, torch.float64) - reference
    if norm == "max":
        return (difference.abs().max() / reference.abs().max()).item()
    return (difference.norm() / reference.norm()).item()
