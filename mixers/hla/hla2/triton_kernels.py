"""Triton kernels for masked second-order HLA (spec §4), no decay.

Per chunk of C tokens with carried state (S0, A0), local Q, K, V and L = tril(ones):
    W  = L * (Q K^T)
    O  = Q A0 + (L * (Q S0 Q^T + W W^T)) V
    S1 = S0 + K^T K
    A1 = A0 + S0 (Q^T V) + K^T (W^T V)
The per-chunk increments dS = K^T K, X = Q^T V, dA = K^T W^T V do not depend on the carried
state, so they are computed for all chunks in parallel; a scan over chunks then turns them
into the carried states (A needs one small matmul S0 X per chunk), and the output kernel is
parallel again. The backward pass mirrors this with a reverse scan of the state gradients.

Layouts: q, k [B, T, H, D] and v, o [B, T, H, DV], contiguous. Per-chunk buffers are fp32
[B*H, NT, D, D] or [B*H, NT, D, DV]; the scans overwrite the increments with the states.
The scans take the chunk count NT as a compile-time constant (one compile per chunk count):
the Triton interpreter cannot loop over a runtime bound with numpy 2.
"""

import triton
import triton.language as tl


@triton.jit
def _load_tokens(ptr, i_b, i_h, t, T, H: tl.constexpr, W: tl.constexpr):
    """[len(t), W] rows of a [B, T, H, W] tensor; rows past T read as zero."""
    cols = tl.arange(0, W)
    offs = ((i_b * T + t).to(tl.int64) * H + i_h)[:, None] * W + cols[None, :]
    return tl.load(ptr + offs, mask=(t < T)[:, None], other=0.0)


@triton.jit
def _store_tokens(ptr, val, i_b, i_h, t, T, H: tl.constexpr, W: tl.constexpr):
    cols = tl.arange(0, W)
    offs = ((i_b * T + t).to(tl.int64) * H + i_h)[:, None] * W + cols[None, :]
    tl.store(ptr + offs, val.to(ptr.dtype.element_ty), mask=(t < T)[:, None])


@triton.jit
def _mat_offsets(rows, cols, NCOL: tl.constexpr):
    return rows[:, None] * NCOL + cols[None, :]


@triton.jit
def chunk_increments_kernel(q, k, v, do, ds_buf, x_buf, da_buf, qdo_buf, z_buf, T, NT,
                            H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                            WITH_GRAD: tl.constexpr, PREC: tl.constexpr):
    """Per chunk: dS = K^T K, X = Q^T V, dA = K^T (W^T V); with WITH_GRAD also
    Q^T dO and Z = Q^T P Q, P = L * (dO V^T). Grid (NT, B*H)."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t = i_c * C + tl.arange(0, C)
    causal = tl.arange(0, C)[:, None] >= tl.arange(0, C)[None, :]
    b_q = _load_tokens(q, i_b, i_h, t, T, H, D)
    b_k = _load_tokens(k, i_b, i_h, t, T, H, D)
    b_v = _load_tokens(v, i_b, i_h, t, T, H, DV)
    dt = b_q.dtype
    base = (i_bh * NT + i_c).to(tl.int64)
    rd, rv = tl.arange(0, D), tl.arange(0, DV)
    dd, dv = _mat_offsets(rd, rd, D), _mat_offsets(rd, rv, DV)

    tl.store(ds_buf + base * D * D + dd, tl.dot(tl.trans(b_k), b_k, input_precision=PREC))
    tl.store(x_buf + base * D * DV + dv, tl.dot(tl.trans(b_q), b_v, input_precision=PREC))
    b_w = tl.where(causal, tl.dot(b_q, tl.trans(b_k), input_precision=PREC), 0.0).to(dt)
    b_wtv = tl.dot(tl.trans(b_w), b_v, input_precision=PREC).to(dt)
    tl.store(da_buf + base * D * DV + dv, tl.dot(tl.trans(b_k), b_wtv, input_precision=PREC))
    if WITH_GRAD:
        b_do = _load_tokens(do, i_b, i_h, t, T, H, DV)
        tl.store(qdo_buf + base * D * DV + dv, tl.dot(tl.trans(b_q), b_do, input_precision=PREC))
        b_p = tl.where(causal, tl.dot(b_do, tl.trans(b_v), input_precision=PREC), 0.0).to(dt)
        b_pq = tl.dot(b_p, b_q, input_precision=PREC).to(dt)
        tl.store(z_buf + base * D * D + dd, tl.dot(tl.trans(b_q), b_pq, input_precision=PREC))


@triton.jit
def state_scan_kernel(ds_buf, x_buf, da_buf, s_init, a_init, s_final, a_final, NT: tl.constexpr,
                      D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr,
                      HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr, PREC: tl.constexpr):
    """Exclusive scan over chunks: S_c = S_{c-1} + dS, A_c = A_{c-1} + S_{c-1} X + dA,
    written over the increments in place. Grid (D // BD, B*H): a block of BD state rows."""
    i_r, i_bh = tl.program_id(0), tl.program_id(1)
    rr, rd, rv = i_r * BD + tl.arange(0, BD), tl.arange(0, D), tl.arange(0, DV)
    sd, sv = _mat_offsets(rr, rd, D), _mat_offsets(rr, rv, DV)
    xv = _mat_offsets(rd, rv, DV)
    if HAS_INIT:
        b_s = tl.load(s_init + i_bh.to(tl.int64) * D * D + sd)
        b_a = tl.load(a_init + i_bh.to(tl.int64) * D * DV + sv)
    else:
        b_s = tl.zeros([BD, D], dtype=tl.float32)
        b_a = tl.zeros([BD, DV], dtype=tl.float32)
    for i_c in range(NT):
        base = (i_bh * NT + i_c).to(tl.int64)
        p_s, p_a = ds_buf + base * D * D + sd, da_buf + base * D * DV + sv
        b_ds, b_da = tl.load(p_s), tl.load(p_a)
        b_x = tl.load(x_buf + base * D * DV + xv)
        tl.store(p_s, b_s)
        tl.store(p_a, b_a)
        b_a += tl.dot(b_s, b_x, input_precision=PREC) + b_da
        b_s += b_ds
    if STORE_FINAL:
        tl.store(s_final + i_bh.to(tl.int64) * D * D + sd, b_s)
        tl.store(a_final + i_bh.to(tl.int64) * D * DV + sv, b_a)


@triton.jit
def grad_scan_kernel(qdo_buf, z_buf, x_buf, gs_final, ga_final, gs_init, ga_init, NT: tl.constexpr,
                     D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr,
                     HAS_FINAL_GRAD: tl.constexpr, STORE_INIT_GRAD: tl.constexpr,
                     PREC: tl.constexpr):
    """Reverse scan of the state gradients. With gA, gS the gradients w.r.t. a chunk's
    outgoing state: incoming gA = gA + Q^T dO, incoming gS = gS + Z + gA X^T. Each chunk's
    outgoing (gS, gA) overwrite its (Z, Q^T dO) slots. Grid (D // BD, B*H)."""
    i_r, i_bh = tl.program_id(0), tl.program_id(1)
    rr, rd, rv = i_r * BD + tl.arange(0, BD), tl.arange(0, D), tl.arange(0, DV)
    sd, sv = _mat_offsets(rr, rd, D), _mat_offsets(rr, rv, DV)
    xv = _mat_offsets(rd, rv, DV)
    if HAS_FINAL_GRAD:
        b_gs = tl.load(gs_final + i_bh.to(tl.int64) * D * D + sd)
        b_ga = tl.load(ga_final + i_bh.to(tl.int64) * D * DV + sv)
    else:
        b_gs = tl.zeros([BD, D], dtype=tl.float32)
        b_ga = tl.zeros([BD, DV], dtype=tl.float32)
    for i in range(NT):
        base = (i_bh * NT + NT - 1 - i).to(tl.int64)
        p_z, p_qdo = z_buf + base * D * D + sd, qdo_buf + base * D * DV + sv
        b_z, b_qdo = tl.load(p_z), tl.load(p_qdo)
        b_x = tl.load(x_buf + base * D * DV + xv)
        tl.store(p_z, b_gs)
        tl.store(p_qdo, b_ga)
        b_gs += b_z + tl.dot(b_ga, tl.trans(b_x), input_precision=PREC)
        b_ga += b_qdo
    if STORE_INIT_GRAD:
        tl.store(gs_init + i_bh.to(tl.int64) * D * D + sd, b_gs)
        tl.store(ga_init + i_bh.to(tl.int64) * D * DV + sv, b_ga)


@triton.jit
def chunk_output_kernel(q, k, v, s_buf, a_buf, o, T, NT,
                        H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                        BV: tl.constexpr, PREC: tl.constexpr):
    """O = Q A0 + (L * (Q S0 Q^T + W W^T)) V for one chunk and a BV-wide slice of the
    values. Grid (DV // BV, NT, B*H)."""
    i_v, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    t = i_c * C + tl.arange(0, C)
    causal = tl.arange(0, C)[:, None] >= tl.arange(0, C)[None, :]
    rd, rv = tl.arange(0, D), i_v * BV + tl.arange(0, BV)
    base = (i_bh * NT + i_c).to(tl.int64)
    b_q = _load_tokens(q, i_b, i_h, t, T, H, D)
    b_k = _load_tokens(k, i_b, i_h, t, T, H, D)
    dt = b_q.dtype
    v_offs = ((i_b * T + t).to(tl.int64) * H + i_h)[:, None] * DV + rv[None, :]
    b_v = tl.load(v + v_offs, mask=(t < T)[:, None], other=0.0)
    b_s = tl.load(s_buf + base * D * D + _mat_offsets(rd, rd, D)).to(dt)
    b_a = tl.load(a_buf + base * D * DV + _mat_offsets(rd, rv, DV)).to(dt)

    b_o = tl.dot(b_q, b_a, input_precision=PREC)
    b_qs = tl.dot(b_q, b_s, input_precision=PREC).to(dt)
    b_w = tl.where(causal, tl.dot(b_q, tl.trans(b_k), input_precision=PREC), 0.0).to(dt)
    b_m = tl.dot(b_qs, tl.trans(b_q), input_precision=PREC)
    b_m += tl.dot(b_w, tl.trans(b_w), input_precision=PREC)
    b_m = tl.where(causal, b_m, 0.0).to(dt)
    b_o += tl.dot(b_m, b_v, input_precision=PREC)
    tl.store(o + v_offs, b_o.to(o.dtype.element_ty), mask=(t < T)[:, None])


@triton.jit
def chunk_grads_kernel(q, k, v, do, s_buf, a_buf, gs_buf, ga_buf, dq, dk, dv, T, NT,
                       H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                       PREC: tl.constexpr):
    """Local gradients of one chunk given its carried state (S0, A0) and the gradients
    (gS, gA) w.r.t. its outgoing state. With P = L * (dO V^T), M = L * (Q S0 Q^T + W W^T):
        dV = M^T dO + Q S0 gA + W K gA
        dW = L * ((P + P^T) W + V gA^T K^T)
        dQ = dO A0^T + ((P + P^T) Q + V gA^T) S0 + dW K
        dK = dW^T Q + W^T V gA^T + K (gS + gS^T)
    (S0 symmetric, as every state built from k k^T is). Grid (NT, B*H)."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    t = i_c * C + tl.arange(0, C)
    causal = tl.arange(0, C)[:, None] >= tl.arange(0, C)[None, :]
    rd, rv = tl.arange(0, D), tl.arange(0, DV)
    dd, dvo = _mat_offsets(rd, rd, D), _mat_offsets(rd, rv, DV)
    base = (i_bh * NT + i_c).to(tl.int64)
    b_q = _load_tokens(q, i_b, i_h, t, T, H, D)
    b_k = _load_tokens(k, i_b, i_h, t, T, H, D)
    b_v = _load_tokens(v, i_b, i_h, t, T, H, DV)
    b_do = _load_tokens(do, i_b, i_h, t, T, H, DV)
    dt = b_q.dtype
    b_s = tl.load(s_buf + base * D * D + dd).to(dt)
    b_ga = tl.load(ga_buf + base * D * DV + dvo).to(dt)

    b_w = tl.where(causal, tl.dot(b_q, tl.trans(b_k), input_precision=PREC), 0.0).to(dt)
    b_p = tl.where(causal, tl.dot(b_do, tl.trans(b_v), input_precision=PREC), 0.0)
    b_pp = (b_p + tl.trans(b_p)).to(dt)
    b_qs = tl.dot(b_q, b_s, input_precision=PREC).to(dt)
    b_m = tl.dot(b_qs, tl.trans(b_q), input_precision=PREC)
    b_m += tl.dot(b_w, tl.trans(b_w), input_precision=PREC)
    b_m = tl.where(causal, b_m, 0.0).to(dt)
    b_kga = tl.dot(b_k, b_ga, input_precision=PREC).to(dt)

    b_dv = tl.dot(tl.trans(b_m), b_do, input_precision=PREC)
    b_dv += tl.dot(b_qs, b_ga, input_precision=PREC)
    b_dv += tl.dot(b_w, b_kga, input_precision=PREC)
    _store_tokens(dv, b_dv, i_b, i_h, t, T, H, DV)

    b_dw = tl.dot(b_pp, b_w, input_precision=PREC)
    b_dw += tl.dot(b_v, tl.trans(b_kga), input_precision=PREC)
    b_dw = tl.where(causal, b_dw, 0.0).to(dt)
    b_r = tl.dot(b_pp, b_q, input_precision=PREC)
    b_r += tl.dot(b_v, tl.trans(b_ga), input_precision=PREC)
    b_a = tl.load(a_buf + base * D * DV + dvo).to(dt)
    b_dq = tl.dot(b_do, tl.trans(b_a), input_precision=PREC)
    b_dq += tl.dot(b_r.to(dt), b_s, input_precision=PREC)
    b_dq += tl.dot(b_dw, b_k, input_precision=PREC)
    _store_tokens(dq, b_dq, i_b, i_h, t, T, H, D)

    b_gs = tl.load(gs_buf + base * D * D + dd)
    b_gs = (b_gs + tl.trans(b_gs)).to(dt)
    b_wtv = tl.dot(tl.trans(b_w), b_v, input_precision=PREC).to(dt)
    b_dk = tl.dot(tl.trans(b_dw), b_q, input_precision=PREC)
    b_dk += tl.dot(b_wtv, tl.trans(b_ga), input_precision=PREC)
    b_dk += tl.dot(b_k, b_gs, input_precision=PREC)
    _store_tokens(dk, b_dk, i_b, i_h, t, T, H, D)


@triton.jit
def decode_step_kernel(q, k, v, s, a, a_den, g, o, eps, H: tl.constexpr, D: tl.constexpr,
                       DV: tl.constexpr, BV: tl.constexpr, HAS_DECAY: tl.constexpr,
                       NORMALIZE: tl.constexpr):
    """One token for one (batch, head), state updated in place:
    S = g S + k k^T, A = g^2 A + (S q) v^T, o = q^T A (normalize: a = g^2 a + S q,
    o = q^T A / (q^T a + eps)). Grid (B*H,); the value dim is walked in BV slices."""
    i_bh = tl.program_id(0)
    rd = tl.arange(0, D)
    b_q = tl.load(q + i_bh * D + rd).to(tl.float32)
    b_k = tl.load(k + i_bh * D + rd).to(tl.float32)
    gamma = 1.0
    if HAS_DECAY:
        gamma = tl.load(g + i_bh % H).to(tl.float32)
    p_s = s + i_bh.to(tl.int64) * D * D + _mat_offsets(rd, rd, D)
    b_s = gamma * tl.load(p_s) + b_k[:, None] * b_k[None, :]
    tl.store(p_s, b_s)
    b_sq = tl.sum(b_s * b_q[None, :], axis=1)
    den = 1.0
    if NORMALIZE:
        p_den = a_den + i_bh.to(tl.int64) * D + rd
        b_den = gamma * gamma * tl.load(p_den) + b_sq
        tl.store(p_den, b_den)
        den = tl.sum(b_den * b_q, axis=0) + eps
    for i_v in tl.static_range(DV // BV):
        rv = i_v * BV + tl.arange(0, BV)
        p_a = a + i_bh.to(tl.int64) * D * DV + _mat_offsets(rd, rv, DV)
        b_v = tl.load(v + i_bh * DV + rv).to(tl.float32)
        b_a = gamma * gamma * tl.load(p_a) + b_sq[:, None] * b_v[None, :]
        tl.store(p_a, b_a)
        b_o = tl.sum(b_a * b_q[:, None], axis=0) / den
        tl.store(o + i_bh * DV + rv, b_o.to(o.dtype.element_ty))
