"""The head and the cross-entropy of N models' labelled rows, fused, chunk by chunk.

    logits[n] = hidden[n] @ weight[n]^T (+ bias[n])                        [R, V] per model
    loss[n]   = sum over rows r with targets[n, r] != IGNORE of
                (logsumexp(logits[n, r]) - logits[n, r, targets[n, r]]) / max(counts[n], 1)

which is StackedLM.losses' value. The rows are taken `chunk_rows` at a time, so only one
chunk's logits `[N, chunk_rows, V]` ever exist (in the compute dtype; never every row's,
never in float32 for bfloat16 compute). For each chunk: the logits (one batched matmul in
the compute dtype, accumulated in float32 by the matmul), then a row step that reads them,
takes each row's log-sum-exp and the loss at its target in float32 (float64 for float64),
and overwrites the logits, in place, with their gradient

    dlogits = (softmax - onehot(target)) / max(count, 1)        (0 on IGNORE rows)

rounded to the compute dtype, as the autocast cast's backward rounds the float32 gradient of
the upcast logits before the bfloat16 matmuls' backward. From it the chunk's share of the
input gradients: d hidden = dlogits @ W (rows of this chunk), d W += dlogits^T @ hidden and
d bias += the column sums of dlogits, the last two accumulated over chunks in float32
(float64). So the gradients are complete when the forward returns (the gradient of each
loss with an upstream gradient of 1); the backward scales them by each model's upstream
gradient. Where no gradient is wanted (no_grad, or no input requires one) only the losses
are computed.

Under autocast (`torch.is_autocast_enabled(hidden.device.type)`), the compute dtype is
autocast's (bfloat16 in training): hidden, weight and bias are cast to it once, as
autocast's matmul casts them, and autocast is off inside (nothing is cast twice); a float64
input keeps float64 (autocast casts none). Without autocast it is the inputs' promoted
dtype. Compared with the unfused head (bmm under autocast, at_least_float32, F.cross_entropy)
the logits, losses and d hidden are computed the same way (for upstream gradients of 1, as
training's sum of the losses gives; others scale the rounded gradients here, the float32
ones there); d weight and d bias are summed in float32 over chunks and kept in float32 (the
unfused bmm backward rounds them to bfloat16).

The row step is a Triton kernel (CUDA, or impl="triton") or PyTorch ops in the accumulator
dtype (the CPU and float64). A target outside [0, V) other than IGNORE makes its model's
loss NaN (no host check, so it can run inside a CUDA graph).
"""

from __future__ import annotations

import torch

from tasks import IGNORE
from hla_bench.recall.kernels.common import (accumulator, check_device, check_tensor, jit,
                                             rounded, tl, triton, use_triton)

CHUNK_BYTES = 64 << 20  # the logits of one chunk, in the compute dtype, stay within this
MAX_BLOCK_V = 8192  # vocabulary entries a program holds at once (larger vocabularies loop)
ROW_ENTRIES = 8192  # entries of one tile of rows (rows x BLOCK_V) of the row kernel


@jit
def labelled_rows_kernel(LOGITS, TARGETS, INV_COUNT, LOSS, C, V, stride_tn, stride_ln,
                         ROWS: tl.constexpr, BLOCK_V: tl.constexpr, V_BLOCKS: tl.constexpr,
                         WRITE_GRAD: tl.constexpr, IGNORE_INDEX: tl.constexpr):
    """ROWS rows of model n's chunk (grid: row tiles x N). LOGITS `[N, C, V]` contiguous, in
    the compute dtype; TARGETS, LOSS: the chunk's columns of `[N, R]` tensors (rows at
    stride_tn, stride_ln); INV_COUNT `[N]` 1 / max(count, 1) in the accumulator dtype
    (LOSS's). Writes each row's loss (0 on IGNORE rows, NaN at a target outside [0, V)) and,
    with WRITE_GRAD, the gradient of the logits over them. The log-sum-exp runs online over
    V_BLOCKS blocks of BLOCK_V columns; with one block the tile stays in registers."""
    acc: tl.constexpr = LOSS.dtype.element_ty
    block = tl.program_id(0)
    n = tl.program_id(1)
    rows = block * ROWS + tl.arange(0, ROWS)
    row_ok = rows < C
    target = tl.load(TARGETS + n * stride_tn + rows, mask=row_ok, other=IGNORE_INDEX)
    base = (n * C + rows).to(tl.int64) * V
    cols = tl.arange(0, BLOCK_V)
    col_ok = cols < V
    # rows past C read 0 (finite), columns past V -inf (nothing in the sums)
    z0 = tl.load(LOGITS + base[:, None] + cols[None, :],
                 mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(acc)
    z0 = tl.where(col_ok[None, :], z0, float("-inf"))
    m = tl.max(z0, axis=1)
    total = tl.sum(tl.exp(z0 - m[:, None]), axis=1)
    picked = tl.sum(tl.where(cols[None, :] == target[:, None], z0, 0.0), axis=1)
    for j in range(1, V_BLOCKS):
        at = j * BLOCK_V + cols
        ok = at < V
        z = tl.load(LOGITS + base[:, None] + at[None, :], mask=row_ok[:, None] & ok[None, :],
                    other=0.0).to(acc)
        z = tl.where(ok[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
        picked += tl.sum(tl.where(at[None, :] == target[:, None], z, 0.0), axis=1)
        m = m_new
    lse = m + tl.log(total)
    valid = target != IGNORE_INDEX
    loss = tl.where(valid, lse - picked, 0.0)
    loss = tl.where(valid & ((target < 0) | (target >= V)), float("nan"), loss)
    tl.store(LOSS + n * stride_ln + rows, loss, mask=row_ok)
    if WRITE_GRAD:
        scale = tl.where(valid, tl.load(INV_COUNT + n), 0.0)
        if V_BLOCKS == 1:
            hit = tl.where(cols[None, :] == target[:, None], 1.0, 0.0)
            grad = (tl.exp(z0 - lse[:, None]) - hit) * scale[:, None]
            tl.store(LOGITS + base[:, None] + cols[None, :],
                     rounded(grad, LOGITS.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok[None, :])
        else:
            for j in range(V_BLOCKS):
                at = j * BLOCK_V + cols
                mask = row_ok[:, None] & (at < V)[None, :]
                z = tl.load(LOGITS + base[:, None] + at[None, :], mask=mask, other=0.0).to(acc)
                hit = tl.where(at[None, :] == target[:, None], 1.0, 0.0)
                grad = (tl.exp(z - lse[:, None]) - hit) * scale[:, None]
                tl.store(LOGITS + base[:, None] + at[None, :],
                         rounded(grad, LOGITS.dtype.element_ty), mask=mask)


def _rows_triton(logits, targets, inv_count, loss, write_grad: bool) -> None:
    N, C, V = logits.shape
    block_v = min(1 << (V - 1).bit_length(), MAX_BLOCK_V)
    rows = max(1, min(16, ROW_ENTRIES // block_v))
    labelled_rows_kernel[(triton.cdiv(C, rows), N)](
        logits, targets, inv_count, loss, C, V, targets.stride(0), loss.stride(0), ROWS=rows,
        BLOCK_V=block_v, V_BLOCKS=triton.cdiv(V, block_v), WRITE_GRAD=write_grad,
        IGNORE_INDEX=IGNORE, num_warps=4 if rows * block_v <= 2048 else 8)


def _rows_torch(logits, targets, inv_count, loss, write_grad: bool) -> None:
    """The row step in PyTorch ops, in the accumulator dtype (loss's): what the kernel
    writes, the same way (the gradient as exp(z - lse) - onehot, scaled)."""
    V = logits.shape[-1]
    z = logits.to(loss.dtype)
    valid = targets != IGNORE
    bad = valid & ((targets < 0) | (targets >= V))
    good = valid & ~bad
    index = torch.where(good, targets, 0).unsqueeze(-1)
    lse = torch.logsumexp(z, -1)
    row_loss = torch.where(valid, lse - z.gather(-1, index).squeeze(-1), 0.0)
    loss.copy_(torch.where(bad, torch.nan, row_loss))
    if write_grad:
        grad = torch.exp(z - lse.unsqueeze(-1))
        grad.scatter_add_(-1, index, -good.to(grad.dtype).unsqueeze(-1))
        grad *= torch.where(valid, inv_count[:, None], 0.0).unsqueeze(-1)
        logits.copy_(grad)


def _add_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total += a @ b (batched) with the products summed in total's dtype: 16-bit a and b go
    through a matmul with a float32 output on CUDA, and are widened to total's dtype on the
    CPU (the same exact products, summed in float32)."""
    if a.dtype == total.dtype:
        total.baddbmm_(a, b)
    elif total.is_cuda and total.dtype == torch.float32 and _FLOAT32_OUT:
        torch.baddbmm(total, a, b, out_dtype=torch.float32, out=total)
    else:
        total.baddbmm_(a.to(total.dtype), b.to(total.dtype))


# matmuls of 16-bit inputs with a float32 output (aten::baddbmm.dtype_out, CUDA, torch 2.8 on)
_FLOAT32_OUT = hasattr(torch.ops.aten.baddbmm, "dtype_out")


def inverse_counts(counts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """1 / max(count, 1) per model in `dtype`: the gradient of a mean over labelled rows."""
    return 1.0 / counts.clamp_min(1).to(dtype)


def default_chunk_rows(N: int, V: int, compute: torch.dtype) -> int:
    """Rows per chunk so that a chunk's logits `[N, rows, V]` fit CHUNK_BYTES (a multiple of
    64 rows when there are that many)."""
    rows = max(1, CHUNK_BYTES // (N * V * torch.finfo(compute).bits // 8))
    return rows - rows % 64 if rows >= 64 else rows


def chunked_cross_entropy(hidden, weight, bias, targets, counts, chunk_rows: int,
                          compute: torch.dtype, triton_path: bool,
                          want: tuple[bool, bool, bool]):
    """The chunked computation (module docstring) -> (losses `[N]`, d hidden `[N, R, d]` in
    hidden's dtype, d weight `[N, V, d]` and d bias `[N, V]` in the accumulator dtype; each
    gradient None unless `want` (hidden, weight, bias) asks for it)."""
    N, R, d = hidden.shape
    V = weight.shape[1]
    acc = accumulator(compute)
    h, W = hidden.to(compute), weight.to(compute)
    b = bias.to(compute).unsqueeze(1) if bias is not None else None
    want_h, want_w, want_b = want
    grad = want_h or want_w or want_b
    row_loss = torch.empty((N, R), dtype=acc, device=hidden.device)
    inv_count = inverse_counts(counts, acc)
    dh = torch.empty((N, R, d), dtype=hidden.dtype, device=hidden.device) if want_h else None
    dW = torch.zeros((N, V, d), dtype=acc, device=hidden.device) if want_w else None
    db = torch.zeros((N, V), dtype=acc, device=hidden.device) if want_b else None
    rows = _rows_triton if triton_path else _rows_torch
    for start in range(0, R, chunk_rows):
        end = min(R, start + chunk_rows)
        hc = h[:, start:end]
        logits = (torch.baddbmm(b, hc, W.transpose(1, 2)) if b is not None
                  else torch.bmm(hc, W.transpose(1, 2)))                  # [N, C, V], compute
        rows(logits, targets[:, start:end], inv_count, row_loss[:, start:end], grad)
        dlogits = logits  # overwritten with the gradient when `grad`
        if want_h:
            dh[:, start:end] = torch.bmm(dlogits, W)
        if want_w:
            _add_product(dW, dlogits.transpose(1, 2), hc)
        if want_b:
            db += dlogits.sum(1, dtype=acc)
    return row_loss.sum(1) / counts.clamp_min(1), dh, dW, db


class _LabelledCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, counts, chunk_rows, compute, triton_path,
                want):
        losses, dh, dW, db = chunked_cross_entropy(hidden, weight, bias, targets, counts,
                                                   chunk_rows, compute, triton_path, want)
        ctx.save_for_backward(dh, dW, db)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return losses

    @staticmethod
    def backward(ctx, grad):
        def scaled(x, dtype):  # each model's gradient times its upstream gradient
            if x is None:
                return None
            return (x * grad.view(-1, *(1,) * (x.dim() - 1))).to(dtype)

        dh, dW, db = ctx.saved_tensors
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        return (scaled(dh, h_dtype), scaled(dW, w_dtype), scaled(db, b_dtype), None, None,
                None, None, None, None)


def labelled_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                           counts: torch.Tensor, bias: torch.Tensor | None = None, *,
                           chunk_rows: int | None = None, impl: str = "auto") -> torch.Tensor:
    """`[N]` mean cross-entropy of each model over its labelled rows (module docstring).

    hidden `[N, R, d]` (the gathered labelled rows; 16-bit, float32 or float64), weight
    `[N, V, d]` (the tied embedding or the untied head), bias `[N, V]` or None, targets
    `[N, R]` (integer; IGNORE = -100 where a row is not labelled), counts `[N]` (integer:
    the divisor, labelled rows per model). Losses in float32 (float64 when computing in
    float64). Gradients reach hidden, weight and bias. `chunk_rows`: rows per chunk (None:
    as many as keep a chunk's logits within CHUNK_BYTES). `impl`: "auto" (the Triton row
    kernel on CUDA unless computing in float64, else PyTorch), "triton" (the kernel; on the
    CPU under TRITON_INTERPRET=1) or "torch". Under autocast the head runs in autocast's
    dtype (see the module docstring). No host syncs and static shapes only: CUDA-graph
    capturable."""
    check_tensor("hidden", hidden, tuple(hidden.shape))
    if hidden.dim() != 3 or hidden.shape[0] < 1 or hidden.shape[2] < 1:
        raise ValueError(f"hidden must have shape [N, R, d] with N, d >= 1, "
                         f"got {list(hidden.shape)}")
    N, R, d = hidden.shape
    check_tensor("weight", weight, tuple(weight.shape))
    if weight.dim() != 3 or weight.shape[0] != N or weight.shape[2] != d or weight.shape[1] < 1:
        raise ValueError(f"weight must have shape [N, V, d] = [{N}, V, {d}] with V >= 1, "
                         f"got {list(weight.shape)}")
    V = weight.shape[1]
    if bias is not None:
        check_tensor("bias", bias, (N, V))
    check_tensor("targets", targets, (N, R), floating=False)
    check_tensor("counts", counts, (N,), floating=False)
    check_device(hidden, weight=weight, bias=bias, targets=targets, counts=counts)
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or
                                   not isinstance(chunk_rows, int) or chunk_rows < 1):
        raise ValueError(f"chunk_rows must be a positive int or None, got {chunk_rows!r}")
    device = hidden.device.type
    dtypes = [hidden.dtype, weight.dtype] + ([bias.dtype] if bias is not None else [])
    if torch.is_autocast_enabled(device) and torch.float64 not in dtypes:
        compute = torch.get_autocast_dtype(device)
    else:
        compute = dtypes[0]
        for dtype in dtypes[1:]:
            compute = torch.promote_types(compute, dtype)
    triton_path = use_triton(impl, hidden.device, compute)
    grad = torch.is_grad_enabled()
    want = (grad and hidden.requires_grad, grad and weight.requires_grad,
            grad and bias is not None and bias.requires_grad)
    with torch.autocast(device, enabled=False):
        return _LabelledCrossEntropy.apply(
            hidden, weight, bias, targets.to(torch.int64).contiguous(), counts,
            chunk_rows or default_chunk_rows(N, V, compute), compute, triton_path, want)
