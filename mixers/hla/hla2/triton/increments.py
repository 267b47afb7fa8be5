"""The masked form's first forward stage: per-chunk increments dS = K^T E K, X = G Q^T E V
and dA = K^T E W^T E V (the chunk form in common.py), every chunk in parallel. They do not
depend on the carried state; the state scan (scans.py) turns them into it."""

import triton
import triton.language as tl

from mixers.hla.hla2.triton.common import (_SHAPE_KEY, _autotuned, _block, _chunk_buffers,
                                           _chunk_decay, _den_vectors, _dim_ok, _load_columns,
                                           _load_tokens, _log2_decay, _mat_offsets,
                                           _size_class, _tile_ok)
from mixers.tiles import finite as _finite

# Warp counts of the increments and gradient-terms kernels. The first, 8, is the launch shape
# before tuning; 4 lets two programs share an SM where registers and shared memory allow.
# 128-row blocks (D = 128 in one block) and chunks above 64 keep 8: 4 warps spill there, and
# the 4-warp build at D = 128, chunk 128 with normalize is known to give NaN outputs. Blocks
# of up to 64 rows at chunks up to 64 are tuned, and so are the increments in token halves
# (HALVES: 4 warps fit two programs per SM). 16 warps cap registers at 128 and are not
# offered; num_stages stays at its default (1, 2 and 3 give the same code: no loops).
INCREMENTS_WARPS = (8, 4)


def _increments_tuned(*extra_key):
    """The tuning shared by the increments and gradient-terms kernels (per-chunk row blocks
    of the same products): 8 warps only for 128-row blocks or chunks above 64, except where
    HALVES (a compile-time argument of the increments kernel, keyed in extra_key) is set."""
    return _autotuned(INCREMENTS_WARPS, _SHAPE_KEY + ("BR", "SIZE_CLASS", *extra_key),
                      first_only=lambda meta: not meta.get("HALVES", False)
                      and (meta["BR"] > 64 or meta["C"] > 64))


@triton.jit
def _increments_in_halves(q, k, v, log2g, ds_buf, x_buf, da_buf, xn_buf, an_buf, T, NT, i_c,
                          i_bh, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                          PD: tl.constexpr, PDV: tl.constexpr, C: tl.constexpr,
                          HAS_DECAY: tl.constexpr, NORMALIZE: tl.constexpr,
                          PREC: tl.constexpr):
    """chunk_increments_kernel's work for all D rows, with the chunk in two halves of
    tokens (1, 2): W's upper-right block is zero, so W^T E V = [W11^T (EV)1 + W21^T (EV)2;
    W22^T (EV)2] takes three of the four block products."""
    HC: tl.constexpr = C // 2
    i_b, i_h = i_bh // H, i_bh % H
    lg = _log2_decay(log2g, i_h, HAS_DECAY)
    n = tl.minimum(T - i_c * C, C)
    s1 = tl.arange(0, HC)
    s2 = s1 + HC
    e1 = tl.where(s1 < n, tl.exp2((n - 1 - s1).to(tl.float32) * lg), 0.0)
    e2 = tl.where(s2 < n, tl.exp2((n - 1 - s2).to(tl.float32) * lg), 0.0)
    gamma = tl.exp2(n.to(tl.float32) * lg)
    causal = s1[:, None] >= s1[None, :]
    t1 = i_c * C + s1
    t2 = t1 + HC
    b_q1 = _load_tokens(q, i_b, i_h, t1, T, H, D, PD)
    b_k1 = _load_tokens(k, i_b, i_h, t1, T, H, D, PD)
    b_v1 = _load_tokens(v, i_b, i_h, t1, T, H, DV, PDV)
    b_q2 = _load_tokens(q, i_b, i_h, t2, T, H, D, PD)
    b_k2 = _load_tokens(k, i_b, i_h, t2, T, H, D, PD)
    b_v2 = _load_tokens(v, i_b, i_h, t2, T, H, DV, PDV)
    dt = b_q1.dtype
    b_ke1, b_ke2 = (b_k1 * e1[:, None]).to(dt), (b_k2 * e2[:, None]).to(dt)
    b_ve1, b_ve2 = (b_v1 * e1[:, None]).to(dt), (b_v2 * e2[:, None]).to(dt)
    rd, rv = tl.arange(0, PD), tl.arange(0, PDV)
    base = (i_bh * NT + i_c).to(tl.int64)
    dd, dv = _mat_offsets(rd, rd, D), _mat_offsets(rd, rv, DV)
    dd_ok, dv_ok = _tile_ok(rd, rd, D, PD, D, PD), _tile_ok(rd, rv, D, PD, DV, PDV)

    b_ds = tl.dot(tl.trans(b_ke1), b_k1, input_precision=PREC)
    b_ds = tl.dot(tl.trans(b_ke2), b_k2, b_ds, input_precision=PREC)
    tl.store(ds_buf + base * D * D + dd, b_ds.to(ds_buf.dtype.element_ty), mask=dd_ok)
    b_x = tl.dot(tl.trans(b_q1), b_ve1, input_precision=PREC)
    b_x = gamma * tl.dot(tl.trans(b_q2), b_ve2, b_x, input_precision=PREC)
    tl.store(x_buf + base * D * DV + dv, _finite(b_x).to(x_buf.dtype.element_ty), mask=dv_ok)
    b_w11 = tl.where(causal, tl.dot(b_q1, tl.trans(b_k1), input_precision=PREC), 0.0).to(dt)
    b_w21 = tl.dot(b_q2, tl.trans(b_k1), input_precision=PREC).to(dt)
    b_w22 = tl.where(causal, tl.dot(b_q2, tl.trans(b_k2), input_precision=PREC), 0.0).to(dt)
    b_y1 = tl.dot(tl.trans(b_w11), b_ve1, input_precision=PREC)
    b_y1 = tl.dot(tl.trans(b_w21), b_ve2, b_y1, input_precision=PREC).to(dt)
    b_y2 = tl.dot(tl.trans(b_w22), b_ve2, input_precision=PREC).to(dt)
    b_da = tl.dot(tl.trans(b_ke1), b_y1, input_precision=PREC)
    b_da = tl.dot(tl.trans(b_ke2), b_y2, b_da, input_precision=PREC)
    tl.store(da_buf + base * D * DV + dv, b_da.to(da_buf.dtype.element_ty), mask=dv_ok)
    if NORMALIZE:  # V = 1 at real tokens, so E V = e
        b_xn = tl.sum(b_q1.to(tl.float32) * e1[:, None], axis=0)
        b_xn += tl.sum(b_q2.to(tl.float32) * e2[:, None], axis=0)
        tl.store(xn_buf + base * D + rd, _finite(gamma * b_xn), mask=_dim_ok(rd, D, PD))
        b_wte1 = tl.sum(b_w11.to(tl.float32) * e1[:, None], axis=0)
        b_wte1 += tl.sum(b_w21.to(tl.float32) * e2[:, None], axis=0)
        b_wte2 = tl.sum(b_w22.to(tl.float32) * e2[:, None], axis=0)
        b_an = tl.sum(b_ke1.to(tl.float32) * b_wte1[:, None], axis=0)
        b_an += tl.sum(b_ke2.to(tl.float32) * b_wte2[:, None], axis=0)
        tl.store(an_buf + base * D + rd, b_an, mask=_dim_ok(rd, D, PD))


@_increments_tuned("HALVES")
@triton.jit(do_not_specialize=["SIZE_CLASS"])
def chunk_increments_kernel(q, k, v, log2g, ds_buf, x_buf, da_buf, xn_buf, an_buf, T, NT,
                            SIZE_CLASS,
                            H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                            PD: tl.constexpr, PDV: tl.constexpr,
                            C: tl.constexpr, BR: tl.constexpr, HAS_DECAY: tl.constexpr,
                            NORMALIZE: tl.constexpr, PREC: tl.constexpr,
                            HALVES: tl.constexpr):
    """Per chunk: dS = K^T E K, X = G Q^T E V, dA = K^T E W^T E V, rows i_r BR .. + BR of
    each (a row block takes the matching columns of Q and K; every block recomputes
    W^T E V). NORMALIZE adds the denominator as a ones value column: its X and dA columns
    go to the [B*H, NT, D] vectors xn, an. HALVES (BR = D): the same in two halves of
    tokens (_increments_in_halves). Head dims D, DV are held in blocks of PD, PDV (powers
    of two, at least 16): loads past the true dim read zero, stores there are masked, so the
    padding adds zero rows and columns to every product. Grid (PD // BR, NT, B*H)."""
    i_r, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    if HALVES:
        _increments_in_halves(q, k, v, log2g, ds_buf, x_buf, da_buf, xn_buf, an_buf, T, NT,
                              i_c, i_bh, H, D, DV, PD, PDV, C, HAS_DECAY, NORMALIZE, PREC)
        return
    t = i_c * C + tl.arange(0, C)
    causal, b, e, dm, gamma = _chunk_decay(i_c, T, _log2_decay(log2g, i_h, HAS_DECAY), C)
    rr, rd, rv = i_r * BR + tl.arange(0, BR), tl.arange(0, PD), tl.arange(0, PDV)
    b_q = _load_tokens(q, i_b, i_h, t, T, H, D, PD)
    b_k = _load_tokens(k, i_b, i_h, t, T, H, D, PD)
    b_v = _load_tokens(v, i_b, i_h, t, T, H, DV, PDV)
    if BR == PD:
        b_qr, b_kr = b_q, b_k
    else:
        b_qr = _load_columns(q, i_b, i_h, t, T, rr, H, D, PD)
        b_kr = _load_columns(k, i_b, i_h, t, T, rr, H, D, PD)
    dt = b_q.dtype
    b_ke = (b_kr * e[:, None]).to(dt)
    b_ve = (b_v * e[:, None]).to(dt)
    base = (i_bh * NT + i_c).to(tl.int64)
    dd, dv = _mat_offsets(rr, rd, D), _mat_offsets(rr, rv, DV)
    dd_ok, dv_ok = _tile_ok(rr, rd, D, PD, D, PD), _tile_ok(rr, rv, D, PD, DV, PDV)

    b_ds = tl.dot(tl.trans(b_ke), b_k, input_precision=PREC)
    tl.store(ds_buf + base * D * D + dd, b_ds.to(ds_buf.dtype.element_ty), mask=dd_ok)
    b_x = gamma * tl.dot(tl.trans(b_qr), b_ve, input_precision=PREC)
    tl.store(x_buf + base * D * DV + dv, _finite(b_x).to(x_buf.dtype.element_ty), mask=dv_ok)
    b_w = tl.where(causal, tl.dot(b_q, tl.trans(b_k), input_precision=PREC), 0.0).to(dt)
    b_wtv = tl.dot(tl.trans(b_w), b_ve, input_precision=PREC).to(dt)
    b_da = tl.dot(tl.trans(b_ke), b_wtv, input_precision=PREC)
    tl.store(da_buf + base * D * DV + dv, b_da.to(da_buf.dtype.element_ty), mask=dv_ok)
    if NORMALIZE:  # V = 1 at real tokens, so E V = e
        b_xn = gamma * tl.sum(b_qr.to(tl.float32) * e[:, None], axis=0)
        tl.store(xn_buf + base * D + rr, _finite(b_xn), mask=_dim_ok(rr, D, PD))
        b_wte = tl.sum(b_w.to(tl.float32) * e[:, None], axis=0)
        tl.store(an_buf + base * D + rr,
                 tl.sum(b_ke.to(tl.float32) * b_wte[:, None], axis=0),
                 mask=_dim_ok(rr, D, PD))


def _chunk_increments(q, k, v, lg, T, NT, shape, plan):
    """The increments of every chunk as per-chunk buffers (dS, X, dA, Xn, An): Xn, An the
    normalize column's [B*H, NT, D] vectors (stand-ins without normalize). shape: the
    kernels' compile-time arguments (H, D, DV, C, HAS_DECAY, NORMALIZE, PREC)."""
    B, _, H, D = q.shape
    DV = v.shape[-1]
    ds, x, da = _chunk_buffers(B, H, NT, D, DV, q, 1, 2)
    xn, an = _den_vectors(q, NT, 2, shape["NORMALIZE"])
    rows, blocks = plan.increments_rows, _block(D) // plan.increments_rows
    chunk_increments_kernel[(blocks, NT, B * H)](
        q, k, v, lg, ds, x, da, xn, an, T, NT, _size_class(blocks * NT * B * H), BR=rows,
        HALVES=plan.increments_halves, **shape)
    return ds, x, da, xn, an
