"""The causal hla3 forward: one program per (value block, batch x head) walks the chunks in
order carrying S^K (d x d) and its columns of P and F (the chunk equations of
mixers/hla/hla3/chunk.py; A = Q K^T, L the lower triangle with its diagonal):

    r  = Q P0 + (L * A) V
    Bm = L * ((Q S0) Q^T + A (L * A)^T)
    O  = Q F0 + Bm r
    F' = F0 + S0 (Q^T r) + K^T ((L * A)^T r),   S' = S0 + K^T K,   P' = P0 + K^T V

Value columns are independent, so the packed width (value dim, plus the ones column of the
denominator when normalized) is split over programs; every program carries the whole S^K
and the first writes it back. Inputs are read in place from `[B, T, H, D]` tensors; rows
past T and columns past D or Dv are masked loads of zero, and the chunk loop runs to a
compile-time power of two (steps past the last chunk change nothing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mixers.hla.tiles import load_qkv, packed_offsets, value_block
from mixers.hla.ahla2.triton.forward import precision, token_strides
from mixers.hla.hla3.triton.increments import hla3_increments_kernel
from mixers.hla.hla3.triton.output import hla3_output_kernel
from mixers.hla.hla3.triton.plan import HLA3Plan
from mixers.hla.hla3.triton.scan import hla3_scan_kernel


@triton.jit
def hla3_forward_kernel(Q, K, V, S0, P0, F0, O, S1, P1, F1, SS, PS, FS, T, H, D, DV, DVP,
                        NT,
                        stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                        stride_vb, stride_vt, stride_vh,
                        C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                        NT_BOUND: tl.constexpr, NORMALIZE: tl.constexpr,
                        STORE_STATES: tl.constexpr, PRECISION: tl.constexpr):
    acc: tl.constexpr = O.dtype.element_ty
    rows = tl.arange(0, C)
    pid_v, b, h, bh, dk, cols, d_ok, state, state_ok = value_block(H, D, DVP, BD, BV)
    moment = bh * D * D + dk[:, None] * D + dk[None, :]
    moment_ok = d_ok[:, None] & d_ok[None, :]
    S = tl.load(S0 + moment, mask=moment_ok, other=0.0).to(acc)
    P = tl.load(P0 + state, mask=state_ok, other=0.0).to(acc)
    F = tl.load(F0 + state, mask=state_ok, other=0.0).to(acc)
    causal = rows[:, None] >= rows[None, :]
    for chunk in range(NT_BOUND):
        t = chunk * C + rows
        t_ok = t < T
        if STORE_STATES:  # each chunk's start states, for the backward
            at = (bh * NT + chunk) * D * DVP + dk[:, None] * DVP + cols[None, :]
            tl.store(PS + at, P, mask=state_ok & (chunk < NT))
            tl.store(FS + at, F, mask=state_ok & (chunk < NT))
            tl.store(SS + (bh * NT + chunk) * D * D + dk[:, None] * D + dk[None, :], S,
                     mask=moment_ok & (chunk < NT) & (pid_v == 0))
        q, k, v = load_qkv(Q, K, V, b, t, h, t_ok, D, DV, dk, cols, stride_qb, stride_qt,
                           stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                           stride_vh, NORMALIZE, acc)
        A = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        LA = tl.where(causal, A, 0.0).to(acc)
        r = tl.dot(q, P, input_precision=PRECISION) + tl.dot(LA, v, input_precision=PRECISION)
        QS = tl.dot(q, S, input_precision=PRECISION)
        Bm = tl.dot(QS, tl.trans(q), input_precision=PRECISION)
        Bm += tl.dot(A, tl.trans(LA), input_precision=PRECISION)
        Bm = tl.where(causal, Bm, 0.0).to(acc)
        out = tl.dot(q, F, input_precision=PRECISION) + tl.dot(Bm, r, input_precision=PRECISION)
        Qr = tl.dot(tl.trans(q), r, input_precision=PRECISION)
        LAr = tl.dot(tl.trans(LA), r, input_precision=PRECISION)
        F += tl.dot(S, Qr, input_precision=PRECISION)
        F += tl.dot(tl.trans(k), LAr, input_precision=PRECISION)
        S += tl.dot(tl.trans(k), k, input_precision=PRECISION)
        P += tl.dot(tl.trans(k), v, input_precision=PRECISION)
        tl.store(O + packed_offsets(b, t, h, T, H, DVP, cols), out.to(acc),
                 mask=t_ok[:, None] & (cols < DVP)[None, :])
    tl.store(S1 + moment, S, mask=moment_ok & (pid_v == 0))
    tl.store(P1 + state, P, mask=state_ok)
    tl.store(F1 + state, F, mask=state_ok)


def forward(q, k, v, S0, P0, F0, normalize: bool, plan: HLA3Plan, keep_states: bool = False):
    """Packed outputs `[B, T, H, Dv(+1)]` and final (S, P, F), in P0's dtype, from
    `[B, T, H, *]` q, k, v (last dim contiguous) and packed start states; with `keep_states`
    also every chunk's start states `[B * H, NT, D, D | Dv(+1)]` (else None). plan.walk:
    the one-kernel walk (above), else the three chunk-parallel stages (increments.py,
    scan.py, output.py)."""
    if not plan.walk:
        return _staged(q, k, v, S0, P0, F0, normalize, plan, keep_states)
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    width = Dv + normalize
    NT = triton.cdiv(T, plan.chunk)
    S0, P0, F0 = S0.contiguous(), P0.contiguous(), F0.contiguous()
    out = torch.empty(B, T, H, width, dtype=P0.dtype, device=q.device)
    S1, P1, F1 = torch.empty_like(S0), torch.empty_like(P0), torch.empty_like(F0)
    starts = [None] * 3
    if keep_states:
        starts = [torch.empty(B * H, NT, D, n, dtype=P0.dtype, device=q.device)
                  for n in (D, width, width)]
    grid = (triton.cdiv(width, plan.block_v), B * H)
    hla3_forward_kernel[grid](
        q, k, v, S0, P0, F0, out, S1, P1, F1,
        *(start if keep_states else final for start, final in zip(starts, (S1, P1, F1))),
        T, H, D, Dv, width, NT,
        *token_strides(q, k, v),
        C=plan.chunk, BD=plan.block_d, BV=plan.block_v, NT_BOUND=triton.next_power_of_2(NT),
        NORMALIZE=normalize, STORE_STATES=keep_states, PRECISION=precision(q.dtype),
        num_warps=plan.warps)
    return (out, S1, P1, F1, *starts)


def _staged(q, k, v, S0, P0, F0, normalize, plan, keep_states):
    """forward() in three chunk-parallel stages: every chunk's terms, the scan of the start
    states over them, every chunk's outputs; the start states are kept at no extra cost."""
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    width = Dv + normalize
    NT = triton.cdiv(T, plan.chunk)
    dtype = P0.dtype
    S0, P0, F0 = S0.contiguous(), P0.contiguous(), F0.contiguous()
    square = [torch.empty(B * H, NT, D, D, dtype=dtype, device=q.device) for _ in range(4)]
    XS, XG, XJ, SS = square
    XP, XH, XL = (torch.empty(B * H, NT, D, width, dtype=dtype, device=q.device)
                  for _ in range(3))
    out = torch.empty(B, T, H, width, dtype=dtype, device=q.device)
    S1, P1, F1 = torch.empty_like(S0), torch.empty_like(P0), torch.empty_like(F0)
    strides = token_strides(q, k, v)
    blocks = triton.cdiv(width, plan.block_v)
    common = dict(BD=plan.block_d, BV=plan.block_v, PRECISION=precision(q.dtype),
                  num_warps=plan.warps)
    hla3_increments_kernel[(NT, blocks, B * H)](
        q, k, v, XS, XG, XJ, XP, XH, XL, T, H, D, Dv, width, NT, *strides, C=plan.chunk,
        NORMALIZE=normalize, **common)
    hla3_scan_kernel[(blocks, B * H)](
        S0, P0, F0, S1, P1, F1, SS, XS, XG, XJ, XP, XH, XL, H, D, width, NT,
        NT_BOUND=triton.next_power_of_2(NT), **common)
    del XS, XG, XJ, XL
    hla3_output_kernel[(NT, blocks, B * H)](
        q, k, v, SS, XP, XH, out, T, H, D, Dv, width, NT, *strides, C=plan.chunk,
        NORMALIZE=normalize, **common)
    starts = (SS, XP, XH) if keep_states else (None, None, None)
    return (out, S1, P1, F1, *starts)
