"""The masked form's scans over chunks: state_scan_kernel turns the forward's increments into
each chunk's carried states (S, A and normalize's a), grad_scan_kernel carries the gradients
of the states from the last chunk back to the first. Each program holds a block of state
rows and loops over the chunks; the plan's ScanPlan sets the rows and the levels. Where the
row-block programs cannot fill the GPU (few heads over a long sequence: a loop of few
programs over many chunks is latency bound), a scan runs in two levels: segments of SEG
chunks summarise themselves in parallel, a short scan over the segment summaries gives each
segment's start state, and the segments then rescan in parallel from their start states.
The scans overwrite their inputs in place, except the state scan where the plan gives the
states buffers of their own (states_out_of_place: a loop without barriers, which Triton
pipelines)."""

import torch
import triton
import triton.language as tl

from mixers.hla.hla2.triton.common import (_chunk_gamma, _dim_ok, _log2_decay, _loop_bound,
                                           _mat_offsets, _overwrite_barrier,
                                           _tile_ok)


@triton.jit
def _start_rows(dd_ptr, dv_ptr, vec_ptr, state, sd, sd_ok, sv, sv_ok, rr, rr_ok,
                LOAD: tl.constexpr, NORMALIZE: tl.constexpr, D: tl.constexpr,
                DV: tl.constexpr):
    """A scan program's carried blocks at its start: its [rows, cols] blocks of the D x D
    and D x DV matrices and its rows of the [D] normalize vector of entry `state` (offsets
    sd, sv, rr within an entry; masks their true dims), loaded (LOAD) or zero."""
    if LOAD:
        b_dd = tl.load(dd_ptr + state * D * D + sd, mask=sd_ok, other=0.0)
        b_dv = tl.load(dv_ptr + state * D * DV + sv, mask=sv_ok, other=0.0)
    else:
        b_dd = tl.zeros(sd.shape, dtype=tl.float32)
        b_dv = tl.zeros(sv.shape, dtype=tl.float32)
    if LOAD and NORMALIZE:
        b_vec = tl.load(vec_ptr + state * D + rr, mask=rr_ok, other=0.0)
    else:
        b_vec = tl.zeros(rr.shape, dtype=tl.float32)
    return b_dd, b_dv, b_vec


@triton.jit
def _step_loads(dd_buf, dv_buf, x_buf, vec_buf, xvec_buf, i_bh, NT, i_c, real, sd, sd_ok,
                sv, sv_ok, xv, xv_ok, rr, rr_ok, rx, rx_ok, D: tl.constexpr, DV: tl.constexpr,
                NORMALIZE: tl.constexpr):
    """A scan step's inputs at chunk i_c, as stored (zeros where not real or past the true
    dims): the program's blocks of a D x D and a D x DV buffer (offsets sd, sv), its block
    of X (xv), and the normalize vectors' entries rr and X column entries rx.
    The scans load them one step ahead: no load depends on the carried state, so the next
    step's memory latency overlaps this step's work."""
    base = (i_bh * NT + i_c).to(tl.int64)
    b_dd = tl.load(dd_buf + base * D * D + sd, mask=real & sd_ok, other=0.0)
    b_dv = tl.load(dv_buf + base * D * DV + sv, mask=real & sv_ok, other=0.0)
    b_x = tl.load(x_buf + base * D * DV + xv, mask=real & xv_ok, other=0.0)
    if NORMALIZE:
        b_vec = tl.load(vec_buf + base * D + rr, mask=real & rr_ok, other=0.0)
        b_xvec = tl.load(xvec_buf + base * D + rx, mask=real & rx_ok, other=0.0)
    else:
        b_vec = tl.zeros(rr.shape, dtype=tl.float32)
        b_xvec = tl.zeros(rx.shape, dtype=tl.float32)
    return b_dd, b_dv, b_x, b_vec, b_xvec


@triton.jit
def state_scan_kernel(ds_buf, x_buf, da_buf, xn_buf, an_buf, s_out, a_out, an_out, log2g,
                      s_init, a_init, an_init, s_final, a_final, an_final, xp_final, xpn_final,
                      T, NT,
                      SEG: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                      PD: tl.constexpr, PDV: tl.constexpr, CL: tl.constexpr,
                      BD: tl.constexpr, BC: tl.constexpr, HAS_DECAY: tl.constexpr,
                      HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
                      SUMMARY: tl.constexpr, NORMALIZE: tl.constexpr, PREC: tl.constexpr,
                      IN_PLACE: tl.constexpr):
    """Exclusive scan over steps of CL tokens (chunks, or segments of chunks):
    S_{c+1} = G S_c + dS, A_{c+1} = G^2 A_c + S_c X + dA. Grid (PD // BD * PDV // BC, NSEG,
    B*H): a block of BD state rows and BC value columns (the program's A columns need its
    S rows in full and X at its columns only; S and the normalize vector are carried by
    every column block and written by the first), and segment i_s, steps
    [i_s SEG, i_s SEG + SEG) of NT. Head dims D, DV are held in blocks of PD, PDV (powers of
    two): entries past them load as zero and are not stored. Start and end states live at
    [B*H, NSEG] in s_init/a_init and s_final/a_final.
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
    NCB: tl.constexpr = PDV // BC
    pid, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_r, i_v = pid // NCB, pid % NCB
    first = i_v == 0  # the column block that writes S and the normalize vector
    lg = _log2_decay(log2g, i_bh % H, HAS_DECAY)
    rr, rd, rv = i_r * BD + tl.arange(0, BD), tl.arange(0, PD), i_v * BC + tl.arange(0, BC)
    sd, sv = _mat_offsets(rr, rd, D), _mat_offsets(rr, rv, DV)
    xv = _mat_offsets(rd, rv, DV)
    sd_ok, sv_ok = _tile_ok(rr, rd, D, PD, D, PD), _tile_ok(rr, rv, D, PD, DV, PDV)
    xv_ok = _tile_ok(rd, rv, D, PD, DV, PDV)
    rr_ok, rd_ok = _dim_ok(rr, D, PD), _dim_ok(rd, D, PD)
    state = (i_bh * tl.num_programs(1) + i_s).to(tl.int64)
    b_s, b_a, b_an = _start_rows(s_init, a_init, an_init, state, sd, sd_ok, sv, sv_ok, rr,
                                 rr_ok, HAS_INIT, NORMALIZE, D, DV)
    b_xp = tl.zeros([PD, BC], dtype=tl.float32)
    b_xpn = tl.zeros([PD], dtype=tl.float32)
    b_gamma = 1.0
    if IN_PLACE:
        n_ds, n_da, n_x, n_dan, n_xn = _step_loads(ds_buf, da_buf, x_buf, an_buf, xn_buf, i_bh,
                                                   NT, i_s * SEG, i_s * SEG < NT, sd, sd_ok,
                                                   sv, sv_ok, xv, xv_ok, rr, rr_ok, rd, rd_ok,
                                                   D, DV, NORMALIZE)
    for j in range(SEG):
        i_c = i_s * SEG + j
        real = i_c < NT  # steps past NT load zeros and leave the state as it is
        if IN_PLACE:
            b_ds, b_da, b_x, b_dan, b_xn = n_ds, n_da, n_x, n_dan, n_xn
        else:
            b_ds, b_da, b_x, b_dan, b_xn = _step_loads(ds_buf, da_buf, x_buf, an_buf, xn_buf,
                                                       i_bh, NT, i_c, real, sd, sd_ok, sv,
                                                       sv_ok, xv, xv_ok, rr, rr_ok, rd, rd_ok,
                                                       D, DV, NORMALIZE)
        base = (i_bh * NT + i_c).to(tl.int64)
        if not SUMMARY:
            if IN_PLACE:
                _overwrite_barrier()
            tl.store(s_out + base * D * D + sd, b_s.to(s_out.dtype.element_ty),
                     mask=real & first & sd_ok)
            tl.store(a_out + base * D * DV + sv, b_a.to(a_out.dtype.element_ty),
                     mask=real & sv_ok)
            if NORMALIZE:
                tl.store(an_out + base * D + rr, b_an, mask=real & first & rr_ok)
        if IN_PLACE:  # the next step's loads, after this step's in-place stores (a barrier
            # orders those)
            n_ds, n_da, n_x, n_dan, n_xn = _step_loads(ds_buf, da_buf, x_buf, an_buf, xn_buf,
                                                       i_bh, NT, i_c + 1,
                                                       (j + 1 < SEG) & (i_c + 1 < NT), sd,
                                                       sd_ok, sv, sv_ok, xv, xv_ok, rr, rr_ok,
                                                       rd, rd_ok, D, DV, NORMALIZE)
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
        tl.store(s_final + state * D * D + sd, b_s, mask=first & sd_ok)
        tl.store(a_final + state * D * DV + sv, b_a, mask=sv_ok)
        if NORMALIZE:
            tl.store(an_final + state * D + rr, b_an, mask=first & rr_ok)
        if SUMMARY:
            if i_r == 0:
                tl.store(xp_final + state * D * DV + xv, b_xp, mask=xv_ok)
                if NORMALIZE:
                    tl.store(xpn_final + state * D + rd, b_xpn, mask=first & rd_ok)


@triton.jit
def grad_scan_kernel(qdo_buf, z_buf, x_buf, qn_buf, xn_buf, log2g, gs_final, ga_final,
                     gan_final, gs_init, ga_init, gan_init, xq_init, xqn_init, ga_out, gan_out,
                     T, NT,
                     SEG: tl.constexpr, H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                     PD: tl.constexpr, PDV: tl.constexpr, CL: tl.constexpr,
                     BD: tl.constexpr, BC: tl.constexpr, HAS_DECAY: tl.constexpr,
                     HAS_FINAL_GRAD: tl.constexpr, STORE_INIT_GRAD: tl.constexpr,
                     SUMMARY: tl.constexpr, NORMALIZE: tl.constexpr, PREC: tl.constexpr):
    """Reverse scan of the state gradients. With gA, gS the gradients w.r.t. a step's
    outgoing state: incoming gA = G^2 gA + Q^T b^2 dO, incoming gS = G gS + Z + gA X^T.
    Grid (PD // BD * PD // BC, NSEG, B*H): a block of BD state rows and BC columns of gS
    (gS's columns need gA's rows in full and X's rows at those columns only; gA and the
    normalize vector are carried by every column block and written by the first),
    segments as in state_scan_kernel; end-of-segment gradients at [B*H, NSEG] in
    gs_final/ga_final, start-of-segment ones in gs_init/ga_init.
    SUMMARY=False: each step's outgoing gS overwrites its Z slot, and its gA (ga) goes to
    ga_out (gan_out): the Q^T b^2 dO (qn) buffers themselves, or, where gS's columns are
    split over programs (the other column blocks still read Q^T b^2 dO), buffers of their
    own.
    SUMMARY=True: from zero, nothing in place; stores the local incoming gradients and
    Xq = sum_c (G^2 of the later steps)_c (G of the earlier steps) X_c, so an end
    gradient (gS', gA') adds Gamma gS' + gA' Xq^T and Gamma^2 gA'. NORMALIZE carries the
    denominator column of gA (vector gan, increments qn, X column xn; xqn its Xq column)."""
    NCB: tl.constexpr = PD // BC
    pid, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_r, i_k = pid // NCB, pid % NCB
    first = i_k == 0  # the column block that writes gA and the normalize vector
    lg = _log2_decay(log2g, i_bh % H, HAS_DECAY)
    rr, rk, rv = i_r * BD + tl.arange(0, BD), i_k * BC + tl.arange(0, BC), tl.arange(0, PDV)
    sd, sv = _mat_offsets(rr, rk, D), _mat_offsets(rr, rv, DV)
    xv = _mat_offsets(rk, rv, DV)
    sd_ok, sv_ok = _tile_ok(rr, rk, D, PD, D, PD), _tile_ok(rr, rv, D, PD, DV, PDV)
    xv_ok = _tile_ok(rk, rv, D, PD, DV, PDV)
    rr_ok, rk_ok = _dim_ok(rr, D, PD), _dim_ok(rk, D, PD)
    state = (i_bh * tl.num_programs(1) + i_s).to(tl.int64)
    b_gs, b_ga, b_gan = _start_rows(gs_final, ga_final, gan_final, state, sd, sd_ok, sv, sv_ok,
                                    rr, rr_ok, HAS_FINAL_GRAD, NORMALIZE, D, DV)
    b_xq = tl.zeros([BC, PDV], dtype=tl.float32)
    b_xqn = tl.zeros([BC], dtype=tl.float32)
    b_gamma2 = 1.0
    last = i_s * SEG + SEG - 1
    n_z, n_qdo, n_x, n_qn, n_xn = _step_loads(z_buf, qdo_buf, x_buf, qn_buf, xn_buf, i_bh, NT,
                                              last, last < NT, sd, sd_ok, sv, sv_ok, xv, xv_ok,
                                              rr, rr_ok, rk, rk_ok, D, DV, NORMALIZE)
    for j in range(SEG):
        i_c = last - j
        real = i_c < NT  # steps past NT load zeros and leave the gradients as they are
        b_z, b_qdo, b_x, b_qn, b_xn = n_z, n_qdo, n_x, n_qn, n_xn
        base = (i_bh * NT + i_c).to(tl.int64)
        if not SUMMARY:
            _overwrite_barrier()
            tl.store(z_buf + base * D * D + sd, b_gs.to(z_buf.dtype.element_ty),
                     mask=real & sd_ok)
            tl.store(ga_out + base * D * DV + sv, b_ga.to(ga_out.dtype.element_ty),
                     mask=real & first & sv_ok)
            if NORMALIZE:
                tl.store(gan_out + base * D + rr, b_gan, mask=real & first & rr_ok)
        # the next step's loads, after this step's in-place stores (a barrier orders those)
        n_z, n_qdo, n_x, n_qn, n_xn = _step_loads(z_buf, qdo_buf, x_buf, qn_buf, xn_buf, i_bh,
                                                  NT, i_c - 1, (j + 1 < SEG) & (i_c - 1 < NT),
                                                  sd, sd_ok, sv, sv_ok, xv, xv_ok, rr, rr_ok,
                                                  rk, rk_ok, D, DV, NORMALIZE)
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
        tl.store(gs_init + state * D * D + sd, b_gs, mask=sd_ok)
        tl.store(ga_init + state * D * DV + sv, b_ga, mask=first & sv_ok)
        if NORMALIZE:
            tl.store(gan_init + state * D + rr, b_gan, mask=first & rr_ok)
        if SUMMARY:
            if i_r == 0:
                tl.store(xq_init + state * D * DV + xv, b_xq, mask=xv_ok)
                if NORMALIZE:
                    tl.store(xqn_init + state * D + rk, b_xqn, mask=rk_ok)


def _summaries(buf, NSEG, *cols):
    """[B*H, NSEG, D, cols] fp32 segment summaries, one per entry of cols (None: [.., D])."""
    BH, _, D, _ = buf.shape
    return [buf.new_empty(BH, NSEG, D, *(() if c is None else (c,)), dtype=torch.float32)
            for c in cols]


def _scan_launch(shape, scan_plan, warps, width):
    """(program blocks along grid axis 0, launch options) of a scan (which takes the step
    length CL instead of C): row blocks times column blocks of the padded `width` (the
    value block PDV for the state scan, the key block PD for the gradient scan; the whole
    width where the plan gives no column block)."""
    cols = scan_plan.cols or width
    blocks = shape["PD"] // scan_plan.rows * (width // cols)
    return blocks, dict(num_warps=warps, BD=scan_plan.rows, BC=cols,
                        **{k: v for k, v in shape.items() if k != "C"})


def _scan_states(inc, lg, init, final, T, shape, plan, out=None):
    """Carried states from the increments inc = (dS, X, dA, Xn, An) (Xn, An: the denominator
    column vectors with normalize, else stand-ins): into out = (S, A, An) buffers of their
    own when given, else over the increments (in place); final state into final =
    (S1, A1, a1) when given, starting from init = (S0, A0, a0) when given. In two levels
    where plan.state_scan says so: segment summaries, a scan over them, a rescan per
    segment."""
    ds, x, da, xn, an = inc
    BH, NT, D, DV = da.shape
    C, scan_plan = plan.chunk, plan.state_scan
    SEG, NSEG = scan_plan.seg, scan_plan.n_seg
    # with value-column blocks every block reads dS, which the first one's S would
    # overwrite: the states go to buffers of their own (plan_unfit_reason checks out)
    split = scan_plan.cols is not None
    blocks, launch = _scan_launch(shape, scan_plan, plan.warps, shape["PDV"])

    def scan(n_seg, bufs, out, init, final, xp, n, seg, cl, summary):
        in_place = (bufs[0], bufs[2], bufs[4])
        state_scan_kernel[(blocks, n_seg, BH)](
            *bufs, *(out or in_place), lg, *(init or in_place), *(final or in_place),
            *(xp or bufs[1:4:2]), T, n, SEG=seg, CL=cl, HAS_INIT=init is not None,
            STORE_FINAL=final is not None, SUMMARY=summary,
            IN_PLACE=out is None, **launch)

    if NSEG == 1:
        return scan(1, inc, out, init, final, None, NT, _loop_bound(NT), C, False)
    s_seg, x_seg, a_seg = _summaries(da, NSEG, D, DV, DV)
    xn_seg, an_seg = _summaries(da, NSEG, None, None) if shape["NORMALIZE"] else (xn, an)
    scan(NSEG, inc, out, None, (s_seg, a_seg, an_seg), (x_seg, xn_seg), NT, SEG, C, True)
    starts = (s_seg, a_seg, an_seg)
    if split:  # the chain's start states to buffers of their own too
        starts = (*_summaries(da, NSEG, D, DV),
                  *(_summaries(da, NSEG, None) if shape["NORMALIZE"] else (an,)))
    scan(1, (s_seg, x_seg, a_seg, xn_seg, an_seg), starts if split else None, init, final,
         None, NSEG, _loop_bound(NSEG), SEG * C, False)
    scan(NSEG, inc, out, starts, None, None, NT, SEG, C, False)


def _scan_grads(inc, lg, final, init, T, shape, plan):
    """Outgoing-state gradients from inc = (Q^T b^2 dO, Z, X, Qn, Xn) (Qn, Xn: the
    denominator column vectors with normalize, else stand-ins), starting from the final-state
    gradients final = (gS1, gA1, ga1) when given; initial-state gradients into init when
    given; in two levels where plan.grad_scan says so. gS is written over Z; gA and ga over
    Q^T b^2 dO and Qn, or, where the plan splits gS's columns over programs, into buffers of
    their own. Returns the (gA, ga) buffers."""
    qdo, z, x, qn, xn = inc
    BH, NT, D, DV = qdo.shape
    C, scan_plan = plan.chunk, plan.grad_scan
    SEG, NSEG = scan_plan.seg, scan_plan.n_seg
    blocks, launch = _scan_launch(shape, scan_plan, plan.warps, shape["PD"])
    split = scan_plan.cols is not None  # every column block reads Q^T b^2 dO and Qn

    def own(like, vec):  # (gA, ga) buffers of their own, like `like` and `vec`
        return (torch.empty_like(like), torch.empty_like(vec) if shape["NORMALIZE"] else vec)

    def scan(n_seg, bufs, final, init, xq, n, seg, cl, summary, out=None):
        in_place = (bufs[1], bufs[0], bufs[3])
        grad_scan_kernel[(blocks, n_seg, BH)](
            *bufs, lg, *(final or in_place), *(init or in_place), *(xq or bufs[2::2]),
            *(out or (bufs[0], bufs[3])), T, n, SEG=seg, CL=cl,
            HAS_FINAL_GRAD=final is not None, STORE_INIT_GRAD=init is not None,
            SUMMARY=summary, **launch)

    out = own(qdo, qn) if split else (qdo, qn)
    if NSEG == 1:
        scan(1, inc, final, init, None, NT, _loop_bound(NT), C, False, out)
        return out
    gs_seg, xq_seg, ga_seg = _summaries(qdo, NSEG, D, DV, DV)
    xqn_seg, gan_seg = _summaries(qdo, NSEG, None, None) if shape["NORMALIZE"] else (xn, qn)
    scan(NSEG, inc, None, (gs_seg, ga_seg, gan_seg), (xq_seg, xqn_seg), NT, SEG, C, True)
    ends = own(ga_seg, gan_seg) if split else (ga_seg, gan_seg)
    scan(1, (ga_seg, gs_seg, xq_seg, gan_seg, xqn_seg), final, init, None, NSEG,
         _loop_bound(NSEG), SEG * C, False, ends)
    scan(NSEG, inc, (gs_seg, *ends), None, None, NT, SEG, C, False, out)
    return out
