"""The masked form's backward pass: per chunk the gradient terms Q^T b^2 dO and Q^T P Q
(chunk_grad_terms_kernel, in parallel), the reverse scan of the state gradients
(scans.py), then dq, dk and dv per chunk (chunk_grads_kernel, in parallel, one launch or
several: the plan's grad_launches). It reads each chunk's start states and X, which the
forward keeps for it (recomputing them would take another increments launch and state
scan)."""

import torch
import triton
import triton.language as tl

from mixers.hla.hla2.triton.common import (_SHAPE_KEY, _autotuned, _cdiv, _chunk_buffers,
                                           _chunk_decay, _den_vectors, _dim_ok, _load_columns,
                                           _load_den, _load_tokens, _log2_decay, _mat_offsets,
                                           _shape_args, _size_class, _store_tokens, _tile_ok)
from mixers.tiles import (bad_rows as _bad_rows, finite as _finite,
                              poison_rows as _poison_rows)
from mixers.hla.hla2.triton.increments import _increments_tuned
from mixers.hla.hla2.triton.scans import _scan_grads

# Warp counts of the dq/dk/dv kernel. The first, 8, is the launch shape before tuning. Tuned
# at chunk 64 (4 warps spill more than 8 but fit two programs per SM: the GPU decides);
# other chunk sizes keep 8. 16 warps cap registers at 128 and spill, so they are not
# offered; num_stages stays at its default (1, 2 and 3 give the same code). The
# gradient-terms kernel is tuned as the increments kernel is (increments.py).
GRADS_WARPS = (8, 4)


@_increments_tuned()
@triton.jit(do_not_specialize=["SIZE_CLASS"])
def chunk_grad_terms_kernel(q, v, do, dden, log2g, qdo_buf, z_buf, qn_buf, T, NT, SIZE_CLASS,
                            H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                            PD: tl.constexpr, PDV: tl.constexpr,
                            C: tl.constexpr, BR: tl.constexpr, HAS_DECAY: tl.constexpr,
                            NORMALIZE: tl.constexpr, PREC: tl.constexpr):
    """Per chunk, the increments of the reverse state-gradient scan: Q^T b^2 dO and
    Z = Q^T (b * P) Q, P = Dm * (dO V^T), rows i_r BR .. + BR of each (every row block
    recomputes (b * P) Q). NORMALIZE adds the ones value column with output gradient dden:
    its Q^T b^2 dden column goes to the [B*H, NT, D] vector qn (an fp32 sum), and P gains
    Dm * (dden 1^T). Head dims padded to PD, PDV as in the increments. Grid (PD // BR, NT,
    B*H)."""
    i_r, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    t = i_c * C + tl.arange(0, C)
    causal, b, e, dm, gamma = _chunk_decay(i_c, T, _log2_decay(log2g, i_h, HAS_DECAY), C)
    rr, rd, rv = i_r * BR + tl.arange(0, BR), tl.arange(0, PD), tl.arange(0, PDV)
    b_q = _finite(_load_tokens(q, i_b, i_h, t, T, H, D, PD))
    if BR == PD:
        b_qr = b_q
    else:
        b_qr = _finite(_load_columns(q, i_b, i_h, t, T, rr, H, D, PD))
    b_v = _finite(_load_tokens(v, i_b, i_h, t, T, H, DV, PDV))
    b_do = _load_tokens(do, i_b, i_h, t, T, H, DV, PDV)
    dt = b_q.dtype
    base = (i_bh * NT + i_c).to(tl.int64)
    dd, dv = _mat_offsets(rr, rd, D), _mat_offsets(rr, rv, DV)

    b_qb2 = (b_qr * (b * b)[:, None]).to(dt)
    b_qdo = tl.dot(tl.trans(b_qb2), b_do, input_precision=PREC)
    tl.store(qdo_buf + base * D * DV + dv, b_qdo.to(qdo_buf.dtype.element_ty),
             mask=_tile_ok(rr, rv, D, PD, DV, PDV))
    b_pv = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
    if NORMALIZE:
        b_dden = _load_den(dden, i_b, i_h, t, T, H)
        b_pv += b_dden[:, None]
        tl.store(qn_buf + base * D + rr,
                 tl.sum(b_qb2.to(tl.float32) * b_dden[:, None], axis=0),
                 mask=_dim_ok(rr, D, PD))
    b_pb = b_pv * dm * b[:, None]
    b_pq = tl.dot(b_pb.to(dt), b_q, input_precision=PREC).to(dt)
    b_z = tl.dot(tl.trans(b_qr), b_pq, input_precision=PREC)
    tl.store(z_buf + base * D * D + dd, b_z.to(z_buf.dtype.element_ty),
             mask=_tile_ok(rr, rd, D, PD, D, PD))


@_autotuned(GRADS_WARPS, _SHAPE_KEY + ("WANT_Q", "WANT_K", "WANT_V", "SIZE_CLASS"),
            first_only=lambda meta: meta["C"] != 64)
@triton.jit(do_not_specialize=["SIZE_CLASS"])
def chunk_grads_kernel(q, k, v, do, dden, log2g, s_buf, a_buf, gs_buf, ga_buf, an_buf,
                       gan_buf, dq, dk, dv, T, NT, SIZE_CLASS, H: tl.constexpr, D: tl.constexpr,
                       DV: tl.constexpr, PD: tl.constexpr, PDV: tl.constexpr,
                       C: tl.constexpr, HAS_DECAY: tl.constexpr,
                       NORMALIZE: tl.constexpr, PREC: tl.constexpr, WANT_Q: tl.constexpr,
                       WANT_K: tl.constexpr, WANT_V: tl.constexpr):
    """Local gradients of one chunk given its carried state (S0, A0) and the gradients
    (gS, gA) w.r.t. its outgoing state. With P = Dm * (dO V^T), Pb = b * P,
    M = Dm * (b Q S0 Q^T + Wd W^T), and Gr the gradient w.r.t. Q K^T:
        Gr = Dm * (P W) + L * (P^T Wd + E V gA^T K^T E)
        dV = M^T dO + G E Q S0 gA + E W E K gA
        dQ = b^2 dO A0^T + ((Pb + Pb^T) Q + G E V gA^T) S0 + Gr K
        dK = Gr^T Q + E W^T E V gA^T + E K (gS + gS^T)
    (S0 symmetric, as every state built from k k^T is). WANT_Q / WANT_K / WANT_V select dq,
    dk and dv, so large head dims can split the work over launches (register pressure).
    NORMALIZE adds the ones value column to dq and dk (output gradient dden, states a0 and
    gan from the [B*H, NT, D] vectors an_buf, gan_buf). Grid (NT, B*H)."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t = i_c * C + tl.arange(0, C)
    causal, b, e, dm, gamma = _chunk_decay(i_c, T, _log2_decay(log2g, i_h, HAS_DECAY), C)
    rd, rv = tl.arange(0, PD), tl.arange(0, PDV)
    dd, dvo = _mat_offsets(rd, rd, D), _mat_offsets(rd, rv, DV)
    dd_ok, dv_ok, rd_ok = _tile_ok(rd, rd, D, PD, D, PD), _tile_ok(rd, rv, D, PD, DV, PDV), \
        _dim_ok(rd, D, PD)
    base = (i_bh * NT + i_c).to(tl.int64)
    b_q = _load_tokens(q, i_b, i_h, t, T, H, D, PD)
    b_k = _load_tokens(k, i_b, i_h, t, T, H, D, PD)
    b_v = _load_tokens(v, i_b, i_h, t, T, H, DV, PDV)
    # the gradients of a row with a non-finite entry are NaN; the rows are read as finite
    q_bad, k_bad, v_bad = _bad_rows(b_q), _bad_rows(b_k), _bad_rows(b_v)
    b_q, b_k, b_v = _finite(b_q), _finite(b_k), _finite(b_v)
    b_do = _load_tokens(do, i_b, i_h, t, T, H, DV, PDV)
    dt = b_q.dtype
    b_ve = (b_v * e[:, None]).to(dt)
    b_qk = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
    b_w = tl.where(causal, b_qk, 0.0).to(dt)
    b_wd = (b_qk * dm).to(dt)
    b_ga = tl.load(ga_buf + base * D * DV + dvo, mask=dv_ok, other=0.0).to(dt)
    b_kga = tl.dot((b_k * e[:, None]).to(dt), b_ga, input_precision=PREC).to(dt)
    if WANT_Q or WANT_K:
        b_p = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        if NORMALIZE:  # small vectors are reloaded where used (fewer live registers)
            b_p += _load_den(dden, i_b, i_h, t, T, H)[:, None]
        b_p = b_p * dm
        b_gr = tl.dot(b_p.to(dt), b_w, input_precision=PREC) * dm
        b_vkga = tl.dot(b_ve, tl.trans(b_kga), input_precision=PREC)
        if NORMALIZE:
            b_gan = tl.load(gan_buf + base * D + rd, mask=rd_ok, other=0.0)
            b_kgan = e * tl.sum(b_k.to(tl.float32) * b_gan[None, :], axis=1)
            b_vkga += e[:, None] * b_kgan[None, :]
        b_gr += tl.where(causal, tl.dot(tl.trans(b_p.to(dt)), b_wd, input_precision=PREC)
                         + b_vkga, 0.0)
        b_gr = b_gr.to(dt)
    if WANT_K:
        b_gs = tl.load(gs_buf + base * D * D + dd, mask=dd_ok, other=0.0).to(tl.float32)
        b_gs = (b_gs + tl.trans(b_gs)).to(dt)
        b_wtv = tl.dot(tl.trans(b_w), b_ve, input_precision=PREC).to(dt)
        b_dk = tl.dot(tl.trans(b_gr), b_q, input_precision=PREC)
        b_kgs = tl.dot(b_wtv, tl.trans(b_ga), input_precision=PREC)
        b_kgs += tl.dot(b_k, b_gs, input_precision=PREC)
        if NORMALIZE:
            b_wte = tl.sum(b_w.to(tl.float32) * e[:, None], axis=0)
            b_kgs += b_wte[:, None] * tl.load(gan_buf + base * D + rd, mask=rd_ok,
                                              other=0.0)[None, :]
        b_dk += b_kgs * e[:, None]
        _store_tokens(dk, b_dk + _poison_rows(k_bad)[:, None], i_b, i_h, t, T, H, D, PD)
    if WANT_Q:
        b_pb = b_p * b[:, None]
        b_r = tl.dot((b_pb + tl.trans(b_pb)).to(dt), b_q, input_precision=PREC)
        b_r += gamma * tl.dot(b_ve, tl.trans(b_ga), input_precision=PREC)
        b_s = tl.load(s_buf + base * D * D + dd, mask=dd_ok, other=0.0).to(dt)
        b_a = tl.load(a_buf + base * D * DV + dvo, mask=dv_ok, other=0.0).to(dt)
        b_doa = tl.dot(b_do, tl.trans(b_a), input_precision=PREC)
        if NORMALIZE:
            b_r += (gamma * e)[:, None] * tl.load(gan_buf + base * D + rd, mask=rd_ok,
                                                  other=0.0)[None, :]
            b_an = tl.load(an_buf + base * D + rd, mask=rd_ok, other=0.0)
            b_doa += _load_den(dden, i_b, i_h, t, T, H)[:, None] * b_an[None, :]
        b_dq = b_doa * (b * b)[:, None]
        b_dq += tl.dot(b_r.to(dt), b_s, input_precision=PREC)
        b_dq += tl.dot(b_gr, b_k, input_precision=PREC)
        _store_tokens(dq, b_dq + _poison_rows(q_bad)[:, None], i_b, i_h, t, T, H, D, PD)
    if WANT_V:
        b_s = tl.load(s_buf + base * D * D + dd, mask=dd_ok, other=0.0).to(dt)
        b_qs = tl.dot(b_q, b_s, input_precision=PREC)
        b_m = tl.dot((b_qs * b[:, None]).to(dt), tl.trans(b_q), input_precision=PREC)
        b_m += tl.dot(b_wd, tl.trans(b_w), input_precision=PREC)
        b_m = (b_m * dm).to(dt)
        b_dv = tl.dot(tl.trans(b_m), b_do, input_precision=PREC)
        b_dv += tl.dot((b_qs * (gamma * e)[:, None]).to(dt), b_ga, input_precision=PREC)
        b_dv += tl.dot(b_w, b_kga, input_precision=PREC) * e[:, None]
        _store_tokens(dv, b_dv + _poison_rows(v_bad)[:, None], i_b, i_h, t, T, H, DV, PDV)


def _masked_backward(q, k, v, log2g, states, do, dden, final_grads, plan, want_init_grad):
    """dq, dk, dv (and the initial-state gradients) from the forward's chunk states
    (S, X, A, Xn, An); dden: normalize's denominator gradient [B, T, H], else None."""
    B, T, H, D = q.shape
    DV = v.shape[-1]
    NT = _cdiv(T, plan.chunk)
    normalize = dden is not None
    shape = _shape_args(q, v, log2g, normalize, plan)
    lg = q if log2g is None else log2g
    dden = q if dden is None else dden
    s, x, a, xn, an = states
    z, qdo = _chunk_buffers(B, H, NT, D, DV, q, 1, 1)
    qn, = _den_vectors(q, NT, 1, normalize)
    rows = plan.grad_terms_rows
    blocks = shape["PD"] // rows
    chunk_grad_terms_kernel[(blocks, NT, B * H)](
        q, v, do, dden, lg, qdo, z, qn, T, NT, _size_class(blocks * NT * B * H), BR=rows,
        **shape)
    init_grads = None
    if want_init_grad:
        init_grads = (q.new_empty(B, H, D, D, dtype=torch.float32),
                      q.new_empty(B, H, D, DV, dtype=torch.float32),
                      q.new_empty(B, H, D, dtype=torch.float32) if normalize else q)
    ga, gan = _scan_grads((qdo, z, x, qn, xn), lg, final_grads, init_grads, T, shape, plan)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for part in plan.grad_launches:
        chunk_grads_kernel[(NT, B * H)](
            q, k, v, do, dden, lg, s, a, z, ga, an, gan, dq, dk, dv, T, NT,
            _size_class(NT * B * H), WANT_Q="q" in part, WANT_K="k" in part,
            WANT_V="v" in part, **shape)
    return dq, dk, dv, init_grads


def _final_grads(q, D, DV, normalize, grads):
    """fp32 contiguous final-state gradients (zeros for the missing ones), or None when
    no final-state output has a gradient."""
    if all(g is None for g in grads):
        return None
    B, _, H, _ = q.shape
    shapes = [(B, H, D, D), (B, H, D, DV), (B, H, D)]
    out = tuple(torch.zeros(shp, dtype=torch.float32, device=q.device) if g is None
                else g.float().contiguous() for g, shp in zip(grads, shapes))
    return out if normalize else out[:2] + (q,)
