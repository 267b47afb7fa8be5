"""Stacked AdamW in one pass: `FlatAdamW.step`'s update of N rows at once.

`adamw_step_(param, grad, exp_avg, exp_avg_sq, lr, weight_decay, steps, beta1=, beta2=,
eps=)` updates param, exp_avg and exp_avg_sq `[N, P]` in place, row n with its own learning
rate lr[n] and weight decay weight_decay[n], in `recall.stacked.FlatAdamW.step`'s order of
operations (torch.optim.AdamW's update with decoupled weight decay), t = steps (the count
after this step's increment, which the caller makes):

    c1 = 1 - beta1^t,  c2 = sqrt(1 - beta2^t)     (torch.pow and torch.sqrt on `steps`)
    p <- p * (1 - lr wd)
    m <- m.lerp(g, 1 - beta1)
    v <- v beta2 + (1 - beta2) g^2
    p <- p - (m / (sqrt(v) / c2 + eps)) * (lr / c1)

Two paths:
  "torch"   FlatAdamW.step's PyTorch ops (about ten passes over the rows);
  "triton"  (CUDA; the CPU under TRITON_INTERPRET=1) one kernel that reads p, g, m and v
            once and writes p, m and v once. The bias corrections c1 and c2 are computed by
            the same PyTorch ops as the other path (0-dim tensors: a few scalar kernels), so
            both paths take the same c1 and c2. Every operation rounds once, to nearest, in
            the rows' dtype (division and square root included), and the kernel fuses
            multiply-adds exactly where PyTorch's CUDA kernels do: the lerp (weight < 0.5:
            m + w (g - m); else g - (g - m)(1 - w)) and addcmul's (1 - beta2) * (g * g) + v
            beta2, nowhere else (the compiler's own contraction is off). The paths differ by
            a few ulps at most where the fused multiply-adds of the PyTorch kernels that ran
            differ from these (PyTorch's CPU kernels fuse other products).
Everything the update reads lives on the rows' device (lr, weight_decay and steps are
tensors there) and nothing is read back to the host, so a CUDA graph can capture either
path. `impl="auto"` takes "triton" for float32 CUDA rows, "torch" otherwise (float64, CPU).
"""

from __future__ import annotations

import struct

import torch

from hla_bench.recall.kernels.common import IMPLS, INTERPRETED, div_rn, interpreted, tl, triton

DTYPES = (torch.float32, torch.float64)
BLOCK = 1024  # entries of a row per program


@torch.no_grad()
def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor, lr: torch.Tensor, weight_decay: torch.Tensor,
                steps: torch.Tensor, *, beta1: float, beta2: float, eps: float,
                impl: str = "auto") -> None:
    """One AdamW update of `[N, P]` rows in place (module docstring). param, grad, exp_avg,
    exp_avg_sq: `[N, P]`, one dtype (float32 or float64), one device, last dim contiguous;
    lr: `[N]` (any float dtype: rounded to the rows' dtype first, as FlatAdamW does);
    weight_decay: `[N]` or `[N, 1]` in the rows' dtype; steps: a 0-dim tensor in the rows'
    dtype holding the step count t >= 1 (after its increment)."""
    _check(param, grad, exp_avg, exp_avg_sq, lr, weight_decay, steps, beta1, beta2, eps, impl)
    correction1 = 1 - torch.pow(beta1, steps)
    correction2_sqrt = torch.sqrt(1 - torch.pow(beta2, steps))
    if _resolve(impl, param) == "torch":
        lr = lr.to(param.dtype).view(-1, 1)
        decay = weight_decay.view(-1, 1)
        param.mul_(1 - lr * decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / correction2_sqrt).add_(eps)
        param.sub_(exp_avg / denom * (lr / correction1))
        return
    N, P = param.shape
    lr, decay = lr.reshape(-1), weight_decay.reshape(-1)
    # PyTorch's kernels compare the lerp weight and the addcmul value in the rows' dtype
    rounded = _float32 if param.dtype == torch.float32 else float
    lerp_weight, addcmul_value = rounded(1 - beta1), rounded(1 - beta2)
    _adamw_kernel[(triton.cdiv(P, BLOCK), N)](
        param, grad, exp_avg, exp_avg_sq, lr, decay, correction1, correction2_sqrt, P,
        param.stride(0), grad.stride(0), exp_avg.stride(0), exp_avg_sq.stride(0),
        lr.stride(0), decay.stride(0),
        LERP_WEIGHT=1 - beta1, LERP_SMALL=abs(lerp_weight) < 0.5, BETA2=beta2,
        ADDCMUL_VALUE=1 - beta2,
        ADDCMUL_UNIT=addcmul_value == 1,
        EPS=eps, CT=tl.float64 if param.dtype == torch.float64 else tl.float32,
        BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False)


def _float32(value: float) -> float:
    """value rounded to float32 (what PyTorch's float32 kernels take a Python scalar as)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _check(param, grad, exp_avg, exp_avg_sq, lr, weight_decay, steps, beta1, beta2, eps,
           impl):
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    rows = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    for name, x in rows.items():
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"{name} must be an [N, P] tensor, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x)}")
        if x.shape != param.shape:
            raise ValueError(f"{name} must have param's shape {tuple(param.shape)}, got "
                             f"{tuple(x.shape)}")
        if x.dtype not in DTYPES:
            raise ValueError(f"{name} must be float32 or float64, got {x.dtype}")
        if x.dtype != param.dtype:
            raise ValueError(f"{name} must have param's dtype {param.dtype}, got {x.dtype}")
        if x.device != param.device:
            raise ValueError(f"{name} is on {x.device}, param on {param.device}")
        if x.shape[1] > 1 and x.stride(1) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous, got strides {x.stride()}")
    N = param.shape[0]
    scalars = (("lr", lr, ((N,),), None), ("weight_decay", weight_decay, ((N,), (N, 1)),
                                           param.dtype), ("steps", steps, ((),), param.dtype))
    for name, x, shapes, dtype in scalars:
        if not isinstance(x, torch.Tensor) or tuple(x.shape) not in shapes:
            raise ValueError(f"{name} must be a tensor of shape "
                             f"{' or '.join(str(list(s)) for s in shapes)}, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x)}")
        if not x.is_floating_point() or (dtype is not None and x.dtype != dtype):
            raise ValueError(f"{name} must be a {dtype or 'floating'} tensor, got {x.dtype}")
        if x.device != param.device:
            raise ValueError(f"{name} is on {x.device}, param on {param.device}")
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise ValueError(f"{name} must lie in [0, 1), got {value!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")


def _resolve(impl: str, param: torch.Tensor) -> str:
    """The path that runs: "torch" or "triton"."""
    if impl == "torch":
        return "torch"
    if impl == "auto":
        runs = triton is not None and param.is_cuda and param.dtype == torch.float32
        return "triton" if runs and param.numel() > 0 else "torch"
    if triton is None:
        raise ValueError("impl='triton' needs Triton, which is not installed")
    if not (param.is_cuda or interpreted()):
        raise ValueError(f"impl='triton' needs CUDA tensors (got {param.device}) or "
                         "TRITON_INTERPRET=1")
    if param.numel() == 0:
        raise ValueError(f"impl='triton' needs non-empty rows, got {tuple(param.shape)}")
    return "triton"


if triton is not None:
    @triton.jit
    def _adamw_kernel(PARAM, GRAD, M, V, LR, DECAY, C1, C2, P, stride_p, stride_g, stride_m,
                      stride_v, stride_lr, stride_decay, LERP_WEIGHT: tl.constexpr,
                      LERP_SMALL: tl.constexpr, BETA2: tl.constexpr,
                      ADDCMUL_VALUE: tl.constexpr, ADDCMUL_UNIT: tl.constexpr,
                      EPS: tl.constexpr, CT: tl.constexpr, BLOCK: tl.constexpr):
        """BLOCK entries of row n (program (i, n)). The hyperparameters are compile-time
        Python floats, rounded once to CT where they are used (float64 rows keep them
        exact); C1, C2 point at the 0-dim bias corrections."""
        n = tl.program_id(1).to(tl.int64)
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < P
        lr = tl.load(LR + n * stride_lr).to(CT)
        decay = tl.load(DECAY + n * stride_decay)
        step_size = div_rn(lr, tl.load(C1), CT)
        p = tl.load(PARAM + n * stride_p + cols, mask=ok)
        g = tl.load(GRAD + n * stride_g + cols, mask=ok)
        m = tl.load(M + n * stride_m + cols, mask=ok)
        v = tl.load(V + n * stride_v + cols, mask=ok)
        p = p * (1.0 - lr * decay)
        weight = tl.full([], LERP_WEIGHT, CT)
        if LERP_SMALL:
            m = _fma(weight, g - m, m, CT)
        else:
            m = _fma(-(g - m), 1.0 - weight, g, CT)
        if ADDCMUL_UNIT:
            v = _fma(g, g, v * tl.full([], BETA2, CT), CT)
        else:
            v = _fma(tl.full([], ADDCMUL_VALUE, CT), g * g, v * tl.full([], BETA2, CT), CT)
        if CT == tl.float64:
            root = tl.sqrt(v)
        else:
            root = tl.sqrt_rn(v)
        denom = div_rn(root, tl.load(C2), CT) + tl.full([], EPS, CT)
        p = p - div_rn(m, denom, CT) * step_size
        tl.store(PARAM + n * stride_p + cols, p, mask=ok)
        tl.store(M + n * stride_m + cols, m, mask=ok)
        tl.store(V + n * stride_v + cols, v, mask=ok)

    @triton.jit
    def _fma(a, b, c, CT: tl.constexpr):
        """a * b + c rounded once. The interpreter's fma rounds the product first, so there a
        float32 one is taken in float64, which holds the product exactly (its sum rounds
        twice, to float64 and then to float32: the fused result but for rare ties)."""
        if INTERPRETED and CT == tl.float32:
            return (a.to(tl.float64) * b.to(tl.float64) + c.to(tl.float64)).to(tl.float32)
        else:
            return tl.fma(a, b, c)
