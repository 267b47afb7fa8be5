"""Stacked LayerNorm and RMSNorm: N models' norms over `[N, M, d]` activations at once, each
model with its own weight (and bias) `[N, d]`, optionally fused with the residual add.

    s = x (+ residual)
    LayerNorm: y[n] = (s[n] - mean) / sqrt(var + eps) * weight[n] + bias[n]   (F.layer_norm:
               biased variance, eps inside the square root)
    RMSNorm:   y[n] = s[n] / sqrt(mean(s^2) + eps) * weight[n]                (F.rms_norm)

per row of d entries. Statistics run in float32 (float64 for float64 inputs) whatever x's
dtype; y comes out in `out_dtype` (x's dtype by default), rounded once as it is stored.

Triton (CUDA): the forward reads each row once (x and the residual), writes y (and, with a
residual, s, which the backward reads in place of x) and keeps each row's mean and
1/sqrt(var + eps). The backward gives
ds (the gradient of s: of x and of the residual alike, plus the gradient arriving at s
itself) and the per-model weight and bias gradients in one kernel: a program covers a block
of rows of one model, sums dy * xhat (and dy) over its rows in registers and writes the sums
to a `[N, row blocks, d]` buffer, which one `sum` reduces: no atomics, so the result is the
same on every run. The PyTorch path (the CPU and float64) computes the same with
F.layer_norm / F.rms_norm and autograd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from hla_bench.recall.kernels.common import (FLOATS, accumulator, check_device, check_tensor,
                                             jit, rounded, tl, triton, use_triton)

KINDS = ("layer", "rms")
MAX_D = 8192  # the widest row the kernels hold in registers (BLOCK_D = next power of two)
TILE_ENTRIES = 4096  # entries of one tile of rows (rows x BLOCK_D) a program handles at once
BACKWARD_PROGRAMS = 1024  # the backward grows its row blocks while it keeps this many programs


@dataclass(frozen=True)
class NormPlan:
    """BLOCK_D (d rounded up to a power of two), rows per tile, tiles per backward program
    (its row block: tile x tiles rows) and warps per program."""

    block_d: int
    tile: int
    tiles: int
    warps: int


def plan_norm(N: int, M: int, d: int) -> NormPlan:
    """Tiles of about TILE_ENTRIES entries; backward row blocks of up to 16 tiles, doubled
    while at least BACKWARD_PROGRAMS programs remain (a longer block means a smaller
    partials buffer, fewer programs less parallelism)."""
    block_d = 1 << max(0, d - 1).bit_length()
    tile = max(1, min(64, TILE_ENTRIES // block_d))
    tiles = 1
    while tiles < 16 and N * math.ceil(M / (2 * tiles * tile)) >= BACKWARD_PROGRAMS:
        tiles *= 2
    return NormPlan(block_d, tile, tiles, 4 if tile * block_d <= TILE_ENTRIES else 8)


@jit
def _inverse_sqrt(x):
    """1 / sqrt(x), correctly rounded steps (no approximate square root or division)."""
    if x.dtype == tl.float64:
        return 1.0 / tl.sqrt(x)
    else:
        return tl.div_rn(tl.full(x.shape, 1.0, tl.float32), tl.sqrt_rn(x))


@jit
def stacked_norm_forward_kernel(X, RES, W, B, Y, XSUM, MEAN, RSTD, M, D, stride_wn, stride_bn,
                                eps_hi, eps_lo, TILE: tl.constexpr, BLOCK_D: tl.constexpr,
                                LAYER: tl.constexpr, HAS_RES: tl.constexpr,
                                HAS_BIAS: tl.constexpr):
    """One tile of TILE rows of model n (grid: row tiles x N). X, RES, Y, XSUM `[N, M, D]`
    contiguous; W, B `[N, D]` rows at stride_wn, stride_bn; MEAN, RSTD `[N, M]` in the
    accumulator dtype, which the statistics run in. eps = eps_hi + eps_lo (a float argument
    is float32; eps_lo carries the rest of a float64 eps, 0 for float32)."""
    acc: tl.constexpr = RSTD.dtype.element_ty
    block = tl.program_id(0)
    n = tl.program_id(1)
    rows = block * TILE + tl.arange(0, TILE)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < M
    col_ok = cols < D
    mask = row_ok[:, None] & col_ok[None, :]
    at = (n * M + rows).to(tl.int64)[:, None] * D + cols[None, :]
    s = tl.load(X + at, mask=mask, other=0.0).to(acc)
    if HAS_RES:
        # the sum in the accumulator dtype, rounded to the inputs' dtype (as PyTorch adds
        # 16-bit tensors), and normalized as rounded
        s = rounded(s + tl.load(RES + at, mask=mask, other=0.0).to(acc), X.dtype.element_ty)
        tl.store(XSUM + at, s, mask=mask)
        s = s.to(acc)
    if LAYER:
        mean = tl.sum(s, axis=1) / D
        s = tl.where(mask, s - mean[:, None], 0.0)
        tl.store(MEAN + n * M + rows, mean, mask=row_ok)
    var = tl.sum(s * s, axis=1) / D
    rstd = _inverse_sqrt(var + eps_hi + eps_lo)
    tl.store(RSTD + n * M + rows, rstd, mask=row_ok)
    w = tl.load(W + n * stride_wn + cols, mask=col_ok, other=0.0).to(acc)
    y = s * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + n * stride_bn + cols, mask=col_ok, other=0.0).to(acc)[None, :]
    tl.store(Y + at, rounded(y, Y.dtype.element_ty), mask=mask)


@jit
def stacked_norm_backward_kernel(XS, W, DY, DSUM, MEAN, RSTD, DS, DW, DB, M, D, NB, stride_wn,
                                 TILE: tl.constexpr, TILES: tl.constexpr,
                                 BLOCK_D: tl.constexpr, LAYER: tl.constexpr,
                                 HAS_DY: tl.constexpr, HAS_DSUM: tl.constexpr,
                                 HAS_BIAS: tl.constexpr):
    """One block of TILES x TILE rows of model n (grid: NB row blocks x N): ds `[N, M, D]`
    (in DS's dtype) and this block's sums of dy * xhat and dy over its rows, written to row
    (n, block) of DW and DB `[N, NB, D]` (accumulator dtype). XS: the normalized input s;
    DY: the gradient of y (bf16 or wider; not read without HAS_DY: zero); DSUM: the
    gradient arriving at s itself (the fused add's output), added to ds."""
    acc: tl.constexpr = RSTD.dtype.element_ty
    block = tl.program_id(0)
    n = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = tl.load(W + n * stride_wn + cols, mask=col_ok, other=0.0).to(acc)
    dw = tl.zeros([BLOCK_D], dtype=acc)
    db = tl.zeros([BLOCK_D], dtype=acc)
    for i in range(TILES):
        rows = (block * TILES + i) * TILE + tl.arange(0, TILE)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        at = (n * M + rows).to(tl.int64)[:, None] * D + cols[None, :]
        rstd = tl.load(RSTD + n * M + rows, mask=row_ok, other=0.0)
        s = tl.load(XS + at, mask=mask, other=0.0).to(acc)
        if LAYER:
            mean = tl.load(MEAN + n * M + rows, mask=row_ok, other=0.0)
            s = tl.where(mask, s - mean[:, None], 0.0)
        xhat = s * rstd[:, None]  # 0 on rows past M (rstd 0) and columns past D
        ds = tl.zeros([TILE, BLOCK_D], dtype=acc)
        if HAS_DY:
            dy = tl.load(DY + at, mask=mask, other=0.0).to(acc)
            g = dy * w[None, :]
            c1 = tl.sum(xhat * g, axis=1) / D
            if LAYER:
                c2 = tl.sum(g, axis=1) / D
                ds = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
            else:
                ds = (g - xhat * c1[:, None]) * rstd[:, None]
            dw += tl.sum(dy * xhat, axis=0)
            if HAS_BIAS:
                db += tl.sum(dy, axis=0)
        if HAS_DSUM:
            ds += tl.load(DSUM + at, mask=mask, other=0.0).to(acc)
        tl.store(DS + at, rounded(ds, DS.dtype.element_ty), mask=mask)
    part = (n * NB + block).to(tl.int64) * D + cols
    tl.store(DW + part, dw, mask=col_ok)
    if HAS_BIAS:
        tl.store(DB + part, db, mask=col_ok)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _eps_parts(eps: float, acc: torch.dtype) -> tuple[float, float]:
    """eps as float32 + float32 rest (float64 statistics), or eps alone (float32 ones, which
    round it to float32 as PyTorch's norms do)."""
    if acc != torch.float64:
        return eps, 0.0
    hi = float(np.float32(eps))
    return hi, float(np.float32(eps - hi))


class _StackedNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, layer, out_dtype):
        N, M, D = x.shape
        acc = accumulator(x.dtype)
        plan = plan_norm(N, M, D)
        weight = _last_dim_contiguous(weight)
        bias = _last_dim_contiguous(bias) if bias is not None else None
        y = torch.empty((N, M, D), dtype=out_dtype, device=x.device)
        x_sum = torch.empty_like(x) if residual is not None else None
        rstd = torch.empty((N, M), dtype=acc, device=x.device)
        mean = torch.empty((N, M), dtype=acc, device=x.device) if layer else None
        if M > 0:
            stacked_norm_forward_kernel[(triton.cdiv(M, plan.tile), N)](
                x, residual if residual is not None else x, weight,
                bias if bias is not None else weight, y, x_sum if x_sum is not None else y,
                mean if layer else rstd, rstd, M, D, weight.stride(0),
                bias.stride(0) if bias is not None else 0, *_eps_parts(eps, acc),
                TILE=plan.tile, BLOCK_D=plan.block_d, LAYER=layer,
                HAS_RES=residual is not None, HAS_BIAS=bias is not None, num_warps=plan.warps)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x_sum if x_sum is not None else x, weight, mean, rstd)
        ctx.plan, ctx.layer, ctx.has_bias = plan, layer, bias is not None
        ctx.has_residual, ctx.weight_dtype = residual is not None, weight.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return (y, x_sum) if residual is not None else y

    @staticmethod
    def backward(ctx, grad_y, grad_sum=None):
        xs, weight, mean, rstd = ctx.saved_tensors
        plan = ctx.plan
        N, M, D = xs.shape
        NB = triton.cdiv(M, plan.tile * plan.tiles)
        ds = torch.empty_like(xs)
        dw = torch.empty((N, NB, D), dtype=rstd.dtype, device=xs.device)
        db = torch.empty_like(dw) if ctx.has_bias else None
        if M > 0:
            grad_y = grad_y.contiguous() if grad_y is not None else None
            grad_sum = grad_sum.contiguous() if grad_sum is not None else None
            stacked_norm_backward_kernel[(NB, N)](
                xs, weight, grad_y if grad_y is not None else xs,
                grad_sum if grad_sum is not None else xs, mean if ctx.layer else rstd, rstd,
                ds, dw, db if db is not None else dw, M, D, NB, weight.stride(0),
                TILE=plan.tile, TILES=plan.tiles, BLOCK_D=plan.block_d, LAYER=ctx.layer,
                HAS_DY=grad_y is not None, HAS_DSUM=grad_sum is not None,
                HAS_BIAS=db is not None, num_warps=plan.warps)
        dweight = dw.sum(1).to(ctx.weight_dtype)
        dbias = db.sum(1).to(ctx.bias_dtype) if db is not None else None
        # x and the residual enter only through s = x + residual: both get ds (as the
        # addition's own backward hands its one gradient to both inputs)
        return ds, ds if ctx.has_residual else None, dweight, dbias, None, None, None


def _norm_torch(x, residual, weight, bias, eps: float, layer: bool, out_dtype: torch.dtype):
    """The PyTorch path: the same computation with F.layer_norm / F.rms_norm (statistics and
    the affine map in the accumulator dtype), differentiated by autograd."""
    s = x + residual if residual is not None else x
    acc = accumulator(s.dtype)
    with torch.autocast(s.device.type, enabled=False):
        h = s.to(acc)
        shape = (s.shape[-1],)
        normed = (F.layer_norm(h, shape, eps=eps) if layer else F.rms_norm(h, shape, eps=eps))
        w = weight.to(acc)[:, None, :]
        y = (torch.addcmul(bias.to(acc)[:, None, :], normed, w) if bias is not None
             else normed * w)
    return y.to(out_dtype), s


def stacked_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 eps: float, kind: str = "layer", residual: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, impl: str = "auto"):
    """N models' LayerNorm (`kind="layer"`) or RMSNorm (`kind="rms"`) at once.

    x: `[N, M, d]` or `[N, B, T, d]` (any float dtype); weight `[N, d]`; bias `[N, d]` or
    None (LayerNorm without bias; RMSNorm takes none). Model n's rows are normalized as
    F.layer_norm / F.rms_norm with `eps` and scaled by weight[n] (+ bias[n]). Statistics in
    float32 (float64 for float64 x); y in `out_dtype` (default x's dtype), shaped as x.
    With `residual` (x's shape and dtype) the sum s = x + residual (in x's dtype) is
    normalized instead and `(y, s)` is returned; the gradient of s reaches x and residual.
    `impl`: "auto" (Triton kernels on CUDA for 16-bit and float32 x, else PyTorch),
    "triton" (the kernels; on the CPU under TRITON_INTERPRET=1) or "torch". Autocast does
    not change the computation (it runs with autocast off; the statistics are float32
    anyway). No host syncs and static shapes only: CUDA-graph capturable."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (3, 4):
        raise ValueError(f"x must have shape [N, M, d] or [N, B, T, d], got {list(x.shape)}")
    check_tensor("x", x, tuple(x.shape))
    N, d = x.shape[0], x.shape[-1]
    if N < 1 or d < 1:
        raise ValueError(f"x needs at least one model and one feature, got {list(x.shape)}")
    check_tensor("weight", weight, (N, d))
    if bias is not None:
        if kind == "rms":
            raise ValueError("bias must be None for kind='rms' (RMSNorm has no bias)")
        check_tensor("bias", bias, (N, d))
    if residual is not None:
        check_tensor("residual", residual, tuple(x.shape))
        if residual.dtype != x.dtype:
            raise ValueError(f"residual must have x's dtype {x.dtype}, got {residual.dtype}")
    check_device(x, weight=weight, bias=bias, residual=residual)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")
    if out_dtype is None:
        out_dtype = x.dtype
    elif out_dtype not in FLOATS:
        raise ValueError(f"out_dtype must be one of {FLOATS} or None, got {out_dtype!r}")
    triton_path = use_triton(impl, x.device, x.dtype,
                             f"d = {d} is above {MAX_D}" if d > MAX_D else None)
    shape = x.shape
    x3 = x.reshape(N, -1, d)
    res3 = residual.reshape(N, -1, d) if residual is not None else None
    if triton_path:
        with torch.autocast(x.device.type, enabled=False):
            out = _StackedNorm.apply(x3.contiguous(), res3.contiguous() if res3 is not None
                                     else None, weight, bias, float(eps), kind == "layer",
                                     out_dtype)
        y, s = out if residual is not None else (out, None)
    else:
        y, s = _norm_torch(x3, res3, weight, bias, float(eps), kind == "layer", out_dtype)
    if residual is None:
        return y.view(shape)
    return y.view(shape), s.view(shape)
