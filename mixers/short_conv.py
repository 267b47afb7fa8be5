"""A stacked layer's short causal convolution, q/k/v split and q/k normalisation in one op.

`conv_split_norm` takes the q/k/v projection output of N stacked layers, qkv `[N, B, T, C]`
with C = 2 H Dk + H Dv laid out [q of every head, k of every head, v of every head]
(`mixers.layer.MixerLayer`), and returns what `MixerLayer.forward_stacked` hands its op:

    y_t = sum_j w_j x_{t-K+1+j}          (x_s = 0 for s < 0; conv_weight `[N, C, 1, K]`, or
                                          None: y = x)
    q, k `[N * B, T, H, Dk]`, v `[N * B, T, H, Dv]`: y split and reshaped per head, then
    "l2":    q, k <- q / max(||q||_2, eps), k / max(||k||_2, eps) per head (F.normalize)
    "scale": q <- q * Dk**-0.5
    "none":  as convolved

Rounding, the same as `stacked_causal_conv` followed by today's split and
normalisation (under CUDA autocast, qkv in bfloat16 and fp32 master weights):
  - the weight is rounded to qkv's dtype; every product w_j x and every partial sum, taken in
    tap order j = 0, 1, ..., K-1, is rounded to qkv's dtype (PyTorch's elementwise kernels
    compute a 16-bit product or sum in float32 and round it once);
  - "l2" takes the norm, the eps clamp and the quotient in float32 (float64 for float64
    inputs; autocast runs the norm in float32 and the division promotes) and rounds the
    quotient once to qkv's dtype; "scale" multiplies by Dk**-0.5 rounded to float32
    (float64) and rounds once.
So the two paths' outputs are equal bit for bit, but for the "l2" outputs, which may differ
by an ulp where the norm's sum of squares, taken in another order, rounds otherwise.

Two paths, the same function:
  "torch"   those PyTorch ops, differentiated by autograd: the reference, CPU, float64;
  "triton"  (CUDA; the CPU under TRITON_INTERPRET=1) one launch per output forward and one
            per output backward. The backward saves nothing but qkv and the weight: for
            "l2" it recomputes the convolution and the norms at the K shifted rows that
            each row of d qkv reads; it takes every gradient in float32 (float64) from the
            rounded forward values and rounds d qkv once; the weight's gradient is written
            per block of rows into a `[N, B * blocks, C, K]` buffer in float32 (float64)
            and reduced by one sum (deterministic, no atomics), then cast to the weight's
            dtype. No host syncs, and buffers sized by the shapes alone: a CUDA graph can
            capture both directions.
The paths' gradients differ by rounding only: autograd rounds each op's gradient to qkv's
dtype, the kernels round d qkv once (and keep the weight's gradient in float32).
`impl="auto"` takes "triton" for CUDA tensors in bfloat16, float16 or float32 (head dims up
to MAX_HEAD_DIM) and "torch" otherwise; "triton" forces the kernels (float64 too: there
every operation is float64, which the tests use to check the kernels' gradients exactly).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the PyTorch path needs no Triton (pyproject installs it on Linux only)
    triton = None

QK_NORMS = ("none", "l2", "scale")
IMPLS = ("auto", "triton", "torch")
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what "auto" sends to Triton
MAX_KERNEL_SIZE = 8
MAX_HEAD_DIM = 512  # a program holds a whole head (the norm's row) of rows of its block
FORWARD_TILE = 4096  # rows x head block a forward program holds (sets the default rows)
BACKWARD_TILE = 2048  # the same for a backward program, which holds more tiles at once
_MODES = {"none": 0, "l2": 1, "scale": 2}  # the kernels' MODE per output


def interpreted() -> bool:
    """Whether Triton kernels run under its interpreter (TRITON_INTERPRET=1: on the CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def conv_split_norm(qkv: torch.Tensor, conv_weight: torch.Tensor | None,
                    split: tuple[int, int, int], heads: int, key_dim: int, value_dim: int,
                    qk_norm: str = "l2", eps: float = 1e-12, *, impl: str = "auto",
                    block_t: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k `[N * B, T, heads, key_dim]` and v `[N * B, T, heads, value_dim]` (contiguous,
    in qkv's dtype) from qkv `[N, B, T, C]` (bfloat16, float16, float32 or float64) through
    the causal convolution with conv_weight `[N, C, 1, K]` (K from 1 to 8; None: no
    convolution), the split `split` = (heads * key_dim, heads * key_dim, heads * value_dim)
    and `qk_norm` ("l2", "scale" or "none"; module docstring). Differentiable in qkv and
    conv_weight. Autocast changes nothing here: the arithmetic is in the dtypes the module
    docstring states whether or not it is on. block_t: rows of T per Triton program (a
    power of two from 2 to 256; default from the head dims)."""
    _check(qkv, conv_weight, split, heads, key_dim, value_dim, qk_norm, eps, impl, block_t)
    if _resolve(impl, qkv, key_dim, value_dim) == "torch":
        return _torch_path(qkv, conv_weight, split, heads, key_dim, value_dim, qk_norm, eps)
    return _ConvSplitNorm.apply(qkv, conv_weight, heads, key_dim, value_dim, qk_norm,
                                float(eps), block_t)


def _check(qkv, weight, split, heads, key_dim, value_dim, qk_norm, eps, impl, block_t):
    if not isinstance(qkv, torch.Tensor) or qkv.dim() != 4:
        raise ValueError(f"qkv must be a [N, B, T, C] tensor, got "
                         f"{tuple(qkv.shape) if isinstance(qkv, torch.Tensor) else type(qkv)}")
    if qkv.dtype not in DTYPES:
        raise ValueError(f"qkv must be bfloat16, float16, float32 or float64, got {qkv.dtype}")
    for name, value in (("heads", heads), ("key_dim", key_dim), ("value_dim", value_dim)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    want = (heads * key_dim, heads * key_dim, heads * value_dim)
    if tuple(split) != want:
        raise ValueError(f"split must be (heads * key_dim, heads * key_dim, heads * "
                         f"value_dim) = {want}, got {tuple(split)}")
    if qkv.shape[-1] != sum(want):
        raise ValueError(f"qkv's last dim must be sum(split) = {sum(want)}, got "
                         f"{qkv.shape[-1]}")
    if qk_norm not in QK_NORMS:
        raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {qk_norm!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if block_t is not None and (not isinstance(block_t, int) or isinstance(block_t, bool)
                                or block_t not in (2, 4, 8, 16, 32, 64, 128, 256)):
        raise ValueError(f"block_t must be a power of two from 2 to 256, got {block_t!r}")
    if weight is None:
        return
    N, C = qkv.shape[0], qkv.shape[-1]
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"conv_weight must be a tensor or None, got {type(weight)}")
    if weight.dim() != 4 or tuple(weight.shape[:3]) != (N, C, 1):
        raise ValueError(f"conv_weight must be [N, C, 1, K] = [{N}, {C}, 1, K] (a stacked "
                         f"ShortConv.conv.weight) or None, got {tuple(weight.shape)}")
    if not 1 <= weight.shape[-1] <= MAX_KERNEL_SIZE:
        raise ValueError(f"conv_weight's kernel size K must lie in [1, {MAX_KERNEL_SIZE}], "
                         f"got {weight.shape[-1]}")
    if weight.dtype not in DTYPES:
        raise ValueError(f"conv_weight must be a floating tensor, got {weight.dtype}")
    if weight.device != qkv.device:
        raise ValueError(f"conv_weight is on {weight.device}, qkv on {qkv.device}")


def _resolve(impl: str, qkv: torch.Tensor, key_dim: int, value_dim: int) -> str:
    """The path that runs: "torch" or "triton"."""
    if impl == "torch" or (impl == "auto" and torch.compiler.is_compiling()):
        return "torch"  # under torch.compile: ops inductor traces and fuses
    fits = max(key_dim, value_dim) <= MAX_HEAD_DIM
    if impl == "auto":
        runs = (triton is not None and qkv.is_cuda and qkv.dtype in TRITON_DTYPES and fits
                and qkv.numel() > 0)
        return "triton" if runs else "torch"
    if triton is None:
        raise ValueError("impl='triton' needs Triton, which is not installed")
    if not (qkv.is_cuda or interpreted()):
        raise ValueError(f"impl='triton' needs CUDA tensors (got {qkv.device}) or "
                         "TRITON_INTERPRET=1")
    if not fits:
        raise ValueError(f"impl='triton' takes head dims up to {MAX_HEAD_DIM}, got "
                         f"key_dim={key_dim}, value_dim={value_dim}")
    if qkv.numel() == 0:
        raise ValueError(f"impl='triton' needs a non-empty qkv, got {tuple(qkv.shape)}")
    return "triton"


def stacked_causal_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """N depthwise causal convolutions: x `[N, B, T, C]`, weight `[N, C, 1, k]` (a stacked
    `ShortConv.conv.weight`); y_t = sum_j w_j x_{t-k+1+j}, zero before the start."""
    k, T = weight.shape[-1], x.shape[2]
    padded = F.pad(x, (0, 0, k - 1, 0))
    taps = weight.to(x.dtype).squeeze(2).unsqueeze(1).unsqueeze(1)      # [N, 1, 1, C, k]
    out = padded[:, :, 0:T] * taps[..., 0]
    for j in range(1, k):
        out = out + padded[:, :, j:j + T] * taps[..., j]
    return out


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the norms and of the kernels' arithmetic: float64 for float64, else
    float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _torch_path(qkv, weight, split, heads, key_dim, value_dim, qk_norm, eps):
    """The PyTorch ops of `MixerLayer.forward_stacked` (with `stacked_causal_conv`'s
    convolution), outputs made contiguous."""
    N, B, T, _ = qkv.shape
    y = qkv if weight is None else stacked_causal_conv(qkv, weight)
    q, k, v = y.split(tuple(split), dim=-1)
    q, k = (t.reshape(N * B, T, heads, key_dim) for t in (q, k))
    v = v.reshape(N * B, T, heads, value_dim)
    if qk_norm == "l2":
        compute = _compute_dtype(qkv.dtype)
        q, k = (F.normalize(t.to(compute), dim=-1, eps=eps).to(qkv.dtype) for t in (q, k))
    elif qk_norm == "scale":
        q = q * key_dim ** -0.5
    return q.contiguous(), k.contiguous(), v.contiguous()


def _block_rows(block_d: int, tile: int) -> int:
    """Rows of T per program: `tile` entries of head blocks of `block_d`, 16 to 128 rows."""
    return max(16, min(128, tile // block_d))


def _outputs(heads: int, key_dim: int, value_dim: int, qk_norm: str):
    """Per output (q, k, v): its first channel of qkv, its head dim and the kernels' MODE."""
    return ((0, key_dim, _MODES[qk_norm]),
            (heads * key_dim, key_dim, _MODES["l2"] if qk_norm == "l2" else 0),
            (2 * heads * key_dim, value_dim, 0))


class _ConvSplitNorm(torch.autograd.Function):
    """The Triton path: forward and backward launches."""

    @staticmethod
    def forward(ctx, qkv, weight, heads, key_dim, value_dim, qk_norm, eps, block_t):
        x = qkv.contiguous()
        N, B, T, C = x.shape
        outs = tuple(x.new_empty(N * B, T, heads, d) for d in (key_dim, key_dim, value_dim))
        for out, (col0, D, mode) in zip(outs, _outputs(heads, key_dim, value_dim, qk_norm)):
            block_d = triton.next_power_of_2(D)
            rows = block_t or _block_rows(block_d, FORWARD_TILE)
            _forward_kernel[(triton.cdiv(T, rows), N * B, heads)](
                x, weight if weight is not None else x, out, T, C, heads, B, col0, D,
                *_weight_strides(weight), **_options(x, weight, mode, key_dim, eps),
                BLOCK_T=rows, BLOCK_D=block_d, num_warps=4, enable_fp_fusion=False)
        ctx.save_for_backward(x, weight)
        ctx.args = (heads, key_dim, value_dim, qk_norm, eps, block_t)
        return outs

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x, weight = ctx.saved_tensors
        heads, key_dim, value_dim, qk_norm, eps, block_t = ctx.args
        N, B, T, C = x.shape
        want_dw = weight is not None and ctx.needs_input_grad[1]
        # one row block for all three launches: they write disjoint channels of one buffer
        block_d = triton.next_power_of_2(max(key_dim, value_dim))
        rows = block_t or _block_rows(block_d, BACKWARD_TILE)
        blocks = triton.cdiv(T, rows)
        dx = torch.empty_like(x)
        compute = _compute_dtype(x.dtype)
        partial = (torch.empty(N, B * blocks, C, weight.shape[-1], dtype=compute,
                               device=x.device) if want_dw else dx)
        for grad, (col0, D, mode) in zip((dq, dk, dv),
                                         _outputs(heads, key_dim, value_dim, qk_norm)):
            _backward_kernel[(blocks, N * B, heads)](
                x, weight if weight is not None else x, grad.to(x.dtype).contiguous(), dx,
                partial, T, C, heads, B, col0, D, blocks, *_weight_strides(weight),
                **_options(x, weight, mode, key_dim, eps), WANT_DW=want_dw, BLOCK_T=rows,
                BLOCK_D=triton.next_power_of_2(D), num_warps=4, enable_fp_fusion=False)
        dw = partial.sum(1).to(weight.dtype).view(weight.shape) if want_dw else None
        return dx, dw, None, None, None, None, None, None


def _weight_strides(weight) -> tuple[int, int, int]:
    """conv_weight's strides over N, C and the taps (stacked parameters are strided views)."""
    return (weight.stride(0), weight.stride(1), weight.stride(3)) if weight is not None \
        else (0, 0, 0)


def _options(x, weight, mode: int, key_dim: int, eps: float) -> dict:
    """The compile-time arguments both kernels take."""
    return dict(K=weight.shape[-1] if weight is not None else 1, HAS_CONV=weight is not None,
                MODE=mode, SCALE=key_dim ** -0.5, EPS=eps,
                CT=tl.float64 if x.dtype == torch.float64 else tl.float32)


if triton is not None:
    INTERPRETED: tl.constexpr = tl.constexpr(interpreted())

    @triton.jit
    def _rounded(x, DT: tl.constexpr):
        """float32 (float64) x rounded to nearest even in DT. The interpreter's float32 to
        bfloat16 cast truncates, so there the rounding is done on the bits (finite x)."""
        if INTERPRETED and DT == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + ((bits >> 16) & 1) + 0x7FFF
            return ((bits >> 16) << 16).to(tl.float32, bitcast=True).to(DT)
        else:
            return x.to(DT)

    @triton.jit
    def _div(a, b, CT: tl.constexpr):
        """a / b rounded to nearest (Triton's float32 `/` is approximate)."""
        if CT == tl.float64:
            return a / b
        else:
            return tl.div_rn(a, b)

    @triton.jit
    def _norms(y, EPS: tl.constexpr, CT: tl.constexpr):
        """(||y||_2 per row, max(||y||_2, eps)) of CT rows y, the square root rounded to
        nearest (Triton's float32 sqrt is approximate)."""
        squares = tl.sum(y * y, axis=1)
        if CT == tl.float64:
            norm = tl.sqrt(squares)
        else:
            norm = tl.sqrt_rn(squares)
        return norm, tl.maximum(norm, tl.full([], EPS, CT))

    @triton.jit
    def _conv_rows(x_at, w_at, t, d_ok, T, C, stride_wk, K: tl.constexpr,
                   HAS_CONV: tl.constexpr, CT: tl.constexpr):
        """y at rows t of one sequence (x_at: x's rows t, the program's channels; w_at: the
        channels' tap 0) in x's dtype: the products w_j x_{t-K+1+j}, rows before the start
        read as zero, each rounded to x's dtype and summed in tap order, each sum rounded
        (stacked_causal_conv's rounding); x itself without a convolution."""
        XT: tl.constexpr = x_at.dtype.element_ty
        if HAS_CONV:
            for j in tl.static_range(K):
                s = t + (j - (K - 1))
                x = tl.load(x_at + (j - (K - 1)) * C,
                            mask=((s >= 0) & (s < T))[:, None] & d_ok[None, :], other=0.0)
                w = _rounded(tl.load(w_at + j * stride_wk, mask=d_ok, other=0.0).to(CT), XT)
                p = _rounded(x.to(CT) * w.to(CT)[None, :], XT)
                if j == 0:
                    y = p
                else:
                    y = _rounded(y.to(CT) + p.to(CT), XT)
        else:
            y = tl.load(x_at, mask=(t < T)[:, None] & d_ok[None, :], other=0.0)
        return y

    @triton.jit
    def _forward_kernel(X, W, OUT, T, C, H, B, col0, D, stride_wn, stride_wc, stride_wk,
                        K: tl.constexpr, HAS_CONV: tl.constexpr, MODE: tl.constexpr,
                        SCALE: tl.constexpr, EPS: tl.constexpr, CT: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """One output (q, k or v: its channels start at col0, D per head) at the rows of
        one block of T of one sequence r = n * B + b, one head h: OUT `[N * B, T, H, D]`.
        MODE 0: y; 1: y / max(||y||, eps) per row; 2: y * SCALE."""
        XT: tl.constexpr = X.dtype.element_ty
        r = tl.program_id(1)
        h = tl.program_id(2)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        c = col0 + h * D + d
        rows = r.to(tl.int64) * T + t  # rows of x and of OUT
        y = _conv_rows(X + rows[:, None] * C + c[None, :],
                       W + (r // B) * stride_wn + c * stride_wc, t, d_ok, T, C, stride_wk, K,
                       HAS_CONV, CT)
        if MODE == 1:
            yf = y.to(CT)
            _, den = _norms(yf, EPS, CT)
            out = _rounded(_div(yf, den[:, None], CT), XT)
        elif MODE == 2:
            out = _rounded(y.to(CT) * tl.full([], SCALE, CT), XT)
        else:
            out = y
        tl.store(OUT + (rows * H + h)[:, None] * D + d[None, :], out,
                 mask=(t < T)[:, None] & d_ok[None, :])

    @triton.jit
    def _grad_y(x_at, w_at, g_at, t, d_ok, T, C, stride_wk, K: tl.constexpr,
                HAS_CONV: tl.constexpr, MODE: tl.constexpr, SCALE: tl.constexpr,
                EPS: tl.constexpr, CT: tl.constexpr):
        """The gradient at the convolution's output y at rows t (zero at rows >= T) from the
        output's gradient there (g_at: its rows t); "l2" recomputes y and its norms. With
        n = ||y|| and den = max(n, eps), F.normalize's gradient is
        (g - yhat (g . yhat) [n >= eps]) / den, yhat = y / den (clamp_min passes the
        gradient where n >= eps)."""
        ok = (t < T)[:, None] & d_ok[None, :]
        g = tl.load(g_at, mask=ok, other=0.0).to(CT)
        if MODE == 1:
            y = _conv_rows(x_at, w_at, t, d_ok, T, C, stride_wk, K, HAS_CONV, CT).to(CT)
            norm, den = _norms(y, EPS, CT)
            yhat = _div(y, den[:, None], CT)
            dot = tl.where(norm >= tl.full([], EPS, CT), tl.sum(g * yhat, axis=1), 0.0)
            dy = tl.where(ok, _div(g - yhat * dot[:, None], den[:, None], CT), 0.0)
        elif MODE == 2:
            dy = g * tl.full([], SCALE, CT)
        else:
            dy = g
        return dy

    @triton.jit
    def _backward_kernel(X, W, DOUT, DX, DW, T, C, H, B, col0, D, NTB, stride_wn, stride_wc,
                         stride_wk, K: tl.constexpr, HAS_CONV: tl.constexpr,
                         MODE: tl.constexpr, SCALE: tl.constexpr, EPS: tl.constexpr,
                         CT: tl.constexpr, WANT_DW: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_D: tl.constexpr):
        """d qkv of one output's channels at the rows of one block (NTB blocks per
        sequence) of sequence r, one head:  dx_s = sum_j w_j dy_{s+K-1-j}, dy read at K
        shifted rows; with WANT_DW, the block's part of the weight's gradient,
        sum_t dy_t x_{t-K+1+j}, at DW `[N, B * NTB, C, K]` (every entry written by exactly
        one program)."""
        XT: tl.constexpr = X.dtype.element_ty
        pid_t = tl.program_id(0)
        r = tl.program_id(1)
        h = tl.program_id(2)
        t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        c = col0 + h * D + d
        rows = r.to(tl.int64) * T + t
        x_at = X + rows[:, None] * C + c[None, :]
        w_at = W + (r // B) * stride_wn + c * stride_wc
        g_at = DOUT + (rows * H + h)[:, None] * D + d[None, :]
        dy = _grad_y(x_at, w_at, g_at, t, d_ok, T, C, stride_wk, K, HAS_CONV, MODE, SCALE,
                     EPS, CT)
        if HAS_CONV:
            dx = tl.zeros([BLOCK_T, BLOCK_D], CT)
            for shift in tl.static_range(K):
                if shift == 0:
                    later = dy
                else:
                    later = _grad_y(x_at + shift * C, w_at, g_at + shift * H * D, t + shift,
                                    d_ok, T, C, stride_wk, K, HAS_CONV, MODE, SCALE, EPS, CT)
                w = tl.load(w_at + (K - 1 - shift) * stride_wk, mask=d_ok, other=0.0)
                dx += later * _rounded(w.to(CT), XT).to(CT)[None, :]
            if WANT_DW:
                dw_at = DW + ((r.to(tl.int64) * NTB + pid_t) * C + c) * K  # (n, b * NTB + pid_t)
                for j in tl.static_range(K):
                    s = t + (j - (K - 1))
                    x = tl.load(x_at + (j - (K - 1)) * C,
                                mask=((s >= 0) & (s < T))[:, None] & d_ok[None, :], other=0.0)
                    tl.store(dw_at + j, tl.sum(dy * x.to(CT), axis=0), mask=d_ok)
        else:
            dx = dy
        tl.store(DX + rows[:, None] * C + c[None, :], _rounded(dx, XT),
                 mask=(t < T)[:, None] & d_ok[None, :])
