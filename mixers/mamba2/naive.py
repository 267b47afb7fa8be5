"""Token-by-token Mamba-2 SSD recurrence: the ground truth the chunk and Triton forms match.

Per head h with scalar decay A_h < 0 and step size dt_t > 0:
  H_t = exp(dt_t A_h) H_{t-1} + dt_t B_t x_t^T      (H: [N, P], B_t: [N], x_t: [P])
  y_t = H_t^T C_t (+ D_h x_t)
"""

from __future__ import annotations

import torch


def expand_groups(x: torch.Tensor, heads: int) -> torch.Tensor:
    """`[B, T, G, N]` with G dividing `heads` -> `[B, T, heads, N]` (groups shared by heads)."""
    groups = x.shape[2]
    if heads % groups:
        raise ValueError(f"B and C groups ({groups}) must divide the heads of x ({heads})")
    return x if groups == heads else x.repeat_interleave(heads // groups, dim=2)


def ssd_step(x_t, dt_t, A, B_t, C_t, state, D=None):
    """One token: x_t `[b, h, P]`, dt_t `[b, h]`, A `[h]`, B_t/C_t `[b, h, N]`,
    state `[b, h, N, P]`; returns (y_t `[b, h, P]`, new state)."""
    decay = torch.exp(dt_t * A)[..., None, None]
    state = decay * state + (dt_t[..., None] * B_t).unsqueeze(-1) * x_t.unsqueeze(-2)
    y_t = (C_t.unsqueeze(-2) @ state).squeeze(-2)
    if D is not None:
        y_t = y_t + D[:, None] * x_t
    return y_t, state


def ssd_naive(x, dt, A, B, C, *, D=None, initial_state=None):
    """Serial SSD: x `[b, T, h, P]`, dt `[b, T, h]`, A `[h]`, B/C `[b, T, g, N]`;
    returns (y `[b, T, h, P]`, final state `[b, h, N, P]`)."""
    b, T, h, P = x.shape
    B, C = expand_groups(B, h), expand_groups(C, h)
    state = (x.new_zeros(b, h, B.shape[-1], P) if initial_state is None
             else initial_state.to(x.dtype))
    outputs = []
    for t in range(T):
        y_t, state = ssd_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], state, D)
        outputs.append(y_t)
    return torch.stack(outputs, 1), state
