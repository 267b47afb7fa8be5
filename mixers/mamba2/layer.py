"""A compact Mamba-2 block on the functional SSD (runs on CPU through the chunk form).

in_proj -> (z, x, B, C, dt); short causal conv + SiLU on (x, B, C); dt = softplus(dt + bias);
SSD with A = -exp(A_log) and a D skip; gated RMSNorm of y * SiLU(z); out_proj.
B and C are shared by all heads (one group), as in Mamba-2.

`forward_stacked` runs N copies with stacked parameters (see `mixers.layer`): their heads
go side by side into one SSD call, with one B/C group per copy.

The registry entry of the "ssm" family, `mamba2-ssd`, is declared here beside the block: its
op binds seeded per-head dt and A to the functional SSD, its layer is this block.
"""

from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F

from mixers.entry import Mixer
from mixers.layer import ShortConv, stacked_linear
from mixers.short_conv import stacked_causal_conv
from mixers.mamba2 import SSDDecoder, mamba2_ssd, ssd, ssd_flops, ssd_parameters


def block_heads(d_model: int, n_heads: int, expand: int, head_dim: int | None) -> int:
    """The SSD heads of a block: n_heads, or expand * d_model / head_dim when head_dim is
    given; ValueError unless they divide expand * d_model."""
    inner = expand * d_model
    if head_dim is not None:
        if head_dim < 1 or inner % head_dim:
            raise ValueError(f"head_dim ({head_dim}) must be a positive divisor of "
                             f"expand * d_model ({inner})")
        return inner // head_dim
    if inner % n_heads:
        raise ValueError(f"expand * d_model ({inner}) must be divisible by n_heads "
                         f"({n_heads})")
    return n_heads


def _block_state_dims(d_model, n_heads, expand, d_state, layer_head_dim, **_):
    """The SSD state of one block: [heads, d_state, expand * d_model / heads]."""
    heads = block_heads(d_model, n_heads, expand, layer_head_dim)
    return heads, d_state, expand * d_model // heads


def _block_state_size(d_model, n_heads, seq_len, expand, d_state, layer_head_dim, **_):
    """The block's SSD state per layer: d_state x d_inner (d_inner = expand x d_model, its
    heads side by side), whatever the head split."""
    heads, state, head_dim = _block_state_dims(d_model, n_heads, expand, d_state,
                                               layer_head_dim)
    return heads * state * head_dim


class Mamba2Block(nn.Module):
    """`[B, T, d_model]` -> `[B, T, d_model]`; head dim = expand * d_model / n_heads, or
    `head_dim` when given (then n_heads = expand * d_model / head_dim, as mamba_ssm's
    Mamba2, whose default head dim is 64)."""

    # `ssd` keeps mamba_ssm's kernel out of a torch.compile trace; its PyTorch forms trace
    TRACEABLE_STACKED = True

    def __init__(self, d_model: int, n_heads: int, *, d_state: int = 64, expand: int = 2,
                 short_conv: int = 4, chunk_size: int = 64, impl: str = "auto",
                 head_dim: int | None = None, eps: float = 1e-6):
        super().__init__()
        inner = expand * d_model
        n_heads = block_heads(d_model, n_heads, expand, head_dim)
        if short_conv < 1:
            raise ValueError(f"short_conv must be >= 1 for the Mamba-2 block, got {short_conv}")
        self.n_heads, self.head_dim, self.d_state = n_heads, inner // n_heads, d_state
        self.chunk_size, self.impl, self.eps = chunk_size, impl, eps
        self.in_proj = nn.Linear(d_model, 2 * inner + 2 * d_state + n_heads, bias=False)
        self.conv = ShortConv(inner + 2 * d_state, short_conv)
        # on the default device, as every other parameter (a torch.device context's)
        dt, A = ssd_parameters(n_heads, seed=0, device=torch.empty(0).device,
                               dtype=torch.float32)
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


def _ssd_op(impl, chunk_size, d_skip, seed, **_):
    def op(q, k, v, initial_state=None, output_final_state=False):
        dt, A = ssd_parameters(v.shape[2], seed, v.device)
        D = dt.new_ones(dt.shape) if d_skip else None
        return mamba2_ssd(q, k, v, dt=dt, A=A, D=D, impl=impl, chunk_size=chunk_size,
                          initial_state=initial_state, output_final_state=output_final_state)

    return op


def _ssd_requires(impl="auto", **_):
    return ("mamba_ssm", "cuda") if impl == "triton" else ()


def _ssd_reference(chunk_size, d_skip, seed, **_):
    """The token-by-token recurrence (mixers/mamba2/naive.py) on float64 inputs, with the
    op's dt and A."""
    op = _ssd_op("naive", chunk_size, d_skip, seed)
    return lambda q, k, v: op(q.double(), k.double(), v.double())[0]


MAMBA2_SSD = Mixer(
    name="mamba2-ssd", family="ssm",
    description="Mamba-2 SSD scan (C=q, B=k, x=v, seeded per-head dt and A); mamba_ssm's "
                "Triton kernel on CUDA when installed, else chunked PyTorch. Layer: a compact "
                "Mamba-2 block.",
    build_op=_ssd_op,
    build_layer=lambda d_model, n_heads, impl, chunk_size, d_state, expand, short_conv,
                       layer_head_dim, **_:
        Mamba2Block(d_model, n_heads, d_state=d_state, expand=expand, short_conv=short_conv,
                    chunk_size=chunk_size, impl=impl, head_dim=layer_head_dim),
    build_decoder=lambda seed, d_skip, **_: SSDDecoder(seed, d_skip),
    options={"impl": "auto", "chunk_size": 64, "d_skip": False, "seed": 0,
             "d_state": 64, "expand": 2, "short_conv": 4, "layer_head_dim": None},
    forms=("naive", "chunk", "triton"), flops=ssd_flops, option_requires=_ssd_requires,
    build_reference=_ssd_reference, layer_state_dims=_block_state_dims,
    state_size=_block_state_size)


def mamba2_mixers() -> list[Mixer]:
    return [MAMBA2_SSD]
