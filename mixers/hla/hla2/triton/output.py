"""The masked form's last forward stage: the outputs of every chunk in parallel, from the
chunk's start states (S0, A0) the state scan wrote, and with normalize the division by the
same form on a ones value column (den, kept for the backward pass)."""

import torch
import triton
import triton.language as tl

from mixers.hla.hla2.triton.common import (_SHAPE_KEY, _autotuned, _block, _chunk_decay,
                                           _dim_ok, _load_tokens, _log2_decay, _mat_offsets,
                                           _size_class, _tile_ok)
from mixers.tiles import (bad_rows as _bad_rows, finite as _finite,
                              poison_from as _poison_from)

# Warp counts of the output kernel. The first, 8, is the launch shape before tuning; 4 lets
# two programs share an SM where registers and shared memory allow. 64-row programs (chunk
# 64, or half of a chunk of 128, with or without late state loads) are tuned; programs of
# other row counts keep 8 (4 warps spill there). 16 warps cap registers at 128 and spill, so
# they are not offered; num_stages stays at its default (1, 2 and 3 give the same code).
OUTPUT_WARPS = (8, 4)


@_autotuned(OUTPUT_WARPS, _SHAPE_KEY + ("BV", "BT", "SIZE_CLASS", "LATE_STATES"),
            first_only=lambda meta: meta["BT"] != 64)
@triton.jit(do_not_specialize=["SIZE_CLASS"])
def chunk_output_kernel(q, k, v, log2g, s_buf, a_buf, an_buf, o, den, eps, T, NT, SIZE_CLASS,
                        H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                        PD: tl.constexpr, PDV: tl.constexpr, C: tl.constexpr,
                        BT: tl.constexpr, BV: tl.constexpr, HAS_DECAY: tl.constexpr,
                        NORMALIZE: tl.constexpr, PREC: tl.constexpr,
                        LATE_STATES: tl.constexpr):
    """O = b^2 (Q A0) + (Dm * (b (Q S0 Q^T) + Wd W^T)) V for BT query rows of one chunk and
    a BV-wide slice of the values. BT = C, or C / 2: the chunk's second half of rows (R)
    then also mixes with its first half (P): with X = Q_R K_P^T (r < s for every pair),
        M_RR = Dm_RR * (b_R (Q S0)_R Q_R^T + Wd_RR W_RR^T + (Dm_RP * X) X^T)
        M_RP = Dm_RP * (b_R (Q S0)_R Q_P^T + (Dm_RP * X) W_PP^T),   Dm_RP = g^(BT + i - j),
    which skips the zero upper blocks of the C x C products (a fifth of the output's FLOPs
    at C = 128) and halves each program's registers. NORMALIZE divides by the same form
    on a ones column, den = b^2 (Q a0) + rowsum(M), plus eps, and stores den ([B, T, H]
    fp32, for the backward pass). LATE_STATES loads A0 for the last product, not the first
    (less shared memory at once). Head dims D, DV are held in blocks of PD, PDV (powers of
    two): loads past them read zero, stores there are masked. Grid (PDV // BV, NT * C // BT,
    B*H)."""
    i_v, i_ct, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_c, i_t = i_ct // (C // BT), i_ct % (C // BT)
    i_b, i_h = i_bh // H, i_bh % H
    lg = _log2_decay(log2g, i_h, HAS_DECAY)
    t = i_c * C + i_t * BT + tl.arange(0, BT)
    causal, b, _, dm, _ = _chunk_decay(0, BT, lg, BT)  # the rows' own block, as a full chunk
    b = b * tl.exp2((i_t * BT).to(tl.float32) * lg)
    rd, rv = tl.arange(0, PD), i_v * BV + tl.arange(0, BV)
    rv_ok = _dim_ok(rv, DV, PDV)
    a_ok = _tile_ok(rd, rv, D, PD, DV, PDV)
    base = (i_bh * NT + i_c).to(tl.int64)
    b_q = _load_tokens(q, i_b, i_h, t, T, H, D, PD)
    b_k = _load_tokens(k, i_b, i_h, t, T, H, D, PD)
    dt = b_q.dtype
    v_offs = ((i_b * T + t).to(tl.int64) * H + i_h)[:, None] * DV + rv[None, :]
    b_v = tl.load(v + v_offs, mask=(t < T)[:, None] & rv_ok[None, :], other=0.0)
    v_bad = _bad_rows(b_v)
    b_v = _finite(b_v)  # the masked M V would read a later row's NaN as 0 * NaN
    b_s = tl.load(s_buf + base * D * D + _mat_offsets(rd, rd, D),
                  mask=_tile_ok(rd, rd, D, PD, D, PD), other=0.0).to(dt)
    if LATE_STATES:  # A0 is loaded for the last product: less shared memory at once
        b_o = tl.zeros([BT, BV], dtype=tl.float32)
    else:
        b_a = tl.load(a_buf + base * D * DV + _mat_offsets(rd, rv, DV), mask=a_ok,
                      other=0.0).to(dt)
        b_o = tl.dot(b_q, b_a, input_precision=PREC) * (b * b)[:, None]
    b_qs = tl.dot((b_q * b[:, None]).to(dt), b_s, input_precision=PREC).to(dt)
    b_qk = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
    b_wf = tl.where(causal, b_qk, 0.0)  # masked by selection: a later NaN q or k reads 0
    b_w = b_wf.to(dt)
    b_m = tl.dot(b_qs, tl.trans(b_q), input_precision=PREC)
    b_m += tl.dot((b_wf * dm).to(dt), tl.trans(b_w), input_precision=PREC)
    if NORMALIZE:
        b_den = tl.zeros([BT], dtype=tl.float32)
    if BT < C:
        if i_t > 0:  # the first half's keys and values
            tp = t - BT
            b_qp = _load_tokens(q, i_b, i_h, tp, T, H, D, PD)
            b_kp = _load_tokens(k, i_b, i_h, tp, T, H, D, PD)
            b_vp = tl.load(v + v_offs - BT * H * DV, mask=(tp < T)[:, None] & rv_ok[None, :],
                           other=0.0)
            s = tl.arange(0, BT)
            dm_p = tl.exp2((BT + s[:, None] - s[None, :]).to(tl.float32) * lg)
            b_x = tl.dot(b_q, tl.trans(b_kp), input_precision=PREC)
            b_xd = (b_x * dm_p).to(dt)
            b_m += tl.dot(b_xd, tl.trans(b_x.to(dt)), input_precision=PREC)
            b_wp = tl.where(causal, tl.dot(b_qp, tl.trans(b_kp), input_precision=PREC),
                            0.0).to(dt)
            b_mp = tl.dot(b_qs, tl.trans(b_qp), input_precision=PREC)
            b_mp += tl.dot(b_xd, tl.trans(b_wp), input_precision=PREC)
            b_mp = (b_mp * dm_p).to(dt)
            b_o += tl.dot(b_mp, b_vp, input_precision=PREC)
            if NORMALIZE:
                b_den += tl.sum(b_mp.to(tl.float32), axis=1)
    b_m = tl.where(causal, b_m * dm, 0.0).to(dt)
    b_o += tl.dot(b_m, b_v, input_precision=PREC)
    if LATE_STATES:
        b_a = tl.load(a_buf + base * D * DV + _mat_offsets(rd, rv, DV), mask=a_ok,
                      other=0.0).to(dt)
        b_o += tl.dot(b_q, b_a, input_precision=PREC) * (b * b)[:, None]
    b_o += _poison_from(v_bad)[:, None]  # v was read as finite: its rows from the bad one on
    if NORMALIZE:  # the same form on a ones column, with a0
        b_an = tl.load(an_buf + base * D + rd, mask=_dim_ok(rd, D, PD), other=0.0)
        b_den += tl.sum(b_q.to(tl.float32) * b_an[None, :], axis=1) * (b * b)
        b_den += tl.sum(b_m.to(tl.float32), axis=1)
        b_o = b_o / (b_den + eps)[:, None]
        if i_v == 0:
            tl.store(den + ((i_b * T + t).to(tl.int64) * H + i_h), b_den, mask=t < T)
    tl.store(o + v_offs, b_o.to(o.dtype.element_ty), mask=(t < T)[:, None] & rv_ok[None, :])


def _chunk_output(q, k, v, lg, states, eps, T, NT, shape, plan):
    """(o, den) of every chunk from its start states = (S, A, An) (An: normalize's column of
    A, a stand-in without normalize); den [B, T, H] fp32 with normalize, else a stand-in."""
    B, _, H, _ = q.shape
    DV, C = v.shape[-1], plan.chunk
    ds, da, an = states
    o = torch.empty_like(v, dtype=q.dtype)
    den = q.new_empty(B, T, H, dtype=torch.float32) if shape["NORMALIZE"] else q
    BV, BT = plan.output_cols, plan.output_rows
    slices = _block(DV) // BV
    chunk_output_kernel[(slices, NT * C // BT, B * H)](
        q, k, v, lg, ds, da, an, o, den, eps, T, NT, _size_class(slices * NT * C // BT * B * H),
        BT=BT, BV=BV, LATE_STATES=plan.late_states, **shape)
    return o, den
