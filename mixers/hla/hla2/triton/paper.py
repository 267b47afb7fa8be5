"""decay_form="paper" (the paper's §4.3 recurrence): its own, simpler kernels and their launchers.

S_t = g S + k k^T, C_t = g C + q v^T, G_t = g G + k k^T C_{t-1}, o_t = q^T (S_t C_t - G_t).
Per chunk of n <= C real tokens with carried (S0, C0, G0), local positions s = 0..C-1,
b_s = g^(s+1), a_s = g^s, e_s = g^(n-1-s) [s < n], f_s = g^(n-2-s) [s < n-1],
Dm_rs = g^(r-s) [r >= s], Ds_rs = g^(r-1-s) [r > s], Gam = g^n, A = Q K^T, W = L * A,
Wd = Dm * A, Ks = (strict lower) * A^T (Ks_is = k_i . q_s, s < i):
    QS = b Q S0 + Wd K                                    (rows q_r^T S_r)
    Y  = b QS - a W K                                     (what multiplies C0)
    M  = Dm * (QS Q^T) - Ds * (W Ks)
    O  = Y C0 - b Q G0 + M V
    S1 = Gam S0 + K^T E K,  C1 = Gam C0 + Q^T E V
    G1 = Gam G0 + g^(n-1) K^T K C0 + K^T Ks F V           (E = diag(e), F = diag(f))
These need the full carried C0 at every chunk, so one program per (batch, head) and slice of
value columns (the plan's paper_cols) walks the chunks in order with the states in registers
(a sequential scan: simple and not tuned, so hla2's impl="auto" keeps the PyTorch chunk form
for it). Forward: 1 launch (grid Dv/paper_cols x B*H). Backward: 2, the walk again storing
each chunk's start states, then a reverse walk carrying the state gradients (dS, dC, dG) and
writing dq, dk, dv per chunk; the slices' dq, dk and dS0 parts are summed here. Normalize is
a ones column appended to v (padded to a power of two) and divided out here. The decode
step (paper_decode_step_kernel) is hla2_step_triton's for this form.
"""

import torch
import triton
import triton.language as tl

from mixers.common import Normalized
from mixers.hla.hla2.triton.common import (_block, _cdiv, _dim_ok, _load_tokens, _loop_bound,
                                           _mat_offsets, _overwrite_barrier, _state_tensor,
                                           _store_tokens, _tile_ok)
from mixers.tiles import (bad_rows as _bad_rows, finite as _finite,
                              poison_from as _poison_from, poison_rows as _poison_rows)


@triton.jit
def _paper_decay(i_c, T, lg, C: tl.constexpr):
    """Decay factors of chunk i_c (see above): n, b, a, e, f, Dm, Ds, Gam, g^(n-1), masks."""
    s = tl.arange(0, C)
    n = tl.maximum(tl.minimum(T - i_c * C, C), 0)
    causal = s[:, None] >= s[None, :]
    strict = s[:, None] > s[None, :]
    sf = s.to(tl.float32)
    b = tl.exp2((sf + 1.0) * lg)
    a = tl.exp2(sf * lg)
    e = tl.where(s < n, tl.exp2((n - 1 - s).to(tl.float32) * lg), 0.0)
    f = tl.where(s < n - 1, tl.exp2((n - 2 - s).to(tl.float32) * lg), 0.0)
    diff = (s[:, None] - s[None, :]).to(tl.float32)
    dm = tl.where(causal, tl.exp2(diff * lg), 0.0)
    ds = tl.where(strict, tl.exp2((diff - 1.0) * lg), 0.0)
    gam = tl.exp2(n.to(tl.float32) * lg)
    last = tl.exp2(tl.maximum(n - 1, 0).to(tl.float32) * lg)
    return causal, strict, b, a, e, f, dm, ds, gam, last


@triton.jit
def paper_forward_kernel(q, k, v, log2g, s_init, c_init, g_init, o, s_final, c_final, g_final,
                         s_buf, c_buf, g_buf, T, NT, H: tl.constexpr, D: tl.constexpr,
                         DV: tl.constexpr, PD: tl.constexpr, PDV: tl.constexpr,
                         BV: tl.constexpr, C: tl.constexpr,
                         NT_BOUND: tl.constexpr,
                         HAS_INIT: tl.constexpr, STORE_OUT: tl.constexpr,
                         STORE_FINAL: tl.constexpr, STORE_STATES: tl.constexpr,
                         PREC: tl.constexpr):
    """Sequential chunk scan of the paper form for one (batch, head) and a BV-wide slice of
    the value columns (C, G and O columns depend on their own value columns only; every
    slice recomputes S, slice 0 stores it): outputs into o (STORE_OUT), end states into
    s/c/g_final (STORE_FINAL), each chunk's start states into the [B*H, NT, ..] buffers
    s/c/g_buf (STORE_STATES, for backward). fp32 throughout. Chunks past NT (the loop runs
    to the power of two NT_BOUND) load zeros and keep the state. Head dims D, DV are held
    in blocks of PD, PDV (powers of two): entries past them load as zero and are not
    stored. Grid (PDV // BV, B*H)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    lg = tl.load(log2g + i_h)
    rd, rv = tl.arange(0, PD), i_v * BV + tl.arange(0, BV)
    dd, dv = _mat_offsets(rd, rd, D), _mat_offsets(rd, rv, DV)
    dd_ok, dv_ok = _tile_ok(rd, rd, D, PD, D, PD), _tile_ok(rd, rv, D, PD, DV, PDV)
    rv_ok = _dim_ok(rv, DV, PDV)
    head = i_bh.to(tl.int64)
    if HAS_INIT:
        b_s = tl.load(s_init + head * D * D + dd, mask=dd_ok, other=0.0)
        b_c = tl.load(c_init + head * D * DV + dv, mask=dv_ok, other=0.0)
        b_g = tl.load(g_init + head * D * DV + dv, mask=dv_ok, other=0.0)
    else:
        b_s = tl.zeros([PD, PD], dtype=tl.float32)
        b_c = tl.zeros([PD, BV], dtype=tl.float32)
        b_g = tl.zeros([PD, BV], dtype=tl.float32)
    seen = 0.0  # 1 once a token of this (batch, head) and slice had a non-finite input
    for i_c in range(NT_BOUND):
        t = i_c * C + tl.arange(0, C)
        causal, strict, b, a, e, f, dm, ds, gam, last = _paper_decay(i_c, T, lg, C)
        if STORE_STATES:
            base = (i_bh * NT + i_c).to(tl.int64)
            real = i_c < NT
            tl.store(s_buf + base * D * D + dd, b_s, mask=real & (i_v == 0) & dd_ok)
            tl.store(c_buf + base * D * DV + dv, b_c, mask=real & dv_ok)
            tl.store(g_buf + base * D * DV + dv, b_g, mask=real & dv_ok)
        b_q = _load_tokens(q, i_b, i_h, t, T, H, D, PD).to(tl.float32)
        b_k = _load_tokens(k, i_b, i_h, t, T, H, D, PD).to(tl.float32)
        v_offs = ((i_b * T + t).to(tl.int64) * H + i_h)[:, None] * DV + rv[None, :]
        tv_ok = (t < T)[:, None] & rv_ok[None, :]
        b_v = tl.load(v + v_offs, mask=tv_ok, other=0.0).to(tl.float32)
        # the walk runs on the finite part of its inputs and sets the outputs from the first
        # non-finite token on, and the final states after one, to NaN
        bad = tl.maximum(tl.maximum(_bad_rows(b_q), _bad_rows(b_k)), _bad_rows(b_v))
        b_q, b_k, b_v = _finite(b_q), _finite(b_k), _finite(b_v)
        b_qk = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
        b_w = tl.where(causal, b_qk, 0.0)
        b_ks = tl.where(strict, tl.trans(b_qk), 0.0)
        if STORE_OUT:
            b_qs = b[:, None] * tl.dot(b_q, b_s, input_precision=PREC)
            b_qs += tl.dot(b_qk * dm, b_k, input_precision=PREC)
            b_y = b[:, None] * b_qs - a[:, None] * tl.dot(b_w, b_k, input_precision=PREC)
            b_m = dm * tl.dot(b_qs, tl.trans(b_q), input_precision=PREC)
            b_m -= ds * tl.dot(b_w, b_ks, input_precision=PREC)
            b_o = tl.dot(b_y, b_c, input_precision=PREC)
            b_o -= b[:, None] * tl.dot(b_q, b_g, input_precision=PREC)
            b_o += tl.dot(b_m, b_v, input_precision=PREC) + _poison_from(bad + seen)[:, None]
            tl.store(o + v_offs, b_o.to(o.dtype.element_ty), mask=tv_ok)
        seen = tl.maximum(seen, tl.max(bad, axis=0))
        b_ktk = tl.dot(tl.trans(b_k), b_k, input_precision=PREC)
        b_g = gam * b_g + last * tl.dot(b_ktk, b_c, input_precision=PREC)
        b_g += tl.dot(tl.trans(b_k), tl.dot(b_ks, b_v * f[:, None], input_precision=PREC),
                      input_precision=PREC)
        b_c = gam * b_c + tl.dot(tl.trans(b_q * e[:, None]), b_v, input_precision=PREC)
        b_s = gam * b_s + tl.dot(tl.trans(b_k * e[:, None]), b_k, input_precision=PREC)
    if STORE_FINAL:
        poison = tl.where(seen > 0, float("nan"), 0.0)
        if i_v == 0:
            tl.store(s_final + head * D * D + dd, b_s + poison, mask=dd_ok)
        tl.store(c_final + head * D * DV + dv, b_c + poison, mask=dv_ok)
        tl.store(g_final + head * D * DV + dv, b_g + poison, mask=dv_ok)


@triton.jit
def paper_backward_kernel(q, k, v, do, log2g, s_buf, c_buf, g_buf, gs_final, gc_final,
                          gg_final, gs_init, gc_init, gg_init, dq, dk, dv, T, NT,
                          H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                          PD: tl.constexpr, PDV: tl.constexpr, BV: tl.constexpr,
                          C: tl.constexpr, NT_BOUND: tl.constexpr, HAS_FINAL_GRAD: tl.constexpr,
                          STORE_INIT_GRAD: tl.constexpr, PREC: tl.constexpr):
    """Reverse chunk walk of the paper form for one (batch, head), given each chunk's start
    states (S0, C0, G0) from paper_forward_kernel. Carries the gradients (dS, dC, dG) of
    the chunk's outgoing state; per chunk, with dM = dO V^T, dY = dO C0^T,
    dQS = (Dm * dM) Q, dU = -Ds * dM, dB = dY K^T (B = b Wd - a W):
        dQ = -b dO G0^T + (Dm * dM)^T QS + b^2 dY S0^T + b dQS S0^T + E V dC^T + dA K
        dK = B^T dY + Wd^T dQS + (Ks F V) dG^T + g^(n-1) K (C0 dG^T + dG C0^T)
             + E K (dS + dS^T) + dA^T Q
        dV = M^T dO + E Q dC + F Ks^T K dG
        dA = (strict * dKs)^T + L * dW + Dm * dWd,  dKs = W^T dU + K dG (F V)^T,
        dW = dU Ks^T - a dB,  dWd = b dB + dQS K^T
    and the incoming state gradients
        dS0 = Gam dS + Q^T (b^2 dY + b dQS),  dC0 = Gam dC + Y^T dO + g^(n-1) K^T K dG,
        dG0 = Gam dG - (b Q)^T dO.
    Every term is a sum over value columns, so a BV-wide slice of them runs on its own:
    dv, dC, dG of the slice are exact; dq, dk and the carried dS are the slice's parts,
    written to [DV // BV, ..] fp32 buffers (dq, dk: [.., B, T, H, D]; dS0: [.., B*H, D, D])
    that the caller sums (slice 0 starts from the final dS). Head dims padded to PD, PDV as
    in the forward. Grid (PDV // BV, B*H)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    lg = tl.load(log2g + i_h)
    rd, rv = tl.arange(0, PD), i_v * BV + tl.arange(0, BV)
    dd, dvo = _mat_offsets(rd, rd, D), _mat_offsets(rd, rv, DV)
    dd_ok, dv_ok = _tile_ok(rd, rd, D, PD, D, PD), _tile_ok(rd, rv, D, PD, DV, PDV)
    rv_ok = _dim_ok(rv, DV, PDV)
    head = i_bh.to(tl.int64)
    part = i_v.to(tl.int64) * tl.num_programs(1)
    dq += part * T * D  # this slice's [B, T, H, D] part (num_programs(1) = B * H)
    dk += part * T * D
    if HAS_FINAL_GRAD:
        b_gs = tl.load(gs_final + head * D * D + dd, mask=dd_ok, other=0.0) \
            * (i_v == 0).to(tl.float32)
        b_gc = tl.load(gc_final + head * D * DV + dvo, mask=dv_ok, other=0.0)
        b_gg = tl.load(gg_final + head * D * DV + dvo, mask=dv_ok, other=0.0)
    else:
        b_gs = tl.zeros([PD, PD], dtype=tl.float32)
        b_gc = tl.zeros([PD, BV], dtype=tl.float32)
        b_gg = tl.zeros([PD, BV], dtype=tl.float32)
    for j in range(NT_BOUND):
        i_c = NT_BOUND - 1 - j
        real = i_c < NT
        t = i_c * C + tl.arange(0, C)
        causal, strict, b, a, e, f, dm, ds, gam, last = _paper_decay(i_c, T, lg, C)
        base = (i_bh * NT + i_c).to(tl.int64)
        b_s0 = tl.load(s_buf + base * D * D + dd, mask=real & dd_ok, other=0.0)
        b_c0 = tl.load(c_buf + base * D * DV + dvo, mask=real & dv_ok, other=0.0)
        b_g0 = tl.load(g_buf + base * D * DV + dvo, mask=real & dv_ok, other=0.0)
        b_q = _load_tokens(q, i_b, i_h, t, T, H, D, PD).to(tl.float32)
        b_k = _load_tokens(k, i_b, i_h, t, T, H, D, PD).to(tl.float32)
        v_offs = ((i_b * T + t).to(tl.int64) * H + i_h)[:, None] * DV + rv[None, :]
        tv_ok = (t < T)[:, None] & rv_ok[None, :]
        b_v = tl.load(v + v_offs, mask=tv_ok, other=0.0).to(tl.float32)
        # as the forward: the finite part of the inputs (a row with a non-finite entry gets
        # NaN gradients)
        q_bad, k_bad, v_bad = _bad_rows(b_q), _bad_rows(b_k), _bad_rows(b_v)
        b_q, b_k, b_v = _finite(b_q), _finite(b_k), _finite(b_v)
        b_do = tl.load(do + v_offs, mask=tv_ok, other=0.0).to(tl.float32)
        b_qk = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
        b_w = tl.where(causal, b_qk, 0.0)
        b_wd = b_qk * dm
        b_ks = tl.where(strict, tl.trans(b_qk), 0.0)
        b_vf = b_v * f[:, None]
        b_qs = b[:, None] * tl.dot(b_q, b_s0, input_precision=PREC)
        b_qs += tl.dot(b_wd, b_k, input_precision=PREC)
        b_bm = b[:, None] * b_wd - a[:, None] * b_w
        b_y = b[:, None] * b_qs - a[:, None] * tl.dot(b_w, b_k, input_precision=PREC)
        b_m = dm * tl.dot(b_qs, tl.trans(b_q), input_precision=PREC)
        b_m -= ds * tl.dot(b_w, b_ks, input_precision=PREC)

        b_dm = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        b_dy = tl.dot(b_do, tl.trans(b_c0), input_precision=PREC)
        b_dn = dm * b_dm
        b_du = -ds * b_dm
        b_dqs = tl.dot(b_dn, b_q, input_precision=PREC)
        b_db = tl.dot(b_dy, tl.trans(b_k), input_precision=PREC)
        b_kdg = tl.dot(b_k, b_gg, input_precision=PREC)
        b_dks = tl.dot(tl.trans(b_w), b_du, input_precision=PREC)
        b_dks += tl.dot(b_kdg, tl.trans(b_vf), input_precision=PREC)
        b_dw = tl.dot(b_du, tl.trans(b_ks), input_precision=PREC) - a[:, None] * b_db
        b_dwd = b[:, None] * b_db + tl.dot(b_dqs, tl.trans(b_k), input_precision=PREC)
        b_da = tl.trans(tl.where(strict, b_dks, 0.0)) + tl.where(causal, b_dw, 0.0) + dm * b_dwd

        b_s0t = tl.trans(b_s0)
        b_dq = -b[:, None] * tl.dot(b_do, tl.trans(b_g0), input_precision=PREC)
        b_dq += tl.dot(tl.trans(b_dn), b_qs, input_precision=PREC)
        b_dq += tl.dot((b * b)[:, None] * b_dy + b[:, None] * b_dqs, b_s0t, input_precision=PREC)
        b_dq += e[:, None] * tl.dot(b_v, tl.trans(b_gc), input_precision=PREC)
        b_dq += tl.dot(b_da, b_k, input_precision=PREC)
        _store_tokens(dq, b_dq + _poison_rows(q_bad)[:, None], i_b, i_h, t, T, H, D, PD)

        b_dk = tl.dot(tl.trans(b_bm), b_dy, input_precision=PREC)
        b_dk += tl.dot(tl.trans(b_wd), b_dqs, input_precision=PREC)
        b_dk += tl.dot(tl.dot(b_ks, b_vf, input_precision=PREC), tl.trans(b_gg),
                       input_precision=PREC)
        b_cg = tl.dot(b_c0, tl.trans(b_gg), input_precision=PREC)
        b_dk += last * tl.dot(b_k, b_cg + tl.trans(b_cg), input_precision=PREC)
        b_dk += e[:, None] * tl.dot(b_k, b_gs + tl.trans(b_gs), input_precision=PREC)
        b_dk += tl.dot(tl.trans(b_da), b_q, input_precision=PREC)
        _store_tokens(dk, b_dk + _poison_rows(k_bad)[:, None], i_b, i_h, t, T, H, D, PD)

        b_dv = tl.dot(tl.trans(b_m), b_do, input_precision=PREC)
        b_dv += e[:, None] * tl.dot(b_q, b_gc, input_precision=PREC)
        b_dv += f[:, None] * tl.dot(tl.trans(b_ks), b_kdg, input_precision=PREC)
        b_dv += _poison_rows(v_bad)[:, None]
        tl.store(dv + v_offs, b_dv.to(dv.dtype.element_ty), mask=tv_ok)

        b_ktk = tl.dot(tl.trans(b_k), b_k, input_precision=PREC)
        b_gs = gam * b_gs + tl.dot(tl.trans(b_q), (b * b)[:, None] * b_dy + b[:, None] * b_dqs,
                                   input_precision=PREC)
        b_gc = gam * b_gc + tl.dot(tl.trans(b_y), b_do, input_precision=PREC)
        b_gc += last * tl.dot(b_ktk, b_gg, input_precision=PREC)
        b_gg = gam * b_gg - tl.dot(tl.trans(b_q * b[:, None]), b_do, input_precision=PREC)
    if STORE_INIT_GRAD:
        tl.store(gs_init + (part + head) * D * D + dd, b_gs, mask=dd_ok)
        tl.store(gc_init + head * D * DV + dvo, b_gc, mask=dv_ok)
        tl.store(gg_init + head * D * DV + dvo, b_gg, mask=dv_ok)


@triton.jit
def paper_decode_step_kernel(q, k, v, s, c, g_state, g, o, H: tl.constexpr, D: tl.constexpr,
                             DV: tl.constexpr, PD: tl.constexpr, PDV: tl.constexpr,
                             BR: tl.constexpr, SHARED_KV: tl.constexpr):
    """One token of the paper form for one (batch, head), state updated in place:
    G = g G + k (k^T C), S = g S + k k^T, C = g C + q v^T, o = (q^T S) C - q^T G.
    Two passes over blocks of BR state rows: k^T C (old C) and q^T S (new S), then the
    C and G rows and the output. With SHARED_KV, k, v and S have one head per batch and S
    arrives already updated. Head dims padded to PD, PDV as in the forward. Grid (B*H,)."""
    i_bh = tl.program_id(0)
    i_kv = i_bh
    if SHARED_KV:
        i_kv = i_bh // H
    rd, rv = tl.arange(0, PD), tl.arange(0, PDV)
    rd_ok, rv_ok = _dim_ok(rd, D, PD), _dim_ok(rv, DV, PDV)
    b_k = tl.load(k + i_kv * D + rd, mask=rd_ok, other=0.0).to(tl.float32)
    b_v = tl.load(v + i_kv * DV + rv, mask=rv_ok, other=0.0).to(tl.float32)
    gamma = tl.load(g + i_bh % H).to(tl.float32)
    b_kc = tl.zeros([PDV], dtype=tl.float32)
    b_qs = tl.zeros([PD], dtype=tl.float32)
    for i_r in tl.static_range(PD // BR):
        rr = i_r * BR + tl.arange(0, BR)
        rr_ok = _dim_ok(rr, D, PD)
        c_ok, s_ok = _tile_ok(rr, rv, D, PD, DV, PDV), _tile_ok(rr, rd, D, PD, D, PD)
        b_qr = tl.load(q + i_bh * D + rr, mask=rr_ok, other=0.0).to(tl.float32)
        b_kr = tl.load(k + i_kv * D + rr, mask=rr_ok, other=0.0).to(tl.float32)
        p_c = c + i_bh.to(tl.int64) * D * DV + _mat_offsets(rr, rv, DV)
        b_kc += tl.sum(tl.load(p_c, mask=c_ok, other=0.0) * b_kr[:, None], axis=0)
        p_s = s + i_kv.to(tl.int64) * D * D + _mat_offsets(rr, rd, D)
        b_s = tl.load(p_s, mask=s_ok, other=0.0)
        _overwrite_barrier()
        if not SHARED_KV:
            b_s = gamma * b_s + b_kr[:, None] * b_k[None, :]
            tl.store(p_s, b_s, mask=s_ok)
        b_qs += tl.sum(b_s * b_qr[:, None], axis=0)
    _overwrite_barrier()  # the pass above read every row of the old C
    b_num = tl.zeros([PDV], dtype=tl.float32)
    for i_r in tl.static_range(PD // BR):
        rr = i_r * BR + tl.arange(0, BR)
        rr_ok = _dim_ok(rr, D, PD)
        c_ok = _tile_ok(rr, rv, D, PD, DV, PDV)
        b_qr = tl.load(q + i_bh * D + rr, mask=rr_ok, other=0.0).to(tl.float32)
        b_kr = tl.load(k + i_kv * D + rr, mask=rr_ok, other=0.0).to(tl.float32)
        b_qsr = tl.sum(tl.where(rd[None, :] == rr[:, None], b_qs[None, :], 0.0), axis=1)
        offs = i_bh.to(tl.int64) * D * DV + _mat_offsets(rr, rv, DV)
        b_c = tl.load(c + offs, mask=c_ok, other=0.0)
        b_gr = tl.load(g_state + offs, mask=c_ok, other=0.0)
        _overwrite_barrier()
        b_c = gamma * b_c + b_qr[:, None] * b_v[None, :]
        tl.store(c + offs, b_c, mask=c_ok)
        b_gr = gamma * b_gr + b_kr[:, None] * b_kc[None, :]
        tl.store(g_state + offs, b_gr, mask=c_ok)
        b_num += tl.sum(b_c * b_qsr[:, None] - b_gr * b_qr[:, None], axis=0)
    tl.store(o + i_bh * DV + rv, b_num.to(o.dtype.element_ty), mask=rv_ok)


def _paper_forward(q, k, v, log2g, init, plan, want_final, want_out, want_states):
    """Run paper_forward_kernel: (o | None, (S1, C1, G1) | None, per-chunk start states |
    None)."""
    B, T, H, D = q.shape
    DV, C = v.shape[-1], plan.chunk
    NT = _cdiv(T, C)
    f32 = dict(dtype=torch.float32, device=q.device)
    o = torch.empty_like(v) if want_out else q
    final = states = None
    if want_final:
        final = (torch.empty(B, H, D, D, **f32), torch.empty(B, H, D, DV, **f32),
                 torch.empty(B, H, D, DV, **f32))
    if want_states:
        states = (torch.empty(B * H, NT, D, D, **f32), torch.empty(B * H, NT, D, DV, **f32),
                  torch.empty(B * H, NT, D, DV, **f32))
    BV = plan.paper_cols
    paper_forward_kernel[(_block(DV) // BV, B * H)](
        q, k, v, log2g, *(init or (q, q, q)), o, *(final or (q, q, q)), *(states or (q, q, q)),
        T, NT, H=H, D=D, DV=DV, PD=_block(D), PDV=_block(DV), BV=BV, C=C,
        NT_BOUND=_loop_bound(NT), HAS_INIT=init is not None,
        STORE_OUT=want_out, STORE_FINAL=want_final, STORE_STATES=want_states,
        PREC=plan.precision, num_warps=plan.warps)
    return (o if want_out else None), final, states


class _HLA2Paper(torch.autograd.Function):
    """(q, k, v, S0, C0, G0) -> (o, S1, C1, G1) for masked hla2 with the paper's decayed
    recurrence (log2 g per head, not differentiated). Forward: 1 launch; backward: 2 (the
    forward walk again storing each chunk's start states, then the reverse walk) plus the
    sums of the per-slice dq, dk (and dS0) parts."""

    @staticmethod
    def forward(ctx, q, k, v, s0, c0, g0, log2g, plan, want_final):
        init = None if s0 is None else (s0, c0, g0)
        o, final, _ = _paper_forward(q, k, v, log2g, init, plan, want_final, True, False)
        ctx.save_for_backward(q, k, v, s0, c0, g0, log2g)
        ctx.plan = plan
        return (o,) + (final or (None, None, None))

    @staticmethod
    def backward(ctx, do, gs1, gc1, gg1):
        q, k, v, s0, c0, g0, log2g = ctx.saved_tensors
        B, T, H, D = q.shape
        DV, C, plan = v.shape[-1], ctx.plan.chunk, ctx.plan
        init = None if s0 is None else (s0, c0, g0)
        _, _, states = _paper_forward(q, k, v, log2g, init, plan, False, False, True)
        final_grads = None
        if any(x is not None for x in (gs1, gc1, gg1)):
            shapes = [(B, H, D, D), (B, H, D, DV), (B, H, D, DV)]
            final_grads = tuple(q.new_zeros(shp, dtype=torch.float32) if x is None
                                else x.float().contiguous() for x, shp in zip((gs1, gc1, gg1),
                                                                               shapes))
        want_init_grad = s0 is not None and any(ctx.needs_input_grad[3:6])
        BV = plan.paper_cols
        n_slices = _block(DV) // BV  # value-column slices: dq, dk and dS0 come in parts
        init_grads = None
        if want_init_grad:
            init_grads = (s0.new_empty(n_slices, *s0.shape), torch.empty_like(c0),
                          torch.empty_like(g0))
        dq_parts, dk_parts = (q.new_empty(n_slices, *q.shape, dtype=torch.float32)
                              for _ in range(2))
        dv = torch.empty_like(v)
        paper_backward_kernel[(n_slices, B * H)](
            q, k, v, do.contiguous(), log2g, *states, *(final_grads or (q, q, q)),
            *(init_grads or (q, q, q)), dq_parts, dk_parts, dv, T, _cdiv(T, C), H=H,
            D=D, DV=DV, PD=_block(D), PDV=_block(DV), BV=BV, C=C, NT_BOUND=_loop_bound(_cdiv(T, C)),
            HAS_FINAL_GRAD=final_grads is not None, STORE_INIT_GRAD=want_init_grad,
            PREC=plan.precision, num_warps=plan.warps)
        dq, dk = dq_parts.sum(0).to(q.dtype), dk_parts.sum(0).to(k.dtype)
        if init_grads is not None:
            init_grads = (init_grads[0].sum(0),) + init_grads[1:]
        return (dq, dk, dv) + (init_grads or (None, None, None)) + (None, None, None)


def _paper_values(v, normalize, width):
    """v, or with normalize [v, 1, 0..] padded to the power-of-two width (the kernels'
    ones column: the denominator comes out of the numerator's matmuls)."""
    if not normalize:
        return v
    pad = v.new_zeros(*v.shape[:-1], width - v.shape[-1] - 1)
    return torch.cat([v, torch.ones_like(v[..., :1]), pad], -1).contiguous()


def _paper_state(state, key, twin, normalize, width):
    """A [B, H, D, Dv] value state (with its [B, H, D] twin and zero padding under
    normalize) as the kernels' fp32 [B, H, D, width] tensor."""
    x = state[key].float()
    if not normalize:
        return x.contiguous()
    pad = x.new_zeros(*x.shape[:-1], width - x.shape[-1] - 1)
    return torch.cat([x, state[twin].float().unsqueeze(-1), pad], -1).contiguous()


def _hla2_paper(q, k, v, *, normalize, eps, decay, initial_state, output_final_state, plan):
    """hla2_triton for decay_form="paper" (q, k, v contiguous with H heads each)."""
    B, T, H, D = q.shape
    DV = v.shape[-1]
    width = _block(DV + 1) if normalize else DV
    v_in = _paper_values(v, normalize, width)
    s0 = c0 = g0 = None
    if initial_state is not None:
        s0 = initial_state["S"].float().expand(B, H, D, D).contiguous()
        c0 = _paper_state(initial_state, "C", "m", normalize, width)
        g0 = _paper_state(initial_state, "G", "h", normalize, width)
    log2g = torch.log2(decay.float()).contiguous()
    o, s1, c1, g1 = _HLA2Paper.apply(q, k, v_in, s0, c0, g0, log2g, plan, output_final_state)
    if normalize:
        o = Normalized.apply(o[..., :DV].float(), o[..., DV].float(), eps).to(q.dtype)
    if not output_final_state:
        return o, None
    final = {"S": s1, "C": c1[..., :DV].contiguous(), "G": g1[..., :DV].contiguous()}
    if normalize:
        final.update(m=c1[..., DV].contiguous(), h=g1[..., DV].contiguous())
    return o, final


def _paper_step(q_t, k_t, v_t, state, *, normalize, eps, decay):
    """hla2_step_triton for decay_form="paper". S is updated in place; C and G (with
    normalize packed with m and h into one padded tensor for the kernel, then split back)
    are replaced by their new values in the state dict."""
    B, H, D = q_t.shape
    DV = v_t.shape[-1]
    width = _block(DV + 1) if normalize else DV
    if state is None:
        state = {"S": q_t.new_zeros(B, k_t.shape[1], D, D, dtype=torch.float32)}
        for key, twin in (("C", "m"), ("G", "h")):
            state[key] = q_t.new_zeros(B, H, D, DV, dtype=torch.float32)
            if normalize:
                state[twin] = q_t.new_zeros(B, H, D, dtype=torch.float32)
    s = _state_tensor(state, "S")
    c = _paper_state(state, "C", "m", normalize, width)
    g_state = _paper_state(state, "G", "h", normalize, width)
    shared_kv = k_t.shape[1] == 1 and H > 1
    if shared_kv:  # one S for all heads: update it once here (decay is equal across heads)
        s.mul_(decay[0])
        s.add_(k_t.float().unsqueeze(-1) * k_t.float().unsqueeze(-2))
    o = q_t.new_empty(B, H, width, dtype=torch.float32)
    paper_decode_step_kernel[(B * H,)](
        q_t.contiguous(), k_t.contiguous(), _paper_values(v_t, normalize, width).contiguous(), s, c,
        g_state, decay.float().contiguous(), o, H=H, D=D, DV=width, PD=_block(D),
        PDV=_block(width), BR=16,
        SHARED_KV=shared_kv, num_warps=4)
    state["C"], state["G"] = c[..., :DV].contiguous(), g_state[..., :DV].contiguous()
    if normalize:
        state["m"], state["h"] = c[..., DV].contiguous(), g_state[..., DV].contiguous()
        return (o[..., :DV] / (o[..., DV:DV + 1] + eps)).to(q_t.dtype), state
    return o.to(q_t.dtype), state
