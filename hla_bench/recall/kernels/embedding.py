"""Stacked embedding lookup whose backward sums each vocabulary row's gradients without
atomics.

`stacked_embedding(tokens, weight)`: N models' embeddings at once, tokens `[N, ...]` (model
n's ids in [0, V)), weight `[N, V, d]`:

    out[n, i] = weight[n, tokens[n, i]]                                       (F.embedding)
    dweight[n, v] = sum over i with tokens[n, i] = v of dout[n, i]            (0 where none)

The lookup is one F.embedding over the flat table `[N V, d]` at ids tokens[n] + n V (traced
and fused by torch.compile like any PyTorch op). The backward is
`embedding_row_sums(grad, ids, rows)`, the row sums of a flat gradient `[M, d]` over ids
`[M]` into `[rows, d]`, a custom op (`hla_bench::embedding_row_sums`) that torch.compile
keeps whole, as one opaque call, in place of inductor's atomic scatter-add:

  "triton"  (CUDA; the CPU under TRITON_INTERPRET=1) the ids sorted on the device (a stable
            torch.sort of int32 keys: the positions of each id stay in their order), each
            row's segment [starts[v], starts[v + 1]) of the sorted positions found by
            torch.searchsorted against arange(rows + 1), then one kernel in which program
            (v, c) owns row v and a block of its columns: it gathers the gradient rows of its
            segment, BLOCK_T at a time, sums them in registers and writes row v once (0 for
            an empty segment). Every output row is written exactly once by one program: no
            atomics, no zero fill, the same result on every run. A row's cost grows with its
            segment (a row that takes every token is summed by one program).
  "torch"   (the CPU, float64) index_add_ into zeros in the accumulator dtype (on CUDA
            index_add_ adds with atomics of its own).
Sums run in float32 (float64 for float64 gradients) and are rounded once to the gradient's
dtype. Wherever the sums are exact (small dyadic gradients) both paths give F.embedding's
own gradient bit for bit; otherwise they differ from it and from each other only in the
order of the additions (in float64, to its rounding). Nothing is read back to the host
(sort, searchsorted and the launch have static shapes), so a CUDA graph can capture either
path. `impl="auto"` takes "triton" for
16-bit and float32 gradients on CUDA, "torch" otherwise.

Ids outside [0, rows) are the caller's error: the forward's F.embedding raises on the CPU
(a device-side assert on CUDA); the row sums skip them on the Triton path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hla_bench.recall.kernels.common import (IMPLS, accumulator, check_tensor, jit, rounded,
                                             tl, triton, use_triton)

BLOCK_T = 16   # sorted positions a program sums per iteration of its segment
MAX_BLOCK_D = 128  # columns of a row per program (d is split over programs past it)


@jit
def embedding_row_sums_kernel(GRAD, ORDER, STARTS, OUT, D, stride_g, BLOCK_T: tl.constexpr,
                              BLOCK_D: tl.constexpr):
    """Row v of OUT `[rows, D]` (contiguous), columns of block c (grid: rows x column
    blocks): the sum of GRAD's rows ORDER[j] (GRAD `[M, D]`, rows at stride_g, last dim
    contiguous) for j in [STARTS[v], STARTS[v + 1]), in float32 (float64 for float64 GRAD)
    and rounded once to OUT's dtype."""
    acc: tl.constexpr = tl.float64 if GRAD.dtype.element_ty == tl.float64 else tl.float32
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    start = tl.load(STARTS + row)
    end = tl.load(STARTS + row + 1)
    total = tl.zeros([BLOCK_T, BLOCK_D], dtype=acc)
    first = start
    while first < end:
        at = first + tl.arange(0, BLOCK_T)
        ok = at < end
        source = tl.load(ORDER + at, mask=ok, other=0).to(tl.int64)
        g = tl.load(GRAD + source[:, None] * stride_g + cols[None, :],
                    mask=ok[:, None] & col_ok[None, :], other=0.0)
        total += g.to(acc)
        first += BLOCK_T
    tl.store(OUT + row * D + cols, rounded(tl.sum(total, axis=0), OUT.dtype.element_ty),
             mask=col_ok)


def _row_sums_torch(grad: torch.Tensor, ids: torch.Tensor, rows: int) -> torch.Tensor:
    acc = accumulator(grad.dtype)
    out = torch.zeros((rows, grad.shape[1]), dtype=acc, device=grad.device)
    return out.index_add_(0, ids, grad.to(acc)).to(grad.dtype)


def _row_sums_triton(grad: torch.Tensor, ids: torch.Tensor, rows: int) -> torch.Tensor:
    M, D = grad.shape
    out = torch.empty((rows, D), dtype=grad.dtype, device=grad.device)
    if rows == 0 or D == 0:
        return out
    if M == 0:
        return out.zero_()
    grad = grad if grad.stride(1) == 1 else grad.contiguous()
    # int32 keys (ids < rows < 2^31): a radix sort of half the passes of int64 ones
    keys = ids.to(torch.int32) if rows < 2**31 else ids
    ordered, order = torch.sort(keys, stable=True)
    bounds = torch.arange(rows + 1, dtype=keys.dtype, device=grad.device)
    starts = torch.searchsorted(ordered, bounds)  # [rows + 1]: row v's segment
    block_d = min(MAX_BLOCK_D, 1 << max(0, D - 1).bit_length())
    embedding_row_sums_kernel[(rows, triton.cdiv(D, block_d))](
        grad, order, starts, out, D, grad.stride(0), BLOCK_T=BLOCK_T, BLOCK_D=block_d,
        num_warps=4)
    return out


@torch.library.custom_op("hla_bench::embedding_row_sums", mutates_args=())
def _row_sums_op(grad: torch.Tensor, ids: torch.Tensor, rows: int, impl: str) -> torch.Tensor:
    if use_triton(impl, grad.device, grad.dtype):
        return _row_sums_triton(grad, ids, rows)
    return _row_sums_torch(grad, ids, rows)


@_row_sums_op.register_fake
def _(grad, ids, rows, impl):
    return grad.new_empty((rows, grad.shape[1]))


def _described(x) -> str:
    """x's shape as a list, or its type where it is no tensor (for error messages)."""
    return str(list(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def _check_row_sums(grad, ids, rows, impl) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if not isinstance(grad, torch.Tensor) or grad.dim() != 2:
        raise ValueError(f"grad must be an [M, d] tensor, got {_described(grad)}")
    check_tensor("grad", grad, tuple(grad.shape))
    check_tensor("ids", ids, (grad.shape[0],), floating=False)
    if ids.device != grad.device:
        raise ValueError(f"ids is on {ids.device}, grad on {grad.device}")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"rows must be an int >= 0, got {rows!r}")


def embedding_row_sums(grad: torch.Tensor, ids: torch.Tensor, rows: int, *,
                       impl: str = "auto") -> torch.Tensor:
    """`[rows, d]`: row v the sum of grad's rows i with ids[i] = v (0 where none), in
    float32 (float64) and rounded once to grad's dtype (module docstring). grad `[M, d]`
    (any float dtype), ids `[M]` (an integer dtype, values in [0, rows)). `impl`: "auto",
    "triton" or "torch"."""
    _check_row_sums(grad, ids, rows, impl)
    use_triton(impl, grad.device, grad.dtype)  # a ValueError where "triton" cannot run
    return _row_sums_op(grad, ids.long(), rows, impl)


class _StackedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, ids, impl):
        ctx.save_for_backward(ids)
        ctx.rows, ctx.impl = weight.shape[0], impl
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        d = grad.shape[-1]
        dweight = torch.ops.hla_bench.embedding_row_sums(grad.reshape(-1, d), ids.reshape(-1),
                                                         ctx.rows, ctx.impl)
        return dweight, None, None


def stacked_embedding(tokens: torch.Tensor, weight: torch.Tensor, *,
                      impl: str = "auto") -> torch.Tensor:
    """N models' embedding lookups, `[N, ..., d]`: out[n, ...] = weight[n, tokens[n, ...]]
    (module docstring). tokens `[N, ...]` of an integer dtype, model n's ids in [0, V);
    weight `[N, V, d]` (any float dtype; rows of a stacked buffer may be strided views).
    The gradient of weight is formed by `embedding_row_sums` (`impl`: "auto", "triton" or
    "torch"), so a weight gradient is written once per row, without atomics."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
        raise ValueError(f"weight must be an [N, V, d] tensor, got {_described(weight)}")
    check_tensor("weight", weight, tuple(weight.shape))
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 1:
        raise ValueError(f"tokens must be an [N, ...] tensor, got {_described(tokens)}")
    check_tensor("tokens", tokens, tuple(tokens.shape), floating=False)
    N, V, d = weight.shape
    if tokens.shape[0] != N:
        raise ValueError(f"tokens must have weight's {N} models in dim 0, got "
                         f"{list(tokens.shape)}")
    if tokens.device != weight.device:
        raise ValueError(f"tokens is on {tokens.device}, weight on {weight.device}")
    use_triton(impl, weight.device, weight.dtype)  # a ValueError where "triton" cannot run
    offsets = torch.arange(N, device=tokens.device).mul_(V).view(N, *([1] * (tokens.dim() - 1)))
    return _StackedEmbedding.apply(weight.reshape(N * V, d), tokens.long() + offsets, impl)
