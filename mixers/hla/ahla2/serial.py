"""AHLA token by token: the paper's Alg. 2 (with decay), the streaming/decode path."""

from __future__ import annotations

import torch


def ahla2_recurrence(q_t, k_t, v_t, P, E, decay):
    """One step of Alg. 2 on `[B, H, D]` q_t, k_t, `[B, H, Dv]` v_t and `[B, H, D, Dv]` P, E.

    P <- g P + k v^T;  r <- q^T P;  E <- g E + k r^T;  o <- q^T E.
    """
    g = 1.0 if decay is None else decay.to(P.dtype).view(1, -1, 1, 1)
    P = g * P + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
    r = (q_t.unsqueeze(-2) @ P).squeeze(-2)
    E = g * E + k_t.unsqueeze(-1) * r.unsqueeze(-2)
    o = (q_t.unsqueeze(-2) @ E).squeeze(-2)
    return o, P, E


def ahla2_serial(q, k, v, P0, E0, decay):
    """q, k `[B, H, T, D]`, v `[B, H, T, Dv]`; returns outputs and the final (P, E)."""
    P, E, outputs = P0, E0, []
    for t in range(q.shape[2]):
        o, P, E = ahla2_recurrence(q[:, :, t], k[:, :, t], v[:, :, t], P, E, decay)
        outputs.append(o)
    return torch.stack(outputs, dim=2), (P, E)
