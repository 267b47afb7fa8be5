"""Third-order HLA as associative scans over per-token segment summaries.

Causal variant (derived here; no d^3 objects). For the prefix sums S (= sum k k^T) and
P (= sum k v^T), F_t = sum_{u <= t} S_u q_u q_u^T P_u. A segment X is summarized by

    S, P, F (its local states), Q = sum q_u q_u^T, X = sum q_u q_u^T P_u, Y = sum S_u q_u q_u^T

(S_u, P_u local to the segment). For u in B after A, S_u = S_A + S^B_u and P_u = P_A + P^B_u,
so concatenating A then B gives

    S = S_A + S_B,  P = P_A + P_B,  Q = Q_A + Q_B,
    X = X_A + X_B + Q_B P_A,        Y = Y_A + Y_B + S_A Q_B,
    F = F_A + F_B + S_A X_B + Y_B P_A + S_A Q_B P_A.

Paper variant (Alg. 4, eqs. 7.6-7.7): (S^K, S^Q, P, F, R^QP, U^KQ, M^KQP) with
F = F_A + F_B + S^K_A R^QP_B + M^KQP_B[S^Q_A] + U^KQ_B P_A, where the linear map
M[Z] = sum_t k_t (k_t^T Z k_t) v_t^T is held as the tensor sum_t k (x) k (x) k (x) v
(d^3 dv entries per summary) and applied by contraction.
"""

from __future__ import annotations

import torch

from mixers.hla.ahla2.scan import inclusive_scan


def _outer(a, b):
    return a.unsqueeze(-1) * b.unsqueeze(-2)


def combine_causal(a, b):
    S_a, P_a, Q_a, X_a, Y_a, F_a = a
    S_b, P_b, Q_b, X_b, Y_b, F_b = b
    QP_a = Q_b @ P_a
    return (S_a + S_b, P_a + P_b, Q_a + Q_b, X_a + X_b + QP_a, Y_a + Y_b + S_a @ Q_b,
            F_a + F_b + S_a @ (X_b + QP_a) + Y_b @ P_a)


def combine_paper(a, b):
    SK_a, SQ_a, P_a, F_a, R_a, U_a, M_a = a
    SK_b, SQ_b, P_b, F_b, R_b, U_b, M_b = b
    F = F_a + F_b + SK_a @ R_b + torch.einsum("...abce,...bc->...ae", M_b, SQ_a) + U_b @ P_a
    return SK_a + SK_b, SQ_a + SQ_b, P_a + P_b, F, R_a + R_b, U_a + U_b, M_a + M_b


def hla3_scan(q, k, v, carries, variant):
    """q, k `[B, H, T, D]`, v `[B, H, T, Dv]`; carries as in `hla3_serial`.
    Returns outputs and the final carries."""
    qk = (q * k).sum(-1)[..., None, None]
    KK, QQ, KV = _outer(k, k), _outer(q, q), _outer(k, v)
    QV = qk * _outer(q, v)                       # q q^T k v^T
    KQ = qk * _outer(k, q)                       # k k^T q q^T
    F = qk * qk * KV                             # k k^T q q^T k v^T
    if variant == "causal":
        tokens = (KK, KV, QQ, QV, KQ, F)
        S, P, Q, X, Y, F = inclusive_scan(tokens, combine_causal)
        S0, P0, F0 = (x.unsqueeze(2) for x in carries)
        F = F0 + F + S0 @ (X + Q @ P0) + Y @ P0
        S, P = S0 + S, P0 + P
        state = (S, P, F)
    else:
        M = torch.einsum("...a,...b,...c,...e->...abce", k, k, k, v)
        tokens = (KK, QQ, KV, F, QV, KQ, M)
        SK, SQ, P, F, R, U, M = inclusive_scan(tokens, combine_paper)
        SK0, SQ0, P0, F0 = (x.unsqueeze(2) for x in carries)
        F = F0 + F + SK0 @ R + torch.einsum("...abce,...bc->...ae", M, SQ0) + U @ P0
        state = (SK0 + SK, SQ0 + SQ, P0 + P, F)
    o = (q.unsqueeze(-2) @ state[-1]).squeeze(-2)
    return o, tuple(x[:, :, -1] for x in state)
