"""AHLA in chunks of C tokens: dense masked C x C products inside, (P, E) carried across.

For a chunk with carries (P0, E0), local Q, K, V (C x d, positions s = 0..C-1), decay g:

    W = D * (Q K^T),  D[s, i] = g^(s - i) for i <= s (else 0),  g_in[s] = g^(s + 1)
    X = g_in * (Q P0) + W V             # rows r_s = q_s^T P_s
    O = g_in * (Q E0) + W X
    P' = g^len P0 + K^T (g_out * V),    g_out[i] = g^(len - 1 - i) (0 past the chunk's end)
    E' = g^len (E0 + (K^T Q) P0) + K^T (g_out * (W V))

The carries are a first-order scan over chunks (a loop of d x dv updates); everything
else is batched over all chunks. The last chunk is zero-padded; its `len` is the number of
real tokens, so padding never decays the final state.
"""

from __future__ import annotations

import torch

from mixers.common import pad_to_multiple


def ahla2_chunk(q, k, v, P0, E0, decay, chunk_size):
    """q, k `[B, H, T, D]`, v `[B, H, T, Dv]`; returns outputs and the final (P, E)."""
    B, H, T, D = q.shape
    C = min(chunk_size, T)
    N = -(-T // C)
    q, k, v = (pad_to_multiple(x, C, dim=2).view(B, H, N, C, -1) for x in (q, k, v))
    log_g = torch.zeros(H, dtype=q.dtype, device=q.device)
    if decay is not None:
        log_g = torch.log(decay.to(q.dtype))
    log_g = log_g.view(H, 1, 1)
    s = torch.arange(C, device=q.device)
    # tokens per chunk (the last may be short); built on the device, so a CUDA graph can
    # capture it (a Python-number write into a CUDA tensor is a host copy)
    lengths = (T - torch.arange(N, device=q.device) * C).clamp(max=C)
    causal = s.view(-1, 1) >= s.view(1, -1)
    D_mask = torch.where(causal, torch.exp((s.view(-1, 1) - s.view(1, -1)).clamp(min=0) * log_g), 0)
    g_in = torch.exp((s + 1) * log_g).view(1, H, 1, C, 1)
    to_end = lengths.view(-1, 1) - 1 - s.view(1, -1)                      # [N, C]
    g_out = torch.where(to_end >= 0, torch.exp(to_end.clamp(min=0) * log_g), 0)
    g_out = g_out.view(1, H, N, C, 1)
    g_len = torch.exp(lengths * log_g.view(H, 1)).view(1, H, N, 1, 1)

    W = (q @ k.transpose(-1, -2)) * D_mask.view(1, H, 1, C, C)
    WV = W @ v
    KQ = k.transpose(-1, -2) @ q
    dP = k.transpose(-1, -2) @ (g_out * v)
    dE = k.transpose(-1, -2) @ (g_out * WV)
    P, E, P_starts, E_starts = P0, E0, [], []
    for c in range(N):
        P_starts.append(P)
        E_starts.append(E)
        P, E = (g_len[:, :, c] * P + dP[:, :, c],
                g_len[:, :, c] * (E + KQ[:, :, c] @ P) + dE[:, :, c])
    X = g_in * (q @ torch.stack(P_starts, dim=2)) + WV
    o = g_in * (q @ torch.stack(E_starts, dim=2)) + W @ X
    return o.reshape(B, H, N * C, -1)[:, :, :T], (P, E)
