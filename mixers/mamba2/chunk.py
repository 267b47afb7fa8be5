"""Chunked SSD (Mamba-2's state-space duality) in plain PyTorch.

Within a chunk of C tokens with cumulative log decay a_t = sum_{s<=t} dt_s A:
  y_t = sum_{s<=t} exp(a_t - a_s) (C_t . B_s) dt_s x_s + exp(a_t) C_t^T H_0,
and the chunk hands H' = exp(a_C) H_0 + sum_s exp(a_C - a_s) dt_s B_s x_s^T to the next one.
Padding the sequence with dt = 0 tokens is exact for outputs and final state (no decay,
no input), so any chunk size works for any length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixers.mamba2.naive import expand_groups


def ssd_chunk(x, dt, A, B, C, *, D=None, chunk_size=64, initial_state=None):
    """x `[b, T, h, P]`, dt `[b, T, h]`, A `[h]`, B/C `[b, T, g, N]` -> (y, final state
    `[b, h, N, P]`); computes in float32 (float64 for float64 inputs)."""
    b, T, h, P = x.shape
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    B, C = expand_groups(B, h), expand_groups(C, h)
    N, L = B.shape[-1], chunk_size
    x_in = x
    pad = (-T) % L
    x, B, C = (F.pad(t.to(dtype), (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
    dt = F.pad(dt.to(dtype), (0, 0, 0, pad))
    n = x.shape[1] // L
    # Chunked, head-major views: [b, h, n, L, *] and [b, h, n, L].
    x, B, C = (t.view(b, n, L, h, -1).permute(0, 3, 1, 2, 4) for t in (x, B, C))
    dt = dt.view(b, n, L, h).permute(0, 3, 1, 2)
    log_decay = (dt * A.to(dtype)[:, None, None]).cumsum(-1)            # a_t within chunks

    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    gaps = (log_decay.unsqueeze(-1) - log_decay.unsqueeze(-2)).masked_fill(~causal, -torch.inf)
    weights = (C @ B.transpose(-1, -2)) * gaps.exp() * dt.unsqueeze(-2)
    y = weights @ x                                                      # intra-chunk

    to_end = (log_decay[..., -1:] - log_decay).exp() * dt                # [b, h, n, L]
    chunk_states = (B * to_end.unsqueeze(-1)).transpose(-1, -2) @ x     # [b, h, n, N, P]
    chunk_decay = log_decay[..., -1].exp()                               # [b, h, n]
    state = (x.new_zeros(b, h, N, P) if initial_state is None else initial_state.to(dtype))
    starts = []
    for i in range(n):
        starts.append(state)
        state = chunk_decay[:, :, i, None, None] * state + chunk_states[:, :, i]
    y = y + (C * log_decay.exp().unsqueeze(-1)) @ torch.stack(starts, 2)  # inter-chunk

    y = y.permute(0, 2, 3, 1, 4).reshape(b, n * L, h, P)[:, :T]
    if D is not None:
        y = y + D.to(dtype)[:, None] * x_in.to(dtype)
    return y, state
