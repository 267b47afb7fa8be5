"""AHLA as its explicit finite sum: the float64 ground truth for tests (O(T^3) memory)."""

from __future__ import annotations

import torch


def ahla2_naive(q, k, v, *, normalize=False, eps=1e-6, decay=None):
    """`[B, T, H, D]` inputs -> `[B, T, H, Dv]` outputs, computed in float64 as

        o_t = sum_{j <= i <= t} g^(t - j) (q_t . k_i) (q_i . k_j) v_j

    (the weights Alg. 2's recurrence produces; g = 1 without decay), divided by the same sum
    with v_j = 1, plus eps, when normalized.
    """
    q, k, v = (x.double() for x in (q, k, v))
    T, H = q.shape[1], q.shape[2]
    pos = torch.arange(T)
    t, i, j = pos.view(-1, 1, 1), pos.view(1, -1, 1), pos.view(1, 1, -1)
    region = ((j <= i) & (i <= t)).double()                            # [t, i, j]
    g = torch.ones(H, dtype=torch.float64) if decay is None else \
        torch.as_tensor(decay, dtype=torch.float64).expand(H)
    weight = region * g.view(H, 1, 1, 1) ** (t - j).clamp(min=0).double()   # [H, t, i, j]
    qk = torch.einsum("bthd,bshd->bhts", q, k)                         # (q_t . k_s)
    w = torch.einsum("htij,bhti,bhij->bhtj", weight, qk, qk)           # weight on v_j
    o = torch.einsum("bhtj,bjhe->bthe", w, v)
    if normalize:
        o = o / (w.sum(-1).transpose(1, 2).unsqueeze(-1) + eps)
    return o
