"""Causal third-order HLA in chunks of C tokens: dense masked C x C products inside.

For a chunk with carries (S0, P0, F0), local Q, K, V (C x d), A = Q K^T, L the lower
triangle (with diagonal):

    r  = Q P0 + (L * A) V                              # rows q_u^T P_u
    Bm = L * ((Q S0) Q^T + A (L * A)^T)                # Bm[t, u] = q_t^T S_u q_u
    O  = Q F0 + Bm r
    S' = S0 + K^T K,   P' = P0 + K^T V
    F' = F0 + S0 (Q^T r) + K^T ((L * A)^T r)

The carries are exclusive prefix sums of per-chunk terms (no decay, shifted inclusive sums:
a chunk's carry never reads its own or a later chunk's term), so every chunk is processed at
once. Zero padding of the last chunk adds nothing to any state.
"""

from __future__ import annotations

import torch

from mixers.common import exclusive_cumsum, pad_to_multiple


def hla3_chunk(q, k, v, carries, chunk_size):
    """q, k `[B, H, T, D]`, v `[B, H, T, Dv]`, carries (S0, P0, F0) `[B, H, D, D|Dv]`.
    Returns outputs and the final (S, P, F)."""
    B, H, T, D = q.shape
    C = min(chunk_size, T)
    N = -(-T // C)
    q, k, v = (pad_to_multiple(x, C, dim=2).view(B, H, N, C, -1) for x in (q, k, v))
    S0, P0, F0 = carries
    L = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    A = q @ k.transpose(-1, -2)
    LA = torch.where(L, A, 0)
    kT = k.transpose(-1, -2)
    dS, dP = kT @ k, kT @ v
    S = S0.unsqueeze(2) + exclusive_cumsum(dS, 2)
    P = P0.unsqueeze(2) + exclusive_cumsum(dP, 2)
    r = q @ P + LA @ v
    Bm = torch.where(L, (q @ S) @ q.transpose(-1, -2) + A @ LA.transpose(-1, -2), 0)
    dF = S @ (q.transpose(-1, -2) @ r) + kT @ (LA.transpose(-1, -2) @ r)
    F = F0.unsqueeze(2) + exclusive_cumsum(dF, 2)
    o = q @ F + Bm @ r
    final = (S0 + dS.sum(2), P0 + dP.sum(2), F0 + dF.sum(2))
    return o.reshape(B, H, N * C, -1)[:, :, :T], final
