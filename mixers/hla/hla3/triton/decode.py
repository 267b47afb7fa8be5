"""The causal hla3 decode step: S^K <- S^K + k k^T, P <- P + k v^T, F <- F + (S^K q)(q^T P),
o = q^T F, one program per (value block, batch x head) over packed states. New states go to
buffers of their own (the first value block's program writes S^K).

A program walks the key dim in blocks of rows, so no tile grows with the head dim: a first
pass updates its columns of P and forms q^T P and k . q; a second forms each row block of
S^K q = S^K_old q + k (k . q) over blocks of columns of S^K, then updates those rows of F and
adds them into the output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mixers.hla.hla3.triton.plan import HLA3Plan


@triton.jit
def key_rows(q_at, k_at, i, D, BR: tl.constexpr, acc: tl.constexpr):
    """Block i of BR key-dim rows: (their indices, which are < D, q and k there, zero past D)."""
    rows = i * BR + tl.arange(0, BR)
    row_ok = rows < D
    q = tl.load(q_at + rows, mask=row_ok, other=0.0).to(acc)
    k = tl.load(k_at + rows, mask=row_ok, other=0.0).to(acc)
    return rows, row_ok, q, k


@triton.jit
def hla3_step_kernel(Q, K, V, S0, P0, F0, O, S1, P1, F1, H, D, DV, DVP,
                     stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
                     BR: tl.constexpr, NR: tl.constexpr, BV: tl.constexpr,
                     NORMALIZE: tl.constexpr):
    acc: tl.constexpr = O.dtype.element_ty
    pid_v = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    q_at = Q + b * stride_qb + h * stride_qh
    k_at = K + b * stride_kb + h * stride_kh
    cols = pid_v * BV + tl.arange(0, BV)
    col_ok = cols < DVP
    v = tl.load(V + b * stride_vb + h * stride_vh + cols, mask=cols < DV, other=0.0).to(acc)
    if NORMALIZE:
        v = tl.where(cols == DV, 1.0, v).to(acc)
    states = bh.to(tl.int64) * D * DVP
    moments = bh.to(tl.int64) * D * D

    # pass 1: P <- P + k v^T on this program's columns; q^T P and k . q
    qP = tl.zeros([BV], dtype=acc)
    kq = tl.zeros([BR], dtype=acc)
    for i in range(NR):
        rows, row_ok, q, k = key_rows(q_at, k_at, i, D, BR, acc)
        at = states + rows[:, None] * DVP + cols[None, :]
        ok = row_ok[:, None] & col_ok[None, :]
        P = tl.load(P0 + at, mask=ok, other=0.0).to(acc) + k[:, None] * v[None, :]
        tl.store(P1 + at, P, mask=ok)
        qP += tl.sum(q[:, None] * P, 0)
        kq += q * k
    kq_sum = tl.sum(kq, 0)

    # pass 2: per block of rows, (S^K q) there, then F's rows and their share of the output
    out = tl.zeros([BV], dtype=acc)
    for i in range(NR):
        rows, row_ok, q, k = key_rows(q_at, k_at, i, D, BR, acc)
        Sq = k * kq_sum
        for j in range(NR):
            inner, inner_ok, q_inner, k_inner = key_rows(q_at, k_at, j, D, BR, acc)
            at = moments + rows[:, None] * D + inner[None, :]
            ok = row_ok[:, None] & inner_ok[None, :]
            S = tl.load(S0 + at, mask=ok, other=0.0).to(acc)
            Sq += tl.sum(S * q_inner[None, :], 1)
            tl.store(S1 + at, S + k[:, None] * k_inner[None, :], mask=ok & (pid_v == 0))
        at = states + rows[:, None] * DVP + cols[None, :]
        ok = row_ok[:, None] & col_ok[None, :]
        F = tl.load(F0 + at, mask=ok, other=0.0).to(acc) + Sq[:, None] * qP[None, :]
        tl.store(F1 + at, F, mask=ok)
        out += tl.sum(q[:, None] * F, 0)
    tl.store(O + bh * DVP + cols, out, mask=col_ok)


def step(q, k, v, S0, P0, F0, normalize: bool, plan: HLA3Plan):
    """One token: `[B, H, *]` q, k, v and packed states -> (packed output `[B, H, Dv(+1)]`,
    new S, P, F)."""
    B, H, D = q.shape
    Dv = v.shape[-1]
    width = Dv + normalize
    S0, P0, F0 = S0.contiguous(), P0.contiguous(), F0.contiguous()
    out = torch.empty(B, H, width, dtype=P0.dtype, device=q.device)
    S1, P1, F1 = torch.empty_like(S0), torch.empty_like(P0), torch.empty_like(F0)
    grid = (triton.cdiv(width, plan.block_v), B * H)
    hla3_step_kernel[grid](
        q, k, v, S0, P0, F0, out, S1, P1, F1, H, D, Dv, width,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        BR=plan.block_rows, NR=triton.cdiv(D, plan.block_rows), BV=plan.block_v,
        NORMALIZE=normalize, num_warps=plan.warps)
    return out, S1, P1, F1
