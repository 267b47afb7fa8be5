"""Causal third-order HLA in parallel form: the whole sequence as one block of masked T x T
products, with no chunks and no carried summaries (fla's "parallel" layout). With
A = L * (Q K^T) (L the causal mask, s <= t):

    Y  = A K + Q S0           rows y_u = (S^K_u)^T q_u
    R  = A V + Q P0           rows r_u = P_u^T q_u
    O  = (L * (Q Y^T)) R + Q F0
    S' = S0 + K^T K,   P' = P0 + K^T V,   F' = F0 + Y^T R

since o_t = q_t^T F_t and F_t = F0 + sum_{u <= t} y_u r_u^T (serial.py's recurrence).
Cost per head: 5 T^2 D-sized products, plus T D^2 and T D Dv ones for start states given
and the final state asked for; no d x d map is formed per chunk. Memory: T x T per head,
so this form is for short sequences.
"""

from __future__ import annotations

import torch


def hla3_parallel(q, k, v, S0, P0, F0, need_final: bool):
    """q, k `[B, H, T, D]`, v `[B, H, T, Dv]` (compute dtype); S0 `[B, H, D, D]`, P0 and F0
    `[B, H, D, Dv]`, or all None (zeros) -> (outputs `[B, H, T, Dv]`, (S, P, F), or None
    when not `need_final`)."""
    T = q.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    A = (q @ k.mT).masked_fill(~causal, 0.0)
    Y, R = A @ k, A @ v
    if S0 is not None:
        Y, R = Y + q @ S0, R + q @ P0
    o = (q @ Y.mT).masked_fill(~causal, 0.0) @ R
    if F0 is not None:
        o = o + q @ F0
    if not need_final:
        return o, None
    S, P, F = k.mT @ k, k.mT @ v, Y.mT @ R
    if S0 is not None:
        S, P, F = S + S0, P + P0, F + F0
    return o, (S, P, F)
