"""Triton kernels for masked second-order HLA (spec §4), with optional per-head decay g.

Decay ("masked" form, spec §1.1 corrected): S_t = g S_{t-1} + k k^T,
A_t = g^2 A_{t-1} + (S_t q_t) v_t^T, o_t = q_t^T A_t. Per chunk of n <= C real tokens with
carried state (S0, A0), local Q, K, V, local position s = 0..C-1 and
    b_s = g^(s+1),  e_s = g^(n-1-s) (0 past n),  Dm_ts = g^(t-s) (t >= s, else 0),
    G = g^n,  W = L * (Q K^T),  Wd = Dm * (Q K^T):
    O  = b^2 * (Q A0) + (Dm * (b * (Q S0 Q^T) + Wd W^T)) V            (row scalings)
    S1 = G S0 + K^T E K
    A1 = G^2 A0 + S0 X + K^T E W^T E V,  X = G Q^T E V                  (E = diag(e))
Without decay every factor is 1 and this is the plain chunk form. The per-chunk increments
dS = K^T E K, X, dA = K^T E W^T E V do not depend on the carried state, so they are
computed for all chunks in parallel; a scan over chunks turns them into the carried states
(A needs one small matmul S0 X per chunk), and the output kernel is parallel again. The
backward pass mirrors this with a reverse scan of the state gradients. Padded positions of
the last chunk have zero q, k, v and do not decay the state (n counts real tokens only).
Normalize (NORMALIZE) is the same form on a ones value column (E V = e): its X, dA and A
columns are [D] vectors carried next to the matrices in the same kernels, and the output
kernel divides by it. Its matrix-vector products are fp32 sums, not dots on 16 equal
columns: Triton 3.6 compiles such dots into out-of-bounds shared-memory reads on Hopper.

Layouts: q, k [B, T, H, D] and v, o [B, T, H, DV], contiguous. Per-chunk buffers are
[B*H, NT, D, D] or [B*H, NT, D, DV], in bf16 for bf16 inputs (the matmuls read them in bf16
anyway; the scans accumulate in fp32) and fp32 otherwise; the scans overwrite the increments
with the states.
Long sequences scan in two levels (few programs looping over many chunks would be latency
bound): segments of SEG chunks summarise themselves in parallel, a short scan over the
segment summaries gives each segment's start state, and the segments then rescan in
parallel from their start states. Loop bounds are compile-time powers of two (the Triton
interpreter cannot loop over a runtime bound with numpy 2); steps past the runtime count NT
are masked, so one compile serves every T of the same power-of-two bucket.
The parallel per-chunk kernels (increments, output, gradient terms, dq/dk/dv) write only
their own outputs, so the GPU may time them: they are autotuned over warp counts (see
_autotuned). The scans keep the fixed launch shape set by the caller; they overwrite their
inputs in place, except the state scan of a forward without backward at chunk 128, which
writes the states to buffers of their own (a loop without barriers, which Triton pipelines).

Non-finite inputs (the rule of mixers/hla/common.py: a NaN or inf in q, k or v at token t
changes only the outputs at and after t). The increments take q, k, v as they are, so a
non-finite token makes its chunk's dS or dA, and every later chunk's carried state,
non-finite; X and its normalize column are stored with non-finite entries as 0 (dA carries
the value forward, and the backward's gA X^T stays 0 where gA is 0). The output kernel masks
its C x C products by selection, not by a multiply (a later row's NaN q or k reads 0, not
0 * NaN), and reads non-finite entries of v as 0 (in the masked M V a later row enters as
0 * v); it adds NaN to its rows from the first non-finite v row on. The backward kernels
read non-finite entries of q, k and v as 0 and add NaN to the gradients of those rows, so a
zero upstream gradient at the outputs from t on leaves every earlier gradient exact. The
paper form's walk reads non-finite entries of q, k and v as 0 throughout and carries a flag:
its outputs from the first non-finite token on, and its final states after one, are NaN.
None of this touches the scans' loops; the per-chunk kernels spend a compare and a select or
two per loaded entry (v in the output kernel, q, k, v in the backward) and a select per
C x C entry of the output's mixing matrix.
"""

import os

import triton
import triton.language as tl


def _autotuned(warps, key, first_only=None):
    """triton.autotune over num_warps in warps (the first is the fixed launch shape used
    before tuning, so tuning can only match or beat it), keyed on the arguments in key (see
    _SHAPE_KEY: the first call of each key picks). first_only(meta) -> True keeps
    only the first config for those compile-time arguments (where the others spill more
    registers). num_stages stays at its default: these kernels have no loops to
    pipeline. Under the interpreter (nothing to time) the plain kernel. A key that is not an
    argument would be ignored silently by triton.autotune, so it is an error here."""
    def wrap(kernel):
        unknown = set(key) - set(kernel.arg_names)
        if unknown:
            raise ValueError(f"autotune key {sorted(unknown)} names no argument of "
                             f"{kernel.__name__}")
        if os.environ.get("TRITON_INTERPRET") == "1":
            return kernel

        def prune(configs, named_args, **meta):
            return configs[:1] if first_only is not None and first_only(meta) else configs
        configs = [triton.Config({}, num_warps=w) for w in warps]
        return triton.autotune(configs, key=list(key),
                               prune_configs_by={"early_config_prune": prune})(kernel)
    return wrap


# Compile-time arguments shared by the per-chunk kernels' autotune keys (dtypes are keyed too).
# The kernels tuned over two warp counts also key on SIZE_CLASS, the bit length of the
# launch's program count (an argument the kernel body does not read): the best warp count
# depends on how many programs a launch runs, and without this key the first call of a shape
# (a short sequence, say) would choose the warps of every later size.
_SHAPE_KEY = ("D", "DV", "C", "HAS_DECAY", "NORMALIZE", "PREC")
# Warp counts of the per-chunk kernels. The first, 8, is the launch shape before tuning; 4
# lets two programs share an SM where registers and shared memory allow. first_only keeps 8
# alone where 4 warps spill registers or compute wrong results:
#   increments and gradient terms: 128-row blocks (D = 128 in one block) and chunks above 64
#     keep 8 (4 spills there, and its 4-warp build at D = 128, chunk 128 with normalize is
#     known to give NaN outputs); blocks of up to 64 rows at chunks up to 64 are tuned, and
#     so are the increments in token halves (HALVES: 4 warps fit two programs per SM).
#   output: 64-row programs (chunk 64, or half of a chunk of 128, with or without late state
#     loads) are tuned; programs of other row counts keep 8 (4 warps spill there).
#   dq/dk/dv: tuned at chunk 64 (4 warps spill more than 8 but fit two programs per SM: the
#     GPU decides); other chunk sizes keep 8.
# num_stages stays at its default (1, 2 and 3 give the same code: the kernels have no loops);
# 16 warps cap registers at 128 and spill in the output and dq/dk/dv kernels, so they are not
# offered.
INCREMENTS_WARPS = OUTPUT_WARPS = GRADS_WARPS = (8, 4)


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
def _load_den(ptr, i_b, i_h, t, T, H: tl.constexpr):
    """[len(t)] entries of a [B, T, H] fp32 tensor; past T zero."""
    return tl.load(ptr + (i_b * T + t).to(tl.int64) * H + i_h, mask=t < T, other=0.0)


@triton.jit
def _finite(x):
    """x with its NaN and inf entries read as 0 (see "Non-finite inputs" above)."""
    return tl.where(tl.abs(x) < float("inf"), x, 0.0).to(x.dtype)


@triton.jit
def _bad_rows(x):
    """[rows] fp32: 1 where a row of x has a NaN or inf entry, else 0."""
    return tl.max(tl.where(tl.abs(x) < float("inf"), 0.0, 1.0), axis=1)


@triton.jit
def _poison_rows(bad):
    """[rows] fp32: NaN at the bad rows, 0 elsewhere (bad: 1 at a bad row)."""
    return tl.where(bad > 0, float("nan"), 0.0)


@triton.jit
def _poison_from(bad):
    """[rows] fp32: NaN from the first bad row on, 0 before it (bad: 1 at a bad row)."""
    return tl.where(tl.cumsum(bad, axis=0) > 0, float("nan"), 0.0)


@triton.jit
def _overwrite_barrier():
    """Before a program overwrites in place what it has just read: every thread must have
    read the old values first. A value can be loaded by one thread (or several replicas in
    other warps) and stored by another, and warps run unsynchronised, so without this a
    lagging warp may read the new value (a wrong result now and then, not an error)."""
    tl.debug_barrier()


@triton.jit
def _mat_offsets(rows, cols, NCOL: tl.constexpr):
    return rows[:, None] * NCOL + cols[None, :]


@triton.jit
def _log2_decay(log2g, i_h, HAS_DECAY: tl.constexpr):
    """log2 of this head's decay (0 without decay)."""
    if HAS_DECAY:
        return tl.load(log2g + i_h)
    return 0.0


@triton.jit
def _chunk_decay(i_c, T, lg, C: tl.constexpr):
    """Decay factors of chunk i_c (see the module docstring): causal mask, b, e, Dm, G."""
    s = tl.arange(0, C)
    n = tl.minimum(T - i_c * C, C)
    causal = s[:, None] >= s[None, :]
    b = tl.exp2((s + 1).to(tl.float32) * lg)
    e = tl.where(s < n, tl.exp2((n - 1 - s).to(tl.float32) * lg), 0.0)
    dm = tl.where(causal, tl.exp2((s[:, None] - s[None, :]).to(tl.float32) * lg), 0.0)
    return causal, b, e, dm, tl.exp2(n.to(tl.float32) * lg)


@triton.jit
def _chunk_gamma(i_c, T, lg, C: tl.constexpr):
    """G = g^n for chunk i_c with n real tokens."""
    return tl.exp2(tl.minimum(T - i_c * C, C).to(tl.float32) * lg)


def _increments_tuned(*extra_key):
    """The tuning shared by the increments and gradient-terms kernels (per-chunk row blocks
    of the same products): 8 warps only for 128-row blocks or chunks above 64, except where
    HALVES (a compile-time argument of the increments kernel, keyed in extra_key) is set."""
    return _autotuned(INCREMENTS_WARPS, _SHAPE_KEY + ("BR", "SIZE_CLASS", *extra_key),
                      first_only=lambda meta: not meta.get("HALVES", False)
                      and (meta["BR"] > 64 or meta["C"] > 64))


@triton.jit
def _load_columns(ptr, i_b, i_h, t, T, cols, H: tl.constexpr, W: tl.constexpr):
    """[len(t), len(cols)] entries of a [B, T, H, W] tensor; rows past T read as zero."""
    offs = ((i_b * T + t).to(tl.int64) * H + i_h)[:, None] * W + cols[None, :]
    return tl.load(ptr + offs, mask=(t < T)[:, None], other=0.0)


@triton.jit
def _increments_in_halves(q, k, v, log2g, ds_buf, x_buf, da_buf, xn_buf, an_buf, T, NT, i_c,
                          i_bh, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                          C: tl.constexpr, HAS_DECAY: tl.constexpr, NORMALIZE: tl.constexpr,
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
    b_q1 = _load_tokens(q, i_b, i_h, t1, T, H, D)
    b_k1 = _load_tokens(k, i_b, i_h, t1, T, H, D)
    b_v1 = _load_tokens(v, i_b, i_h, t1, T, H, DV)
    b_q2 = _load_tokens(q, i_b, i_h, t2, T, H, D)
    b_k2 = _load_tokens(k, i_b, i_h, t2, T, H, D)
    b_v2 = _load_tokens(v, i_b, i_h, t2, T, H, DV)
    dt = b_q1.dtype
    b_ke1, b_ke2 = (b_k1 * e1[:, None]).to(dt), (b_k2 * e2[:, None]).to(dt)
    b_ve1, b_ve2 = (b_v1 * e1[:, None]).to(dt), (b_v2 * e2[:, None]).to(dt)
    rd, rv = tl.arange(0, D), tl.arange(0, DV)
    base = (i_bh * NT + i_c).to(tl.int64)
    dd, dv = _mat_offsets(rd, rd, D), _mat_offsets(rd, rv, DV)

    b_ds = tl.dot(tl.trans(b_ke1), b_k1, input_precision=PREC)
    b_ds = tl.dot(tl.trans(b_ke2), b_k2, b_ds, input_precision=PREC)
    tl.store(ds_buf + base * D * D + dd, b_ds.to(ds_buf.dtype.element_ty))
    b_x = tl.dot(tl.trans(b_q1), b_ve1, input_precision=PREC)
    b_x = gamma * tl.dot(tl.trans(b_q2), b_ve2, b_x, input_precision=PREC)
    tl.store(x_buf + base * D * DV + dv, _finite(b_x).to(x_buf.dtype.element_ty))
    b_w11 = tl.where(causal, tl.dot(b_q1, tl.trans(b_k1), input_precision=PREC), 0.0).to(dt)
    b_w21 = tl.dot(b_q2, tl.trans(b_k1), input_precision=PREC).to(dt)
    b_w22 = tl.where(causal, tl.dot(b_q2, tl.trans(b_k2), input_precision=PREC), 0.0).to(dt)
    b_y1 = tl.dot(tl.trans(b_w11), b_ve1, input_precision=PREC)
    b_y1 = tl.dot(tl.trans(b_w21), b_ve2, b_y1, input_precision=PREC).to(dt)
    b_y2 = tl.dot(tl.trans(b_w22), b_ve2, input_precision=PREC).to(dt)
    b_da = tl.dot(tl.trans(b_ke1), b_y1, input_precision=PREC)
    b_da = tl.dot(tl.trans(b_ke2), b_y2, b_da, input_precision=PREC)
    tl.store(da_buf + base * D * DV + dv, b_da.to(da_buf.dtype.element_ty))
    if NORMALIZE:  # V = 1 at real tokens, so E V = e
        b_xn = tl.sum(b_q1.to(tl.float32) * e1[:, None], axis=0)
        b_xn += tl.sum(b_q2.to(tl.float32) * e2[:, None], axis=0)
        tl.store(xn_buf + base * D + rd, _finite(gamma * b_xn))
        b_wte1 = tl.sum(b_w11.to(tl.float32) * e1[:, None], axis=0)
        b_wte1 += tl.sum(b_w21.to(tl.float32) * e2[:, None], axis=0)
        b_wte2 = tl.sum(b_w22.to(tl.float32) * e2[:, None], axis=0)
        b_an = tl.sum(b_ke1.to(tl.float32) * b_wte1[:, None], axis=0)
        b_an += tl.sum(b_ke2.to(tl.float32) * b_wte2[:, None], axis=0)
        tl.store(an_buf + base * D + rd, b_an)


@_increments_tuned("HALVES")
@triton.jit(do_not_specialize=["SIZE_CLASS"])
def chunk_increments_kernel(q, k, v, log2g, ds_buf, x_buf, da_buf, xn_buf, an_buf, T, NT,
                            SIZE_CLASS,
                            H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                            C: tl.constexpr, BR: tl.constexpr, HAS_DECAY: tl.constexpr,
                            NORMALIZE: tl.constexpr, PREC: tl.constexpr,
                            HALVES: tl.constexpr):
    """Per chunk: dS = K^T E K, X = G Q^T E V, dA = K^T E W^T E V, rows i_r BR .. + BR of
    each (a row block takes the matching columns of Q and K; every block recomputes
    W^T E V). NORMALIZE adds the denominator as a ones value column: its X and dA columns
    go to the [B*H, NT, D] vectors xn, an. HALVES (BR = D): the same in two halves of
    tokens (_increments_in_halves). Grid (D // BR, NT, B*H)."""
    i_r, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    if HALVES:
        _increments_in_halves(q, k, v, log2g, ds_buf, x_buf, da_buf, xn_buf, an_buf, T, NT,
                              i_c, i_bh, H, D, DV, C, HAS_DECAY, NORMALIZE, PREC)
        return
    t = i_c * C + tl.arange(0, C)
    causal, b, e, dm, gamma = _chunk_decay(i_c, T, _log2_decay(log2g, i_h, HAS_DECAY), C)
    rr, rd, rv = i_r * BR + tl.arange(0, BR), tl.arange(0, D), tl.arange(0, DV)
    b_q = _load_tokens(q, i_b, i_h, t, T, H, D)
    b_k = _load_tokens(k, i_b, i_h, t, T, H, D)
    b_v = _load_tokens(v, i_b, i_h, t, T, H, DV)
    if BR == D:
        b_qr, b_kr = b_q, b_k
    else:
        b_qr = _load_columns(q, i_b, i_h, t, T, rr, H, D)
        b_kr = _load_columns(k, i_b, i_h, t, T, rr, H, D)
    dt = b_q.dtype
    b_ke = (b_kr * e[:, None]).to(dt)
    b_ve = (b_v * e[:, None]).to(dt)
    base = (i_bh * NT + i_c).to(tl.int64)
    dd, dv = _mat_offsets(rr, rd, D), _mat_offsets(rr, rv, DV)

    b_ds = tl.dot(tl.trans(b_ke), b_k, input_precision=PREC)
    tl.store(ds_buf + base * D * D + dd, b_ds.to(ds_buf.dtype.element_ty))
    b_x = gamma * tl.dot(tl.trans(b_qr), b_ve, input_precision=PREC)
    tl.store(x_buf + base * D * DV + dv, _finite(b_x).to(x_buf.dtype.element_ty))
    b_w = tl.where(causal, tl.dot(b_q, tl.trans(b_k), input_precision=PREC), 0.0).to(dt)
    b_wtv = tl.dot(tl.trans(b_w), b_ve, input_precision=PREC).to(dt)
    b_da = tl.dot(tl.trans(b_ke), b_wtv, input_precision=PREC)
    tl.store(da_buf + base * D * DV + dv, b_da.to(da_buf.dtype.element_ty))
    if NORMALIZE:  # V = 1 at real tokens, so E V = e
        b_xn = gamma * tl.sum(b_qr.to(tl.float32) * e[:, None], axis=0)
        tl.store(xn_buf + base * D + rr, _finite(b_xn))
        b_wte = tl.sum(b_w.to(tl.float32) * e[:, None], axis=0)
        tl.store(an_buf + base * D + rr,
                 tl.sum(b_ke.to(tl.float32) * b_wte[:, None], axis=0))


@_increments_tuned()
@triton.jit(do_not_specialize=["SIZE_CLASS"])
def chunk_grad_terms_kernel(q, v, do, dden, log2g, qdo_buf, z_buf, qn_buf, T, NT, SIZE_CLASS,
                            H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                            C: tl.constexpr, BR: tl.constexpr, HAS_DECAY: tl.constexpr,
                            NORMALIZE: tl.constexpr, PREC: tl.constexpr):
    """Per chunk, the increments of the reverse state-gradient scan: Q^T b^2 dO and
    Z = Q^T (b * P) Q, P = Dm * (dO V^T), rows i_r BR .. + BR of each (every row block
    recomputes (b * P) Q). NORMALIZE adds the ones value column with output gradient dden:
    its Q^T b^2 dden column goes to the [B*H, NT, D] vector qn (an fp32 sum), and P gains
    Dm * (dden 1^T). Grid (D // BR, NT, B*H)."""
    i_r, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    t = i_c * C + tl.arange(0, C)
    causal, b, e, dm, gamma = _chunk_decay(i_c, T, _log2_decay(log2g, i_h, HAS_DECAY), C)
    rr, rd, rv = i_r * BR + tl.arange(0, BR), tl.arange(0, D), tl.arange(0, DV)
    b_q = _finite(_load_tokens(q, i_b, i_h, t, T, H, D))
    if BR == D:
        b_qr = b_q
    else:
        b_qr = _finite(_load_columns(q, i_b, i_h, t, T, rr, H, D))
    b_v = _finite(_load_tokens(v, i_b, i_h, t, T, H, DV))
    b_do = _load_tokens(do, i_b, i_h, t, T, H, DV)
    dt = b_q.dtype
    base = (i_bh * NT + i_c).to(tl.int64)
    dd, dv = _mat_offsets(rr, rd, D), _mat_offsets(rr, rv, DV)

    b_qb2 = (b_qr * (b * b)[:, None]).to(dt)
    b_qdo = tl.dot(tl.trans(b_qb2), b_do, input_precision=PREC)
    tl.store(qdo_buf + base * D * DV + dv, b_qdo.to(qdo_buf.dtype.element_ty))
    b_pv = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
    if NORMALIZE:
        b_dden = _load_den(dden, i_b, i_h, t, T, H)
        b_pv += b_dden[:, None]
        tl.store(qn_buf + base * D + rr,
                 tl.sum(b_qb2.to(tl.float32) * b_dden[:, None], axis=0))
    b_pb = b_pv * dm * b[:, None]
    b_pq = tl.dot(b_pb.to(dt), b_q, input_precision=PREC).to(dt)
    b_z = tl.dot(tl.trans(b_qr), b_pq, input_precision=PREC)
    tl.store(z_buf + base * D * D + dd, b_z.to(z_buf.dtype.element_ty))


@triton.jit
def _start_rows(dd_ptr, dv_ptr, vec_ptr, state, sd, sv, rr, LOAD: tl.constexpr,
                NORMALIZE: tl.constexpr, BD: tl.constexpr, D: tl.constexpr, DV: tl.constexpr):
    """A scan program's carried rows at its start: the [BD, D] and [BD, DV] blocks and the
    [BD] normalize vector of entry `state`, loaded (LOAD) or zero."""
    if LOAD:
        b_dd = tl.load(dd_ptr + state * D * D + sd)
        b_dv = tl.load(dv_ptr + state * D * DV + sv)
    else:
        b_dd = tl.zeros([BD, D], dtype=tl.float32)
        b_dv = tl.zeros([BD, DV], dtype=tl.float32)
    if LOAD and NORMALIZE:
        b_vec = tl.load(vec_ptr + state * D + rr)
    else:
        b_vec = tl.zeros([BD], dtype=tl.float32)
    return b_dd, b_dv, b_vec


@triton.jit
def _step_loads(dd_buf, dv_buf, x_buf, vec_buf, xvec_buf, i_bh, NT, i_c, real, sd, sv, xv, rr,
                rd, D: tl.constexpr, DV: tl.constexpr, NORMALIZE: tl.constexpr):
    """A scan step's inputs at chunk i_c, as stored (zeros where not real): the [BD, D] and
    [BD, DV] row blocks, the whole [D, DV] X, and the normalize vectors' rows and X column.
    The scans load them one step ahead: no load depends on the carried state, so the next
    step's memory latency overlaps this step's work."""
    base = (i_bh * NT + i_c).to(tl.int64)
    b_dd = tl.load(dd_buf + base * D * D + sd, mask=real, other=0.0)
    b_dv = tl.load(dv_buf + base * D * DV + sv, mask=real, other=0.0)
    b_x = tl.load(x_buf + base * D * DV + xv, mask=real, other=0.0)
    if NORMALIZE:
        b_vec = tl.load(vec_buf + base * D + rr, mask=real, other=0.0)
        b_xvec = tl.load(xvec_buf + base * D + rd, mask=real, other=0.0)
    else:
        b_vec = tl.zeros(rr.shape, dtype=tl.float32)
        b_xvec = tl.zeros(rd.shape, dtype=tl.float32)
    return b_dd, b_dv, b_x, b_vec, b_xvec


@triton.jit
def state_scan_kernel(ds_buf, x_buf, da_buf, xn_buf, an_buf, s_out, a_out, an_out, log2g,
                      s_init, a_init, an_init, s_final, a_final, an_final, xp_final, xpn_final,
                      T, NT,
                      SEG: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                      CL: tl.constexpr, BD: tl.constexpr, HAS_DECAY: tl.constexpr,
                      HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
                      SUMMARY: tl.constexpr, NORMALIZE: tl.constexpr, PREC: tl.constexpr,
                      IN_PLACE: tl.constexpr):
    """Exclusive scan over steps of CL tokens (chunks, or segments of chunks):
    S_{c+1} = G S_c + dS, A_{c+1} = G^2 A_c + S_c X + dA. Grid (D // BD, NSEG, B*H): a block
    of BD state rows and segment i_s, steps [i_s SEG, i_s SEG + SEG) of NT. Start and end
    states live at [B*H, NSEG] in s_init/a_init and s_final/a_final.
    SUMMARY=False: (S_c, A_c) are written to s_out, a_out (an_out): over the increments
    (IN_PLACE: the same buffers), or to buffers of their own. In place, a barrier must order
    each step's loads before its stores, and the loads are issued one step ahead by hand;
    out of place, the loop has no barrier and Triton's pipeliner streams the loads into
    shared memory stages ahead of their use.
    SUMMARY=True: nothing is written in place; the segment runs from zero and stores its
    local end state and Xp = sum_c Gamma_c (G^2 of the later steps) X_c, Gamma_c = G of
    the earlier steps, so that a start state (S', A') adds Gamma S' and
    Gamma^2 A' + S' Xp: segments then chain by this same scan with (S, Xp, A) as increments.
    NORMALIZE carries the denominator column of A (vector a, increments an, X column xn)
    alongside, in [.., D] vectors with the same layout (xpn its Xp column)."""
    i_r, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lg = _log2_decay(log2g, i_bh % H, HAS_DECAY)
    rr, rd, rv = i_r * BD + tl.arange(0, BD), tl.arange(0, D), tl.arange(0, DV)
    sd, sv = _mat_offsets(rr, rd, D), _mat_offsets(rr, rv, DV)
    xv = _mat_offsets(rd, rv, DV)
    state = (i_bh * tl.num_programs(1) + i_s).to(tl.int64)
    b_s, b_a, b_an = _start_rows(s_init, a_init, an_init, state, sd, sv, rr, HAS_INIT,
                                 NORMALIZE, BD, D, DV)
    b_xp = tl.zeros([D, DV], dtype=tl.float32)
    b_xpn = tl.zeros([D], dtype=tl.float32)
    b_gamma = 1.0
    if IN_PLACE:
        n_ds, n_da, n_x, n_dan, n_xn = _step_loads(ds_buf, da_buf, x_buf, an_buf, xn_buf, i_bh,
                                                   NT, i_s * SEG, i_s * SEG < NT, sd, sv, xv,
                                                   rr, rd, D, DV, NORMALIZE)
    for j in range(SEG):
        i_c = i_s * SEG + j
        real = i_c < NT  # steps past NT load zeros and leave the state as it is
        if IN_PLACE:
            b_ds, b_da, b_x, b_dan, b_xn = n_ds, n_da, n_x, n_dan, n_xn
        else:
            b_ds, b_da, b_x, b_dan, b_xn = _step_loads(ds_buf, da_buf, x_buf, an_buf, xn_buf,
                                                       i_bh, NT, i_c, real, sd, sv, xv, rr, rd,
                                                       D, DV, NORMALIZE)
        base = (i_bh * NT + i_c).to(tl.int64)
        if not SUMMARY:
            if IN_PLACE:
                _overwrite_barrier()
            tl.store(s_out + base * D * D + sd, b_s.to(s_out.dtype.element_ty), mask=real)
            tl.store(a_out + base * D * DV + sv, b_a.to(a_out.dtype.element_ty), mask=real)
            if NORMALIZE:
                tl.store(an_out + base * D + rr, b_an, mask=real)
        if IN_PLACE:  # the next step's loads, after this step's in-place stores (a barrier
            # orders those)
            n_ds, n_da, n_x, n_dan, n_xn = _step_loads(ds_buf, da_buf, x_buf, an_buf, xn_buf,
                                                       i_bh, NT, i_c + 1,
                                                       (j + 1 < SEG) & (i_c + 1 < NT), sd, sv,
                                                       xv, rr, rd, D, DV, NORMALIZE)
        gamma = tl.where(real, _chunk_gamma(i_c, T, lg, CL), 1.0)
        if NORMALIZE:
            if SUMMARY:
                b_xpn = gamma * gamma * b_xpn + b_gamma * b_xn
            b_an = gamma * gamma * b_an + tl.sum(b_s * b_xn[None, :], axis=1) + b_dan
        if SUMMARY:
            b_xp = gamma * gamma * b_xp + b_gamma * b_x.to(tl.float32)
            b_gamma = b_gamma * gamma
        b_a = gamma * gamma * b_a + tl.dot(b_s.to(b_x.dtype), b_x, input_precision=PREC)
        b_a += b_da.to(tl.float32)
        b_s = gamma * b_s + b_ds.to(tl.float32)
    if STORE_FINAL:
        tl.store(s_final + state * D * D + sd, b_s)
        tl.store(a_final + state * D * DV + sv, b_a)
        if NORMALIZE:
            tl.store(an_final + state * D + rr, b_an)
        if SUMMARY:
            if i_r == 0:
                tl.store(xp_final + state * D * DV + xv, b_xp)
                if NORMALIZE:
                    tl.store(xpn_final + state * D + rd, b_xpn)


@triton.jit
def grad_scan_kernel(qdo_buf, z_buf, x_buf, qn_buf, xn_buf, log2g, gs_final, ga_final,
                     gan_final, gs_init, ga_init, gan_init, xq_init, xqn_init, T, NT,
                     SEG: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                     CL: tl.constexpr, BD: tl.constexpr, HAS_DECAY: tl.constexpr,
                     HAS_FINAL_GRAD: tl.constexpr, STORE_INIT_GRAD: tl.constexpr,
                     SUMMARY: tl.constexpr, NORMALIZE: tl.constexpr, PREC: tl.constexpr):
    """Reverse scan of the state gradients. With gA, gS the gradients w.r.t. a step's
    outgoing state: incoming gA = G^2 gA + Q^T b^2 dO, incoming gS = G gS + Z + gA X^T.
    Grid (D // BD, NSEG, B*H), segments as in state_scan_kernel; end-of-segment gradients
    at [B*H, NSEG] in gs_final/ga_final, start-of-segment ones in gs_init/ga_init.
    SUMMARY=False: each step's outgoing (gS, gA) overwrite its (Z, Q^T b^2 dO) slots.
    SUMMARY=True: from zero, nothing in place; stores the local incoming gradients and
    Xq = sum_c (G^2 of the later steps)_c (G of the earlier steps) X_c, so an end
    gradient (gS', gA') adds Gamma gS' + gA' Xq^T and Gamma^2 gA'. NORMALIZE carries the
    denominator column of gA (vector gan, increments qn, X column xn; xqn its Xq column)."""
    i_r, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    lg = _log2_decay(log2g, i_bh % H, HAS_DECAY)
    rr, rd, rv = i_r * BD + tl.arange(0, BD), tl.arange(0, D), tl.arange(0, DV)
    sd, sv = _mat_offsets(rr, rd, D), _mat_offsets(rr, rv, DV)
    xv = _mat_offsets(rd, rv, DV)
    state = (i_bh * tl.num_programs(1) + i_s).to(tl.int64)
    b_gs, b_ga, b_gan = _start_rows(gs_final, ga_final, gan_final, state, sd, sv, rr,
                                    HAS_FINAL_GRAD, NORMALIZE, BD, D, DV)
    b_xq = tl.zeros([D, DV], dtype=tl.float32)
    b_xqn = tl.zeros([D], dtype=tl.float32)
    b_gamma2 = 1.0
    last = i_s * SEG + SEG - 1
    n_z, n_qdo, n_x, n_qn, n_xn = _step_loads(z_buf, qdo_buf, x_buf, qn_buf, xn_buf, i_bh, NT,
                                              last, last < NT, sd, sv, xv, rr, rd, D, DV,
                                              NORMALIZE)
    for j in range(SEG):
        i_c = last - j
        real = i_c < NT  # steps past NT load zeros and leave the gradients as they are
        b_z, b_qdo, b_x, b_qn, b_xn = n_z, n_qdo, n_x, n_qn, n_xn
        base = (i_bh * NT + i_c).to(tl.int64)
        if not SUMMARY:
            _overwrite_barrier()
            tl.store(z_buf + base * D * D + sd, b_gs.to(z_buf.dtype.element_ty), mask=real)
            tl.store(qdo_buf + base * D * DV + sv, b_ga.to(qdo_buf.dtype.element_ty), mask=real)
            if NORMALIZE:
                tl.store(qn_buf + base * D + rr, b_gan, mask=real)
        # the next step's loads, after this step's in-place stores (a barrier orders those)
        n_z, n_qdo, n_x, n_qn, n_xn = _step_loads(z_buf, qdo_buf, x_buf, qn_buf, xn_buf, i_bh,
                                                  NT, i_c - 1, (j + 1 < SEG) & (i_c - 1 < NT),
                                                  sd, sv, xv, rr, rd, D, DV, NORMALIZE)
        gamma = tl.where(real, _chunk_gamma(i_c, T, lg, CL), 1.0)
        if NORMALIZE:
            if SUMMARY:
                b_xqn = gamma * b_xqn + b_gamma2 * b_xn
        if SUMMARY:
            b_xq = gamma * b_xq + b_gamma2 * b_x.to(tl.float32)
            b_gamma2 = b_gamma2 * gamma * gamma
        b_gs = gamma * b_gs + b_z.to(tl.float32) + tl.dot(b_ga.to(b_x.dtype), tl.trans(b_x),
                                                          input_precision=PREC)
        if NORMALIZE:
            b_gs += b_gan[:, None] * b_xn[None, :]
            b_gan = gamma * gamma * b_gan + b_qn
        b_ga = gamma * gamma * b_ga + b_qdo.to(tl.float32)
    if STORE_INIT_GRAD:
        tl.store(gs_init + state * D * D + sd, b_gs)
        tl.store(ga_init + state * D * DV + sv, b_ga)
        if NORMALIZE:
            tl.store(gan_init + state * D + rr, b_gan)
        if SUMMARY:
            if i_r == 0:
                tl.store(xq_init + state * D * DV + xv, b_xq)
                if NORMALIZE:
                    tl.store(xqn_init + state * D + rd, b_xqn)


@_autotuned(OUTPUT_WARPS, _SHAPE_KEY + ("BV", "BT", "SIZE_CLASS", "LATE_STATES"),
            first_only=lambda meta: meta["BT"] != 64)
@triton.jit(do_not_specialize=["SIZE_CLASS"])
def chunk_output_kernel(q, k, v, log2g, s_buf, a_buf, an_buf, o, den, eps, T, NT, SIZE_CLASS,
                        H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
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
    (less shared memory at once). Grid (DV // BV, NT * C // BT, B*H)."""
    i_v, i_ct, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_c, i_t = i_ct // (C // BT), i_ct % (C // BT)
    i_b, i_h = i_bh // H, i_bh % H
    lg = _log2_decay(log2g, i_h, HAS_DECAY)
    t = i_c * C + i_t * BT + tl.arange(0, BT)
    causal, b, _, dm, _ = _chunk_decay(0, BT, lg, BT)  # the rows' own block, as a full chunk
    b = b * tl.exp2((i_t * BT).to(tl.float32) * lg)
    rd, rv = tl.arange(0, D), i_v * BV + tl.arange(0, BV)
    base = (i_bh * NT + i_c).to(tl.int64)
    b_q = _load_tokens(q, i_b, i_h, t, T, H, D)
    b_k = _load_tokens(k, i_b, i_h, t, T, H, D)
    dt = b_q.dtype
    v_offs = ((i_b * T + t).to(tl.int64) * H + i_h)[:, None] * DV + rv[None, :]
    b_v = tl.load(v + v_offs, mask=(t < T)[:, None], other=0.0)
    v_bad = _bad_rows(b_v)
    b_v = _finite(b_v)  # the masked M V would read a later row's NaN as 0 * NaN
    b_s = tl.load(s_buf + base * D * D + _mat_offsets(rd, rd, D)).to(dt)
    if LATE_STATES:  # A0 is loaded for the last product: less shared memory at once
        b_o = tl.zeros([BT, BV], dtype=tl.float32)
    else:
        b_a = tl.load(a_buf + base * D * DV + _mat_offsets(rd, rv, DV)).to(dt)
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
            b_qp = _load_tokens(q, i_b, i_h, tp, T, H, D)
            b_kp = _load_tokens(k, i_b, i_h, tp, T, H, D)
            b_vp = tl.load(v + v_offs - BT * H * DV, mask=(tp < T)[:, None], other=0.0)
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
        b_a = tl.load(a_buf + base * D * DV + _mat_offsets(rd, rv, DV)).to(dt)
        b_o += tl.dot(b_q, b_a, input_precision=PREC) * (b * b)[:, None]
    b_o += _poison_from(v_bad)[:, None]  # v was read as finite: its rows from the bad one on
    if NORMALIZE:  # the same form on a ones column, with a0
        b_an = tl.load(an_buf + base * D + rd)
        b_den += tl.sum(b_q.to(tl.float32) * b_an[None, :], axis=1) * (b * b)
        b_den += tl.sum(b_m.to(tl.float32), axis=1)
        b_o = b_o / (b_den + eps)[:, None]
        if i_v == 0:
            tl.store(den + ((i_b * T + t).to(tl.int64) * H + i_h), b_den, mask=t < T)
    tl.store(o + v_offs, b_o.to(o.dtype.element_ty), mask=(t < T)[:, None])


@_autotuned(GRADS_WARPS, _SHAPE_KEY + ("WANT_Q", "WANT_K", "WANT_V", "SIZE_CLASS"),
            first_only=lambda meta: meta["C"] != 64)
@triton.jit(do_not_specialize=["SIZE_CLASS"])
def chunk_grads_kernel(q, k, v, do, dden, log2g, s_buf, a_buf, gs_buf, ga_buf, an_buf,
                       gan_buf, dq, dk, dv, T, NT, SIZE_CLASS, H: tl.constexpr, D: tl.constexpr,
                       DV: tl.constexpr, C: tl.constexpr, HAS_DECAY: tl.constexpr,
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
    rd, rv = tl.arange(0, D), tl.arange(0, DV)
    dd, dvo = _mat_offsets(rd, rd, D), _mat_offsets(rd, rv, DV)
    base = (i_bh * NT + i_c).to(tl.int64)
    b_q = _load_tokens(q, i_b, i_h, t, T, H, D)
    b_k = _load_tokens(k, i_b, i_h, t, T, H, D)
    b_v = _load_tokens(v, i_b, i_h, t, T, H, DV)
    # the gradients of a row with a non-finite entry are NaN; the rows are read as finite
    q_bad, k_bad, v_bad = _bad_rows(b_q), _bad_rows(b_k), _bad_rows(b_v)
    b_q, b_k, b_v = _finite(b_q), _finite(b_k), _finite(b_v)
    b_do = _load_tokens(do, i_b, i_h, t, T, H, DV)
    dt = b_q.dtype
    b_ve = (b_v * e[:, None]).to(dt)
    b_qk = tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
    b_w = tl.where(causal, b_qk, 0.0).to(dt)
    b_wd = (b_qk * dm).to(dt)
    b_ga = tl.load(ga_buf + base * D * DV + dvo).to(dt)
    b_kga = tl.dot((b_k * e[:, None]).to(dt), b_ga, input_precision=PREC).to(dt)
    if WANT_Q or WANT_K:
        b_p = tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        if NORMALIZE:  # small vectors are reloaded where used (fewer live registers)
            b_p += _load_den(dden, i_b, i_h, t, T, H)[:, None]
        b_p = b_p * dm
        b_gr = tl.dot(b_p.to(dt), b_w, input_precision=PREC) * dm
        b_vkga = tl.dot(b_ve, tl.trans(b_kga), input_precision=PREC)
        if NORMALIZE:
            b_gan = tl.load(gan_buf + base * D + rd)
            b_kgan = e * tl.sum(b_k.to(tl.float32) * b_gan[None, :], axis=1)
            b_vkga += e[:, None] * b_kgan[None, :]
        b_gr += tl.where(causal, tl.dot(tl.trans(b_p.to(dt)), b_wd, input_precision=PREC)
                         + b_vkga, 0.0)
        b_gr = b_gr.to(dt)
    if WANT_K:
        b_gs = tl.load(gs_buf + base * D * D + dd).to(tl.float32)
        b_gs = (b_gs + tl.trans(b_gs)).to(dt)
        b_wtv = tl.dot(tl.trans(b_w), b_ve, input_precision=PREC).to(dt)
        b_dk = tl.dot(tl.trans(b_gr), b_q, input_precision=PREC)
        b_kgs = tl.dot(b_wtv, tl.trans(b_ga), input_precision=PREC)
        b_kgs += tl.dot(b_k, b_gs, input_precision=PREC)
        if NORMALIZE:
            b_wte = tl.sum(b_w.to(tl.float32) * e[:, None], axis=0)
            b_kgs += b_wte[:, None] * tl.load(gan_buf + base * D + rd)[None, :]
        b_dk += b_kgs * e[:, None]
        _store_tokens(dk, b_dk + _poison_rows(k_bad)[:, None], i_b, i_h, t, T, H, D)
    if WANT_Q:
        b_pb = b_p * b[:, None]
        b_r = tl.dot((b_pb + tl.trans(b_pb)).to(dt), b_q, input_precision=PREC)
        b_r += gamma * tl.dot(b_ve, tl.trans(b_ga), input_precision=PREC)
        b_s = tl.load(s_buf + base * D * D + dd).to(dt)
        b_a = tl.load(a_buf + base * D * DV + dvo).to(dt)
        b_doa = tl.dot(b_do, tl.trans(b_a), input_precision=PREC)
        if NORMALIZE:
            b_r += (gamma * e)[:, None] * tl.load(gan_buf + base * D + rd)[None, :]
            b_an = tl.load(an_buf + base * D + rd)
            b_doa += _load_den(dden, i_b, i_h, t, T, H)[:, None] * b_an[None, :]
        b_dq = b_doa * (b * b)[:, None]
        b_dq += tl.dot(b_r.to(dt), b_s, input_precision=PREC)
        b_dq += tl.dot(b_gr, b_k, input_precision=PREC)
        _store_tokens(dq, b_dq + _poison_rows(q_bad)[:, None], i_b, i_h, t, T, H, D)
    if WANT_V:
        b_s = tl.load(s_buf + base * D * D + dd).to(dt)
        b_qs = tl.dot(b_q, b_s, input_precision=PREC)
        b_m = tl.dot((b_qs * b[:, None]).to(dt), tl.trans(b_q), input_precision=PREC)
        b_m += tl.dot(b_wd, tl.trans(b_w), input_precision=PREC)
        b_m = (b_m * dm).to(dt)
        b_dv = tl.dot(tl.trans(b_m), b_do, input_precision=PREC)
        b_dv += tl.dot((b_qs * (gamma * e)[:, None]).to(dt), b_ga, input_precision=PREC)
        b_dv += tl.dot(b_w, b_kga, input_precision=PREC) * e[:, None]
        _store_tokens(dv, b_dv + _poison_rows(v_bad)[:, None], i_b, i_h, t, T, H, DV)


@triton.jit
def decode_step_kernel(q, k, v, s, a, a_den, g, o, eps, H: tl.constexpr, D: tl.constexpr,
                       DV: tl.constexpr, BR: tl.constexpr, HAS_DECAY: tl.constexpr,
                       NORMALIZE: tl.constexpr, SHARED_KV: tl.constexpr):
    """One token for one (batch, head), state updated in place:
    S = g S + k k^T, A = g^2 A + (S q) v^T, o = q^T A (normalize: a = g^2 a + S q,
    o = q^T A / (q^T a + eps)). Row r of A only needs row r of S, so the state is walked
    in blocks of BR rows (few registers, many resident programs: the step is memory bound).
    With SHARED_KV (multi-query) k, v and S have one head per batch and S arrives already
    updated (one writer). Grid (B*H,)."""
    i_bh = tl.program_id(0)
    i_kv = i_bh
    if SHARED_KV:
        i_kv = i_bh // H
    rd, rv = tl.arange(0, D), tl.arange(0, DV)
    b_q = tl.load(q + i_bh * D + rd).to(tl.float32)
    b_k = tl.load(k + i_kv * D + rd).to(tl.float32)
    b_v = tl.load(v + i_kv * DV + rv).to(tl.float32)
    gamma = 1.0
    if HAS_DECAY:
        gamma = tl.load(g + i_bh % H).to(tl.float32)
    b_num = tl.zeros([DV], dtype=tl.float32)
    den = eps
    for i_r in tl.static_range(D // BR):
        rr = i_r * BR + tl.arange(0, BR)
        b_qr = tl.load(q + i_bh * D + rr).to(tl.float32)
        b_kr = tl.load(k + i_kv * D + rr).to(tl.float32)
        p_s = s + i_kv.to(tl.int64) * D * D + _mat_offsets(rr, rd, D)
        p_den = a_den + i_bh.to(tl.int64) * D + rr
        p_a = a + i_bh.to(tl.int64) * D * DV + _mat_offsets(rr, rv, DV)
        b_s = tl.load(p_s)
        b_a = tl.load(p_a)
        if NORMALIZE:
            b_den = tl.load(p_den)
        _overwrite_barrier()
        if not SHARED_KV:
            b_s = gamma * b_s + b_kr[:, None] * b_k[None, :]
            tl.store(p_s, b_s)
        b_sq = tl.sum(b_s * b_q[None, :], axis=1)
        if NORMALIZE:
            b_den = gamma * gamma * b_den + b_sq
            tl.store(p_den, b_den)
            den += tl.sum(b_den * b_qr, axis=0)
        b_a = gamma * gamma * b_a + b_sq[:, None] * b_v[None, :]
        tl.store(p_a, b_a)
        b_num += tl.sum(b_a * b_qr[:, None], axis=0)
    if NORMALIZE:
        b_num = b_num / den
    tl.store(o + i_bh * DV + rv, b_num.to(o.dtype.element_ty))


# ---- decay_form="paper" (spec §4.3 recurrence) -------------------------------------------
# S_t = g S + k k^T, C_t = g C + q v^T, G_t = g G + k k^T C_{t-1}, o_t = q^T (S_t C_t - G_t).
# Per chunk of n <= C real tokens with carried (S0, C0, G0), local positions s = 0..C-1,
# b_s = g^(s+1), a_s = g^s, e_s = g^(n-1-s) [s < n], f_s = g^(n-2-s) [s < n-1],
# Dm_rs = g^(r-s) [r >= s], Ds_rs = g^(r-1-s) [r > s], Gam = g^n, A = Q K^T, W = L * A,
# Wd = Dm * A, Ks = (strict lower) * A^T (Ks_is = k_i . q_s, s < i):
#     QS = b Q S0 + Wd K                                    (rows q_r^T S_r)
#     Y  = b QS - a W K                                     (what multiplies C0)
#     M  = Dm * (QS Q^T) - Ds * (W Ks)
#     O  = Y C0 - b Q G0 + M V
#     S1 = Gam S0 + K^T E K,  C1 = Gam C0 + Q^T E V
#     G1 = Gam G0 + g^(n-1) K^T K C0 + K^T Ks F V           (E = diag(e), F = diag(f))
# These need the full carried C0 at every chunk, so one program per (batch, head) and slice
# of value columns walks the chunks in order with the states in registers (a sequential
# scan; simple, not the fastest).
# The backward pass reruns it storing each chunk's start states, then walks the chunks in
# reverse carrying the state gradients (dS, dC, dG) and writes dq, dk, dv per chunk.
# Normalize is handled by the caller as a ones column of v (padded to a power of two).


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
                         DV: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
                         NT_BOUND: tl.constexpr,
                         HAS_INIT: tl.constexpr, STORE_OUT: tl.constexpr,
                         STORE_FINAL: tl.constexpr, STORE_STATES: tl.constexpr,
                         PREC: tl.constexpr):
    """Sequential chunk scan of the paper form for one (batch, head) and a BV-wide slice of
    the value columns (C, G and O columns depend on their own value columns only; every
    slice recomputes S, slice 0 stores it): outputs into o (STORE_OUT), end states into
    s/c/g_final (STORE_FINAL), each chunk's start states into the [B*H, NT, ..] buffers
    s/c/g_buf (STORE_STATES, for backward). fp32 throughout. Chunks past NT (the loop runs
    to the power of two NT_BOUND) load zeros and keep the state. Grid (DV // BV, B*H)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    lg = tl.load(log2g + i_h)
    rd, rv = tl.arange(0, D), i_v * BV + tl.arange(0, BV)
    dd, dv = _mat_offsets(rd, rd, D), _mat_offsets(rd, rv, DV)
    head = i_bh.to(tl.int64)
    if HAS_INIT:
        b_s = tl.load(s_init + head * D * D + dd)
        b_c = tl.load(c_init + head * D * DV + dv)
        b_g = tl.load(g_init + head * D * DV + dv)
    else:
        b_s = tl.zeros([D, D], dtype=tl.float32)
        b_c = tl.zeros([D, BV], dtype=tl.float32)
        b_g = tl.zeros([D, BV], dtype=tl.float32)
    seen = 0.0  # 1 once a token of this (batch, head) and slice had a non-finite input
    for i_c in range(NT_BOUND):
        t = i_c * C + tl.arange(0, C)
        causal, strict, b, a, e, f, dm, ds, gam, last = _paper_decay(i_c, T, lg, C)
        if STORE_STATES:
            base = (i_bh * NT + i_c).to(tl.int64)
            real = i_c < NT
            tl.store(s_buf + base * D * D + dd, b_s, mask=real & (i_v == 0))
            tl.store(c_buf + base * D * DV + dv, b_c, mask=real)
            tl.store(g_buf + base * D * DV + dv, b_g, mask=real)
        b_q = _load_tokens(q, i_b, i_h, t, T, H, D).to(tl.float32)
        b_k = _load_tokens(k, i_b, i_h, t, T, H, D).to(tl.float32)
        v_offs = ((i_b * T + t).to(tl.int64) * H + i_h)[:, None] * DV + rv[None, :]
        b_v = tl.load(v + v_offs, mask=(t < T)[:, None], other=0.0).to(tl.float32)
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
            tl.store(o + v_offs, b_o.to(o.dtype.element_ty), mask=(t < T)[:, None])
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
            tl.store(s_final + head * D * D + dd, b_s + poison)
        tl.store(c_final + head * D * DV + dv, b_c + poison)
        tl.store(g_final + head * D * DV + dv, b_g + poison)


@triton.jit
def paper_backward_kernel(q, k, v, do, log2g, s_buf, c_buf, g_buf, gs_final, gc_final,
                          gg_final, gs_init, gc_init, gg_init, dq, dk, dv, T, NT,
                          H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                          BV: tl.constexpr, C: tl.constexpr,
                          NT_BOUND: tl.constexpr, HAS_FINAL_GRAD: tl.constexpr,
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
    that the caller sums (slice 0 starts from the final dS). Grid (DV // BV, B*H)."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    lg = tl.load(log2g + i_h)
    rd, rv = tl.arange(0, D), i_v * BV + tl.arange(0, BV)
    dd, dvo = _mat_offsets(rd, rd, D), _mat_offsets(rd, rv, DV)
    head = i_bh.to(tl.int64)
    part = i_v.to(tl.int64) * tl.num_programs(1)
    dq += part * T * D  # this slice's [B, T, H, D] part (num_programs(1) = B * H)
    dk += part * T * D
    if HAS_FINAL_GRAD:
        b_gs = tl.load(gs_final + head * D * D + dd) * (i_v == 0).to(tl.float32)
        b_gc = tl.load(gc_final + head * D * DV + dvo)
        b_gg = tl.load(gg_final + head * D * DV + dvo)
    else:
        b_gs = tl.zeros([D, D], dtype=tl.float32)
        b_gc = tl.zeros([D, BV], dtype=tl.float32)
        b_gg = tl.zeros([D, BV], dtype=tl.float32)
    for j in range(NT_BOUND):
        i_c = NT_BOUND - 1 - j
        real = i_c < NT
        t = i_c * C + tl.arange(0, C)
        causal, strict, b, a, e, f, dm, ds, gam, last = _paper_decay(i_c, T, lg, C)
        base = (i_bh * NT + i_c).to(tl.int64)
        b_s0 = tl.load(s_buf + base * D * D + dd, mask=real, other=0.0)
        b_c0 = tl.load(c_buf + base * D * DV + dvo, mask=real, other=0.0)
        b_g0 = tl.load(g_buf + base * D * DV + dvo, mask=real, other=0.0)
        b_q = _load_tokens(q, i_b, i_h, t, T, H, D).to(tl.float32)
        b_k = _load_tokens(k, i_b, i_h, t, T, H, D).to(tl.float32)
        v_offs = ((i_b * T + t).to(tl.int64) * H + i_h)[:, None] * DV + rv[None, :]
        b_v = tl.load(v + v_offs, mask=(t < T)[:, None], other=0.0).to(tl.float32)
        # as the forward: the finite part of the inputs (a row with a non-finite entry gets
        # NaN gradients)
        q_bad, k_bad, v_bad = _bad_rows(b_q), _bad_rows(b_k), _bad_rows(b_v)
        b_q, b_k, b_v = _finite(b_q), _finite(b_k), _finite(b_v)
        b_do = tl.load(do + v_offs, mask=(t < T)[:, None], other=0.0).to(tl.float32)
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
        _store_tokens(dq, b_dq + _poison_rows(q_bad)[:, None], i_b, i_h, t, T, H, D)

        b_dk = tl.dot(tl.trans(b_bm), b_dy, input_precision=PREC)
        b_dk += tl.dot(tl.trans(b_wd), b_dqs, input_precision=PREC)
        b_dk += tl.dot(tl.dot(b_ks, b_vf, input_precision=PREC), tl.trans(b_gg),
                       input_precision=PREC)
        b_cg = tl.dot(b_c0, tl.trans(b_gg), input_precision=PREC)
        b_dk += last * tl.dot(b_k, b_cg + tl.trans(b_cg), input_precision=PREC)
        b_dk += e[:, None] * tl.dot(b_k, b_gs + tl.trans(b_gs), input_precision=PREC)
        b_dk += tl.dot(tl.trans(b_da), b_q, input_precision=PREC)
        _store_tokens(dk, b_dk + _poison_rows(k_bad)[:, None], i_b, i_h, t, T, H, D)

        b_dv = tl.dot(tl.trans(b_m), b_do, input_precision=PREC)
        b_dv += e[:, None] * tl.dot(b_q, b_gc, input_precision=PREC)
        b_dv += f[:, None] * tl.dot(tl.trans(b_ks), b_kdg, input_precision=PREC)
        b_dv += _poison_rows(v_bad)[:, None]
        tl.store(dv + v_offs, b_dv.to(dv.dtype.element_ty), mask=(t < T)[:, None])

        b_ktk = tl.dot(tl.trans(b_k), b_k, input_precision=PREC)
        b_gs = gam * b_gs + tl.dot(tl.trans(b_q), (b * b)[:, None] * b_dy + b[:, None] * b_dqs,
                                   input_precision=PREC)
        b_gc = gam * b_gc + tl.dot(tl.trans(b_y), b_do, input_precision=PREC)
        b_gc += last * tl.dot(b_ktk, b_gg, input_precision=PREC)
        b_gg = gam * b_gg - tl.dot(tl.trans(b_q * b[:, None]), b_do, input_precision=PREC)
    if STORE_INIT_GRAD:
        tl.store(gs_init + (part + head) * D * D + dd, b_gs)
        tl.store(gc_init + head * D * DV + dvo, b_gc)
        tl.store(gg_init + head * D * DV + dvo, b_gg)


@triton.jit
def paper_decode_step_kernel(q, k, v, s, c, g_state, g, o, H: tl.constexpr, D: tl.constexpr,
                             DV: tl.constexpr, BR: tl.constexpr, SHARED_KV: tl.constexpr):
    """One token of the paper form for one (batch, head), state updated in place:
    G = g G + k (k^T C), S = g S + k k^T, C = g C + q v^T, o = (q^T S) C - q^T G.
    Two passes over blocks of BR state rows: k^T C (old C) and q^T S (new S), then the
    C and G rows and the output. With SHARED_KV, k, v and S have one head per batch and S
    arrives already updated. Grid (B*H,)."""
    i_bh = tl.program_id(0)
    i_kv = i_bh
    if SHARED_KV:
        i_kv = i_bh // H
    rd, rv = tl.arange(0, D), tl.arange(0, DV)
    b_k = tl.load(k + i_kv * D + rd).to(tl.float32)
    b_v = tl.load(v + i_kv * DV + rv).to(tl.float32)
    gamma = tl.load(g + i_bh % H).to(tl.float32)
    b_kc = tl.zeros([DV], dtype=tl.float32)
    b_qs = tl.zeros([D], dtype=tl.float32)
    for i_r in tl.static_range(D // BR):
        rr = i_r * BR + tl.arange(0, BR)
        b_qr = tl.load(q + i_bh * D + rr).to(tl.float32)
        b_kr = tl.load(k + i_kv * D + rr).to(tl.float32)
        p_c = c + i_bh.to(tl.int64) * D * DV + _mat_offsets(rr, rv, DV)
        b_kc += tl.sum(tl.load(p_c) * b_kr[:, None], axis=0)
        p_s = s + i_kv.to(tl.int64) * D * D + _mat_offsets(rr, rd, D)
        b_s = tl.load(p_s)
        _overwrite_barrier()
        if not SHARED_KV:
            b_s = gamma * b_s + b_kr[:, None] * b_k[None, :]
            tl.store(p_s, b_s)
        b_qs += tl.sum(b_s * b_qr[:, None], axis=0)
    _overwrite_barrier()  # the pass above read every row of the old C
    b_num = tl.zeros([DV], dtype=tl.float32)
    for i_r in tl.static_range(D // BR):
        rr = i_r * BR + tl.arange(0, BR)
        b_qr = tl.load(q + i_bh * D + rr).to(tl.float32)
        b_kr = tl.load(k + i_kv * D + rr).to(tl.float32)
        b_qsr = tl.sum(tl.where(rd[None, :] == rr[:, None], b_qs[None, :], 0.0), axis=1)
        offs = i_bh.to(tl.int64) * D * DV + _mat_offsets(rr, rv, DV)
        b_c = tl.load(c + offs)
        b_gr = tl.load(g_state + offs)
        _overwrite_barrier()
        b_c = gamma * b_c + b_qr[:, None] * b_v[None, :]
        tl.store(c + offs, b_c)
        b_gr = gamma * b_gr + b_kr[:, None] * b_kc[None, :]
        tl.store(g_state + offs, b_gr)
        b_num += tl.sum(b_c * b_qsr[:, None] - b_gr * b_qr[:, None], axis=0)
    tl.store(o + i_bh * DV + rv, b_num.to(o.dtype.element_ty))
