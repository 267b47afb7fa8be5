"""Brute-force hla2 as explicit finite sums (spec §1, §1.1), computed in float64.

The ground truth for tests: every other form must reproduce these sums. With
w(t, i, j) = (q_t . k_i)(q_j . k_i) and per-head decay g (1 without decay):
* masked, decay_form="masked":  sum_{i <= j <= t} g^{(t-i)+(t-j)} w v_j
* masked, decay_form="paper":   sum_{i, j <= t} g^{2t-i-j} w v_j - sum_{j < i <= t} g^{t-1-j} w v_j
                                (the closed form of the paper's §4.3 recurrence)
* unmasked:                     sum_{i, j <= t} g^{2t-i-j} w v_j
ridge adds ridge * sum_{j <= t} g^{t-j} (q_t . q_j) v_j (the S_t + ridge*I read-out);
normalize divides by the same sums with v_j = 1, plus eps.
"""

from __future__ import annotations

import torch


def hla2_naive(q, k, v, *, masked=True, normalize=False, eps=1e-6, ridge=0.0, decay=None,
               decay_form="masked") -> torch.Tensor:
    """o [B, T, H, Dv] in float64; k, v may have one shared head (multi-query)."""
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))  # [B, H, T, .]
    H, T = q.shape[1], q.shape[2]
    k, v = k.expand(-1, H, -1, -1), v.expand(-1, H, -1, -1)
    if normalize:
        v = torch.cat([v, torch.ones_like(v[..., :1])], -1)
    g = torch.ones(H, dtype=torch.float64) if decay is None else \
        torch.as_tensor(decay, dtype=torch.float64).expand(H)
    g = g.to(q.device).view(H, 1, 1, 1)

    idx = torch.arange(T, device=q.device)
    t, i, j = idx.view(T, 1, 1), idx.view(1, T, 1), idx.view(1, 1, T)
    causal = (i <= t) & (j <= t)
    both = g ** ((2 * t - i - j).clamp(min=0)) * causal  # [H, t, i, j]
    if not masked:
        weight = both
    elif decay_form == "paper" and decay is not None:
        weight = both - g ** ((t - 1 - j).clamp(min=0)) * ((j < i) & (i <= t))
    else:
        weight = both * (i <= j)

    qk = q @ k.transpose(-1, -2)  # [B, H, x, i] = q_x . k_i
    out = torch.einsum("bhti,bhji,htij,bhjv->bhtv", qk, qk, weight, v)
    if ridge:
        tt, jj = idx.view(T, 1), idx.view(1, T)
        lin = g.view(H, 1, 1) ** (tt - jj).clamp(min=0) * (jj <= tt)
        out = out + ridge * torch.einsum("bhtj,htj,bhjv->bhtv", q @ q.transpose(-1, -2), lin, v)
    if normalize:
        out = out[..., :-1] / (out[..., -1:] + eps)
    return out.transpose(1, 2)
