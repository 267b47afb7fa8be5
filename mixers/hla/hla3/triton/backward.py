"""The causal hla3 backward: one program per (value block, batch x head) walks the chunks in
reverse, carrying the gradients of the chunk's end states (dS, dP, dF), and reads each
chunk's start states (S0, P0, F0) kept by the forward. With the forward's A = Q K^T,
LA = L * A, r = Q P0 + LA V, Bm = L * ((Q S0) Q^T + A LA^T), Y = LA^T r, per chunk (S0 and
so S^K symmetric):

    dr  = Bm^T dO + (Q S0) dF + LA (K dF)          dBm = L * (dO r^T)
    dLA = dr V^T + dBm^T A + r (K dF)^T            dA  = dBm LA + L * dLA
    dQ  = dr P0^T + dO F0^T + (dBm + dBm^T) (Q S0) + r dF^T S0 + dA K
    dK  = dA^T Q + Y dF^T + K (dS + dS^T) + V dP^T
    dV  = LA^T dr + K dP
    dS <- dS + Q^T dBm Q + dF r^T Q,   dP <- dP + Q^T dr,   dF <- dF + Q^T dO

dV's columns belong to one program. dQ, dK and dS sum over value columns: each program
carries and writes its own part (the final state's dS enters in the first program's), and
the parts are added after.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mixers.hla.tiles import load_rows, load_values, value_block
from mixers.hla.ahla2.triton.forward import precision
from mixers.hla.hla3.triton.plan import HLA3Plan


@triton.jit
def hla3_backward_kernel(Q, K, V, SS, PS, FS, DO, DS1, DP1, DF1, DQ, DK, DVAL, DS0, DP0, DF0,
                         B, T, H, D, DV, DVP, NT,
                         stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
                         stride_vb, stride_vt, stride_vh,
                         C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                         NT_BOUND: tl.constexpr, NORMALIZE: tl.constexpr,
                         PRECISION: tl.constexpr):
    acc: tl.constexpr = PS.dtype.element_ty
    rows = tl.arange(0, C)
    pid_v, b, h, bh, dk, cols, d_ok, state, state_ok = value_block(H, D, DVP, BD, BV)
    c_ok = cols < DVP
    moment = bh * D * D + dk[:, None] * D + dk[None, :]
    moment_ok = d_ok[:, None] & d_ok[None, :]
    dS = tl.load(DS1 + moment, mask=moment_ok & (pid_v == 0), other=0.0).to(acc)
    dP = tl.load(DP1 + state, mask=state_ok, other=0.0).to(acc)
    dF = tl.load(DF1 + state, mask=state_ok, other=0.0).to(acc)
    causal = rows[:, None] >= rows[None, :]
    for step in range(NT_BOUND):  # chunks past the last load nothing and change nothing
        chunk = NT_BOUND - 1 - step
        t = chunk * C + rows
        t_ok = t < T
        qk_ok = t_ok[:, None] & d_ok[None, :]
        q = load_rows(Q, b, t, h, stride_qb, stride_qt, stride_qh, dk, qk_ok, acc)
        k = load_rows(K, b, t, h, stride_kb, stride_kt, stride_kh, dk, qk_ok, acc)
        v = load_values(V, b, t, h, stride_vb, stride_vt, stride_vh, cols, t_ok, DV, NORMALIZE,
                        acc)
        dO = tl.load(DO + ((b * T + t[:, None]) * H + h) * DVP + cols[None, :],
                     mask=t_ok[:, None] & c_ok[None, :], other=0.0).to(acc)
        at = (bh * NT + chunk) * D * DVP + dk[:, None] * DVP + cols[None, :]
        P0 = tl.load(PS + at, mask=state_ok & (chunk < NT), other=0.0).to(acc)
        F0 = tl.load(FS + at, mask=state_ok & (chunk < NT), other=0.0).to(acc)
        S0 = tl.load(SS + (bh * NT + chunk) * D * D + dk[:, None] * D + dk[None, :],
                     mask=moment_ok & (chunk < NT), other=0.0).to(acc)
        A = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        LA = tl.where(causal, A, 0.0).to(acc)
        r = tl.dot(q, P0, input_precision=PRECISION) + tl.dot(LA, v, input_precision=PRECISION)
        QS = tl.dot(q, S0, input_precision=PRECISION)
        Bm = tl.dot(QS, tl.trans(q), input_precision=PRECISION)
        Bm += tl.dot(A, tl.trans(LA), input_precision=PRECISION)
        Bm = tl.where(causal, Bm, 0.0).to(acc)
        kdF = tl.dot(k, dF, input_precision=PRECISION)
        dr = tl.dot(tl.trans(Bm), dO, input_precision=PRECISION)
        dr += tl.dot(QS, dF, input_precision=PRECISION)
        dr += tl.dot(LA, kdF, input_precision=PRECISION)
        dBm = tl.where(causal, tl.dot(dO, tl.trans(r), input_precision=PRECISION), 0.0).to(acc)
        dLA = tl.dot(dr, tl.trans(v), input_precision=PRECISION)
        dLA += tl.dot(tl.trans(dBm), A, input_precision=PRECISION)
        dLA += tl.dot(r, tl.trans(kdF), input_precision=PRECISION)
        dA = tl.dot(dBm, LA, input_precision=PRECISION) + tl.where(causal, dLA, 0.0).to(acc)
        rdF = tl.dot(r, tl.trans(dF), input_precision=PRECISION)
        dQ = tl.dot(dr, tl.trans(P0), input_precision=PRECISION)
        dQ += tl.dot(dO, tl.trans(F0), input_precision=PRECISION)
        dQ += tl.dot(dBm + tl.trans(dBm), QS, input_precision=PRECISION)
        dQ += tl.dot(rdF, S0, input_precision=PRECISION)
        dQ += tl.dot(dA, k, input_precision=PRECISION)
        Y = tl.dot(tl.trans(LA), r, input_precision=PRECISION)
        dK = tl.dot(tl.trans(dA), q, input_precision=PRECISION)
        dK += tl.dot(Y, tl.trans(dF), input_precision=PRECISION)
        dK += tl.dot(k, dS + tl.trans(dS), input_precision=PRECISION)
        dK += tl.dot(v, tl.trans(dP), input_precision=PRECISION)
        dV = tl.dot(tl.trans(LA), dr, input_precision=PRECISION)
        dV += tl.dot(k, dP, input_precision=PRECISION)
        part = (((pid_v * B + b) * T + t[:, None]) * H + h) * D + dk[None, :]
        tl.store(DQ + part, dQ, mask=qk_ok)
        tl.store(DK + part, dK, mask=qk_ok)
        tl.store(DVAL + ((b * T + t[:, None]) * H + h) * DV + cols[None, :], dV,
                 mask=t_ok[:, None] & (cols < DV)[None, :])
        dS += tl.dot(tl.dot(tl.trans(q), dBm, input_precision=PRECISION), q,
                     input_precision=PRECISION)
        dS += tl.dot(tl.trans(rdF), q, input_precision=PRECISION)
        dP += tl.dot(tl.trans(q), dr, input_precision=PRECISION)
        dF += tl.dot(tl.trans(q), dO, input_precision=PRECISION)
    tl.store(DS0 + pid_v * B * H * D * D + moment, dS, mask=moment_ok)
    tl.store(DP0 + state, dP, mask=state_ok)
    tl.store(DF0 + state, dF, mask=state_ok)


def backward(q, k, v, starts, grads, normalize: bool, plan: HLA3Plan):
    """(dq, dk, dv, dS0, dP0, dF0) of the packed causal hla3 forward. `starts`: the chunks'
    start states (S, P, F) kept by the forward; `grads`: the gradients of the packed output
    and of the final S, P, F (None: zeros)."""
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    width = Dv + normalize
    S_starts, P_starts, F_starts = starts
    dtype, NT = P_starts.dtype, P_starts.shape[1]
    blocks = triton.cdiv(width, plan.block_v)
    shapes = ((B, H, D, D), (B, H, D, width), (B, H, D, width))
    grad_out, *finals = grads
    finals = [torch.zeros(shape, dtype=dtype, device=q.device) if g is None
              else g.to(dtype).contiguous() for g, shape in zip(finals, shapes)]
    dq_parts = torch.empty(blocks, B, T, H, D, dtype=dtype, device=q.device)
    dk_parts = torch.empty_like(dq_parts)
    dv = torch.empty(B, T, H, Dv, dtype=dtype, device=q.device)
    dS_parts = torch.empty(blocks, B, H, D, D, dtype=dtype, device=q.device)
    dP0, dF0 = torch.empty_like(finals[1]), torch.empty_like(finals[2])
    hla3_backward_kernel[(blocks, B * H)](
        q, k, v, S_starts, P_starts, F_starts, grad_out.to(dtype).contiguous(), *finals,
        dq_parts, dk_parts, dv, dS_parts, dP0, dF0, B, T, H, D, Dv, width, NT,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        C=plan.chunk, BD=plan.block_d, BV=plan.block_v, NT_BOUND=triton.next_power_of_2(NT),
        NORMALIZE=normalize, PRECISION=precision(q.dtype), num_warps=plan.warps)
    return (dq_parts.sum(0).to(q.dtype), dk_parts.sum(0).to(k.dtype), dv.to(v.dtype),
            dS_parts.sum(0), dP0, dF0)
