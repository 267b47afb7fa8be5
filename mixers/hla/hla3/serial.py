"""Third-order HLA token by token: the causal recurrence and the paper's Alg. 3."""

from __future__ import annotations

import torch


def _outer(a, b):
    return a.unsqueeze(-1) * b.unsqueeze(-2)


def _vecmat(x, M):
    return (x.unsqueeze(-2) @ M).squeeze(-2)


def causal_recurrence(q_t, k_t, v_t, SK, P, F):
    """S^K <- S^K + k k^T;  P <- P + k v^T;  F <- F + (S^K q)(q^T P);  o <- q^T F."""
    SK = SK + _outer(k_t, k_t)
    P = P + _outer(k_t, v_t)
    F = F + _outer(_vecmat(q_t, SK), _vecmat(q_t, P))
    return _vecmat(q_t, F), SK, P, F


def paper_recurrence(q_t, k_t, v_t, SK, SQ, P, G):
    """One step of Alg. 3 (gamma = 1). G is G1 + G2 + G3 (they only enter the output summed):

        G += k (S^Q_prev k)^T P_prev + (S^K_prev q)(q^T P_prev) + S^K_prev S^Q_prev k v^T
        o = q^T (S^K S^Q P - G)   with the inclusive S^K, S^Q, P.
    """
    G = (G + _outer(k_t, _vecmat(_vecmat(k_t, SQ), P))
         + _outer(_vecmat(q_t, SK), _vecmat(q_t, P))
         + _outer(_vecmat(_vecmat(k_t, SQ), SK), v_t))
    SK = SK + _outer(k_t, k_t)
    SQ = SQ + _outer(q_t, q_t)
    P = P + _outer(k_t, v_t)
    o = _vecmat(_vecmat(_vecmat(q_t, SK), SQ), P) - _vecmat(q_t, G)
    return o, SK, SQ, P, G


def hla3_serial(q, k, v, carries, variant):
    """q, k `[B, H, T, D]`, v `[B, H, T, Dv]`; carries (S^K, P, F) for "causal" and
    (S^K, S^Q, P, F) for "paper" (F = S^K S^Q P - G, the corrected state of eq. 7.4).
    Returns outputs and the final carries."""
    if variant == "paper":
        SK, SQ, P, F = carries
        state, step = (SK, SQ, P, SK @ SQ @ P - F), paper_recurrence
    else:
        state, step = carries, causal_recurrence
    outputs = []
    for t in range(q.shape[2]):
        o, *state = step(q[:, :, t], k[:, :, t], v[:, :, t], *state)
        outputs.append(o)
    if variant == "paper":
        SK, SQ, P, G = state
        state = (SK, SQ, P, SK @ SQ @ P - G)
    return torch.stack(outputs, dim=2), tuple(state)
