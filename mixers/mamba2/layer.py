"""A compact Mamba-2 block on the functional SSD (runs on CPU through the chunk form).

in_proj -> (z, x, B, C, dt); short causal conv + SiLU on (x, B, C); dt = softplus(dt + bias);
SSD with A = -exp(A_log) and a D skip; gated RMSNorm of y * SiLU(z); out_proj.
B and C are shared by all heads (one group), as in Mamba-2.

`forward_stacked` runs N copies with stacked parameters (see `mixers.layer`): their heads
go side by side into one SSD call, with one B/C group per copy.
"""

from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F

from mixers.layer import ShortConv, stacked_causal_conv, stacked_linear
from mixers.mamba2 import ssd, ssd_parameters


class Mamba2Block(nn.Module):
    """`[B, T, d_model]` -> `[B, T, d_model]`; head dim = expand * d_model / n_heads."""

    def __init__(self, d_model: int, n_heads: int, *, d_state: int = 64, expand: int = 2,
                 short_conv: int = 4, chunk_size: int = 64, impl: str = "auto",
                 eps: float = 1e-6):
        super().__init__()
        inner = expand * d_model
        if inner % n_heads:
            raise ValueError(f"expand * d_model ({inner}) must be divisible by n_heads "
                             f"({n_heads})")
        if short_conv < 1:
            raise ValueError(f"short_conv must be >= 1 for the Mamba-2 block, got {short_conv}")
        self.n_heads, self.head_dim, self.d_state = n_heads, inner // n_heads, d_state
        self.chunk_size, self.impl, self.eps = chunk_size, impl, eps
        self.in_proj = nn.Linear(d_model, 2 * inner + 2 * d_state + n_heads, bias=False)
        self.conv = ShortConv(inner + 2 * d_state, short_conv)
        dt, A = ssd_parameters(n_heads, seed=0, dtype=torch.float32)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))   # softplus^-1(dt)
        self.A_log = nn.Parameter(torch.log(-A))
        self.D = nn.Parameter(torch.ones(n_heads))
        self.norm_weight = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, d_model, bias=False)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        Bsz, T, _ = u.shape
        inner, N, H = self.n_heads * self.head_dim, self.d_state, self.n_heads
        z, xBC, dt = self.in_proj(u).split([inner, inner + 2 * N, H], dim=-1)
        x, B, C = F.silu(self.conv(xBC)).split([inner, N, N], dim=-1)
        dt = F.softplus(dt + self.dt_bias)
        y, _ = ssd(x.view(Bsz, T, H, self.head_dim), dt, -torch.exp(self.A_log),
                   B.view(Bsz, T, 1, N), C.view(Bsz, T, 1, N), D=self.D,
                   impl=self.impl, chunk_size=self.chunk_size)
        y = y.reshape(Bsz, T, inner).to(u.dtype) * F.silu(z)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm_weight
        return self.out_proj(y)

    def forward_stacked(self, params: dict[str, torch.Tensor], u: torch.Tensor) -> torch.Tensor:
        """N copies of this block (stacked `params`, u `[N, Bsz, T, d_model]`): N * H heads
        and N groups in one SSD call; equals each copy's `forward` on its own u."""
        M, Bsz, T, _ = u.shape
        inner, N, H, P = self.n_heads * self.head_dim, self.d_state, self.n_heads, self.head_dim
        z, xBC, dt = stacked_linear(u, params["in_proj.weight"]).split([inner, inner + 2 * N, H], -1)
        x, B, C = F.silu(stacked_causal_conv(xBC, params["conv.conv.weight"])).split([inner, N, N], -1)
        dt = F.softplus(dt + params["dt_bias"][:, None, None, :])               # [M, Bsz, T, H]
        heads = lambda t: t.permute(1, 2, 0, 3).reshape(Bsz, T, M * t.shape[-1])  # noqa: E731
        x = x.reshape(M, Bsz, T, H, P).permute(1, 2, 0, 3, 4).reshape(Bsz, T, M * H, P)
        # contiguous: mamba_ssm's kernels need unit strides (a stacked [M, 1] D is strided)
        y, _ = ssd(x, heads(dt).contiguous(), -torch.exp(params["A_log"]).reshape(M * H),
                   B.permute(1, 2, 0, 3).contiguous(), C.permute(1, 2, 0, 3).contiguous(),
                   D=params["D"].reshape(M * H).contiguous(), impl=self.impl,
                   chunk_size=self.chunk_size)
        y = y.reshape(Bsz, T, M, inner).permute(2, 0, 1, 3).to(u.dtype) * F.silu(z)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        y = y * params["norm_weight"][:, None, None, :]
        return stacked_linear(y, params["out_proj.weight"])
