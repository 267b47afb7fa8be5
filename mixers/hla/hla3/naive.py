"""Third-order HLA as explicit finite sums over (i, u, j): float64 ground truths (O(T^4))."""

from __future__ import annotations

import torch


def hla3_naive(q, k, v, *, variant="causal", normalize=False, eps=1e-6):
    """`[B, T, H, D]` inputs -> `[B, T, H, Dv]` outputs in float64:

        o_t = sum_{(i, u, j) in region_t} (q_t . k_i) (q_u . k_i) (q_u . k_j) v_j

    causal: region_t = {u <= t, i <= u, j <= u};
    paper:  region_t = {(i, u, j) in [1..t]^3 whose maximum is attained at least twice}
            (what the paper's Alg. 3 computes; docs/discrepancies.md).
    Normalized: divided by the same sum with v_j = 1, plus eps.
    """
    q, k, v = (x.double() for x in (q, k, v))
    pos = torch.arange(q.shape[1])
    t, i, u, j = (pos.view([-1 if a == b else 1 for b in range(4)]) for a in range(4))
    if variant == "causal":
        region = (u <= t) & (i <= u) & (j <= u)
    else:
        top = torch.maximum(torch.maximum(i, u), j)
        region = (top <= t) & ((i == top).long() + (u == top).long() + (j == top).long() >= 2)
    qk = torch.einsum("bthd,bshd->bhts", q, k)                             # (q_t . k_s)
    w = torch.einsum("tiuj,bhti,bhui,bhuj->bhtj", region.double(), qk, qk, qk)
    o = torch.einsum("bhtj,bjhe->bthe", w, v)
    if normalize:
        o = o / (w.sum(-1).transpose(1, 2).unsqueeze(-1) + eps)
    return o
