"""AHLA as an associative scan over per-token segment summaries (paper §6.2).

A segment X is summarized by (R, P, E, rho): R = sum_i k_i q_i^T (the key-query moment, NOT
decayed), P and E the segment-local states of Alg. 2 (decayed to the segment's end), and
rho = g^len. Concatenating A then B:

    (R_A + R_B,  rho_B P_A + P_B,  rho_B E_A + E_B + rho_B R_B P_A,  rho_A rho_B)

The cross term: for i in B, P_i gains g^(i - end_A) P_A, which reaches E at the end of B
with weight g^(end_B - i), so the sum is rho_B (sum_{i in B} k_i q_i^T) P_A. Hence R must
combine undecayed; the paper's "rho_B R_A + R_B" would break the scan for g < 1.
"""

from __future__ import annotations

from typing import Callable

import torch


def inclusive_scan(elements: tuple[torch.Tensor, ...], combine: Callable,
                   dim: int = 2) -> tuple[torch.Tensor, ...]:
    """Inclusive prefix combination along `dim` in log2(T) parallel steps (Hillis-Steele).

    `combine(earlier, later)` takes and returns tuples like `elements`; it must be associative.
    """
    length = elements[0].shape[dim]
    offset = 1
    while offset < length:
        earlier = tuple(x.narrow(dim, 0, length - offset) for x in elements)
        later = tuple(x.narrow(dim, offset, length - offset) for x in elements)
        joined = combine(earlier, later)
        elements = tuple(torch.cat([x.narrow(dim, 0, offset), y], dim=dim)
                         for x, y in zip(elements, joined))
        offset *= 2
    return elements


def combine(a, b):
    R_a, P_a, E_a, rho_a = a
    R_b, P_b, E_b, rho_b = b
    return (R_a + R_b, rho_b * P_a + P_b, rho_b * (E_a + R_b @ P_a) + E_b, rho_a * rho_b)


def ahla2_scan(q, k, v, P0, E0, decay):
    """q, k `[B, H, T, D]`, v `[B, H, T, Dv]`, carries P0, E0 `[B, H, D, Dv]`, decay `[H]`
    or None. Returns outputs `[B, H, T, Dv]` and the final (P, E)."""
    B, H, T, _ = q.shape
    outer_kv = k.unsqueeze(-1) * v.unsqueeze(-2)
    R = k.unsqueeze(-1) * q.unsqueeze(-2)
    E = (q * k).sum(-1)[..., None, None] * outer_kv          # k (q^T k v^T)
    rho = torch.ones(1, H, T, 1, 1, dtype=q.dtype, device=q.device)
    if decay is not None:
        rho = rho * decay.to(q.dtype).view(1, H, 1, 1, 1)
    R, P, E, rho = inclusive_scan((R, outer_kv, E, rho), combine)
    P = rho * P0.unsqueeze(2) + P                             # carry in the initial state
    E = rho * (E0.unsqueeze(2) + R @ P0.unsqueeze(2)) + E
    o = (q.unsqueeze(-2) @ E).squeeze(-2)
    return o, (P[:, :, -1], E[:, :, -1])
