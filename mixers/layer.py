"""A generic attention-style layer around any functional mixer op.

`[B, T, d_model]` -> q, k, v projections -> heads `[B, T, H, D]` -> optional short causal
convolution and q/k normalisation -> op -> merge heads -> output projection.

Stacked form: `forward_stacked(params, x)` runs N independent copies of a layer at once, with
the copies' parameters stacked on a leading dimension (`params[name]` is `[N, *shape]` for
each of the layer's parameter names) and x `[N, B, T, d_model]`. The N copies share the op,
whose batch rows are independent, so they go through one op call with N * B rows.

Under `torch.compile` a layer whose class sets `TRACEABLE_STACKED` compiles around its op:
the projections, convolution, norms and casts fuse. The op itself is traced too where the
layer is built with `traceable_op=True` (PyTorch forms: their elementwise work fuses with
the layer's); an op whose dispatcher picks a Triton kernel keeps that kernel out of the
trace itself (`mixers.dispatch.opaque`). Any other op (fla and mamba kernels that the
compiler cannot trace) runs through `opaque` as a whole, a graph break.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from mixers.dispatch import opaque
from mixers.short_conv import conv_split_norm

QK_NORMS = ("none", "l2", "scale")


class ShortConv(nn.Module):
    """Depthwise causal 1-D convolution over time (as in H3 / Based / fla layers)."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, C]
        x = F.pad(x.transpose(1, 2), (self.kernel_size - 1, 0))
        return self.conv(x).transpose(1, 2)


def stacked_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """N linear maps at once: x `[N, ..., in]`, weight `[N, out, in]`, bias `[N, out]`."""
    N, rows = x.shape[0], x[0].numel() // x.shape[-1]
    flat = x.reshape(N, rows, x.shape[-1])
    if bias is None:
        out = torch.bmm(flat, weight.transpose(1, 2))
    else:
        out = torch.baddbmm(bias.unsqueeze(1), flat, weight.transpose(1, 2))
    return out.view(*x.shape[:-1], weight.shape[1])


class MixerLayer(nn.Module):
    """Projections, head split and normalisation around `op(q, k, v) -> (o, state)`.

    qk_norm: "l2" divides q and k by their L2 norm per head (bounded higher-order products),
    "scale" multiplies q by key_dim**-0.5 (softmax attention's scaling), "none" leaves them.
    short_conv: kernel size of a depthwise causal convolution on q, k and v (0 disables it).
    output_norm: RMS-normalise each head's output (learned gain) before the output projection;
    unnormalised linear and higher-order attention outputs grow with the context (HLA2's sum
    has O(t^2) terms), and this keeps the residual stream at one scale.
    key_dim: per-head width of q and k (default: head_dim, the width of v and the output),
    e.g. a small feature dimension for Based's Taylor map.
    bias: biases on the q/k/v and output projections (Zoology's attention has them).
    dropout: passed to the op as `dropout_p` while training (softmax attention's dropout on
    the attention weights); 0 passes nothing, so any op works.
    traceable_op: torch.compile may trace the op (PyTorch code, or a dispatcher that keeps
    its own kernels out of the trace); False runs it through `opaque`.

    The q/k/v projection's output is laid out [q of every head, k of every head, v of every
    head]; `hla_bench.recall.stacked` relies on that layout and on the attribute names.
    """

    TRACEABLE_STACKED = True  # forward_stacked traces its op only when traceable_op

    def __init__(self, d_model: int, n_heads: int, op: Callable, *, qk_norm: str = "l2",
                 short_conv: int = 0, output_norm: bool = False, head_dim: int | None = None,
                 key_dim: int | None = None, bias: bool = False, dropout: float = 0.0,
                 traceable_op: bool = False):
        super().__init__()
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {qk_norm!r}")
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
            head_dim = d_model // n_heads
        key_dim = head_dim if key_dim is None else key_dim
        if not isinstance(key_dim, int) or isinstance(key_dim, bool) or key_dim < 1:
            raise ValueError(f"key_dim must be a positive int, got {key_dim!r}")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must lie in [0, 1), got {dropout!r}")
        self.n_heads, self.head_dim, self.key_dim, self.qk_norm = n_heads, head_dim, key_dim, qk_norm
        self.dropout = float(dropout)
        self.split = (n_heads * key_dim, n_heads * key_dim, n_heads * head_dim)
        self.qkv = nn.Linear(d_model, sum(self.split), bias=bias)
        self.conv = ShortConv(sum(self.split), short_conv) if short_conv else None
        self.out_norm = nn.RMSNorm(head_dim) if output_norm else None
        self.out = nn.Linear(n_heads * head_dim, d_model, bias=bias)
        self.op, self.traceable_op = op, bool(traceable_op)

    def op_kwargs(self) -> dict:
        """Keyword arguments of the op call (dropout while training only)."""
        return {"dropout_p": self.dropout} if self.dropout and self.training else {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(x)
        if self.conv is not None:
            qkv = self.conv(qkv)
        q, k, v = qkv.split(self.split, dim=-1)
        q, k = (t.reshape(B, T, self.n_heads, self.key_dim) for t in (q, k))
        v = v.reshape(B, T, self.n_heads, self.head_dim)
        if self.qk_norm == "l2":  # CUDA autocast runs the norm in fp32: back to v's dtype
            q, k = F.normalize(q, dim=-1).to(v.dtype), F.normalize(k, dim=-1).to(v.dtype)
        elif self.qk_norm == "scale":
            q = q * self.key_dim ** -0.5
        o, _ = self.op(q, k, v, **self.op_kwargs())
        if self.out_norm is not None:
            o = self.out_norm(o)
        return self.out(o.reshape(B, T, -1))

    def forward_stacked(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """N copies of this layer (stacked `params`, x `[N, B, T, d_model]`) through one op
        call over N * B rows; equals running each copy's `forward` on its own x."""
        N, B, T, _ = x.shape
        qkv = stacked_linear(x, params["qkv.weight"], params.get("qkv.bias"))
        # convolution, split and q/k norm in one op; its Triton path stays opt-in (impl=)
        # until it replays inside a captured CUDA graph, as the stacked steps are run
        q, k, v = conv_split_norm(qkv, params.get("conv.conv.weight"), self.split,
                                  self.n_heads, self.key_dim, self.head_dim, self.qk_norm,
                                  impl="torch")
        if self.traceable_op:
            o, _ = self.op(q, k, v, **self.op_kwargs())
        else:
            o, _ = opaque(self.op, q, k, v, **self.op_kwargs())
        o = o.reshape(N, B * T, self.n_heads, self.head_dim)
        if self.out_norm is not None:
            o = F.rms_norm(o, (self.head_dim,), eps=self.out_norm.eps)
            o = o * params["out_norm.weight"].to(o.dtype)[:, None, None, :]
        out = stacked_linear(o.reshape(N, B * T, -1), params["out.weight"], params.get("out.bias"))
        return out.view(N, B, T, -1)
