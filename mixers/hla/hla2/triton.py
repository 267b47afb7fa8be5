"""Fused Triton forms of masked hla2 (spec §4): a differentiable chunked op and a decode step.

Forward, 3 launches: chunk increments (grid NT x B*H), state scan (grid D/rows x B*H, a loop
over the NT chunks; 16 rows per program, more when programs are plenty: see WIDE_SCAN),
output (grid Dv/BV x NT C/BT x B*H: BV from OUTPUT_BV, BT from OUTPUT_ROWS). Backward, 3-4
launches: the gradient terms Q^T dO and Q^T P Q per chunk, a reverse scan of the state
gradients, and dq/dk/dv (one launch, two from head dim 128). The backward reads each chunk's
start states and X from the forward, which keeps them (recomputing them would take another
increments launch and state scan; keeping them costs the per-chunk buffers below). When its
16-row programs cannot fill the GPU (B = 1 at 64k tokens), a scan runs in two levels:
segments of chunks summarise themselves in parallel (grid D/16 x NSEG x B*H), a short scan
chains the summaries, and the segments rescan from their start states (see _segments). A forward
alone at chunk 128 and head dim 128 takes its own paths (HALVES_FROM_CHUNK): increments in
two halves of tokens, the output's late state loads, and the states scanned into buffers of
their own (2 more per-chunk buffers).
Memory: per-chunk [D, D] and [D, Dv] buffers per head, bf16 for bf16 inputs (as many
elements per token as q when C = D): the forward's 3 (states S, A and X) are kept for
backward, which adds 2 (normalize adds fp32 [D] vectors per chunk, and a [B, T, H] fp32
denominator); segment summaries are fp32 and small. Scan loop bounds are powers of two
(masked past the chunk count), so a sweep over T compiles them once per power-of-two bucket
(see triton_kernels.py, which also holds the math).

decay_form="paper" (spec §4.3: S, C and G = g G + k k^T C_prev) runs its own, simpler
kernels (see triton_kernels.py): one program per (batch, head) walks the chunks in order with
the states in registers, forward 1 launch (grid B*H), backward 2 (the walk again storing each
chunk's start states, then a reverse walk carrying the state gradients and writing
dq/dk/dv); each program takes PAPER_BV value columns (grid Dv/PAPER_BV x B*H; backward
sums the slices' dq, dk and dS0 parts). Normalize is a ones column appended to v (padded to
a power of two) and divided out here; chunks of at most PAPER_CHUNK tokens. Sequential over
chunks: simple and not tuned (hla2's impl="auto" keeps the PyTorch chunk form for it).

Supported: masked hla2, no decay, decay_form="masked" or "paper" (per-head decay),
normalize (masked form: the denominator is a ones value column carried as [D] vectors next
to A in the same launches), initial_state with gradients, output_final_state, any T,
Dv != D, head dims 16/32/64/128, fp16/bf16/fp32 inputs, multi-query (k, v with one head:
broadcast to the query heads, S returned once).
Not supported (the dispatcher falls back): masked=False, ridge != 0, the paper decay form
above head dim 64 (PAPER_MAX_HEAD_DIM).
fp16 inputs feed the carried state S to fp16 matmuls, which overflow once S exceeds 65504
(long sequences of large keys); prefer bf16.
Non-finite inputs follow the rule of mixers/hla/common.py inside the kernels (see
triton_kernels.py); normalize's division passes a zero upstream gradient at a poisoned
output on as zero (_normalize_grads).
"""

from __future__ import annotations

import functools
import os

import torch

from mixers.hla.hla2 import triton_kernels as kern

HEAD_DIMS = (16, 32, 64, 128)
CHUNK_SIZES = (16, 32, 64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# Host-side integer helpers: triton.cdiv and triton.next_power_of_2 are jit functions whose
# Python calls cost microseconds each, and the launch path makes about twenty of them.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_unsupported_reason(q, k, v, *, masked, ridge, decay_form, decay) -> str | None:
    """None when the Triton kernels can run these inputs and options, else why not."""
    if not masked:
        return "the Triton kernels implement masked hla2 only (masked=False)"
    if ridge != 0:
        return "the Triton kernels do not implement ridge != 0"
    if q.device.type != "cuda" and not _interpreted():
        return f"the Triton kernels need a CUDA device (got {q.device}) or TRITON_INTERPRET=1"
    if q.dtype not in DTYPES:
        return f"the Triton kernels support float16, bfloat16 and float32, got {q.dtype}"
    if k.shape[2] not in (1, q.shape[2]):
        return f"k and v must have {q.shape[2]} heads or one shared head, got {k.shape[2]}"
    if q.shape[-1] not in HEAD_DIMS or v.shape[-1] not in HEAD_DIMS:
        return (f"the Triton kernels need head dims in {HEAD_DIMS}, got D={q.shape[-1]}, "
                f"Dv={v.shape[-1]}")
    if decay is not None and decay_form == "paper" and q.shape[-1] > PAPER_MAX_HEAD_DIM:
        return (f"the paper decay form's Triton kernels need head dim <= {PAPER_MAX_HEAD_DIM} "
                f"(at 128 they need 346 KiB of shared memory, an H100 or H200 has 227), "
                f"got D={q.shape[-1]}")
    return None


def _precision(dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


# decay_form="paper": its kernels multiply fp32 operands (states, decayed products) whose
# terms cancel (o = Y C0 - b Q G0 + M V), so in plain fp32 (no tensor cores): TF32 gives
# about 4e-2 relative error with normalize in bf16, and Triton 3.6's 3xTF32 builds (fp32
# products on tensor cores) make illegal memory accesses at head dim 64.
PAPER_PREC = "ieee"
# decay_form="paper": the largest head dim whose kernels fit an H100/H200's shared memory in
# plain fp32 (at 128 they do not launch).
PAPER_MAX_HEAD_DIM = 64


# The scans' launch shape on sm_90: 8 warps and 16-row blocks keep the scan kernels free of
# register spills at D = Dv = 64 (little at 128), with their next step's inputs loaded ahead,
# at few enough registers that two programs fit an SM. The per-chunk kernels (increments,
# output, dq/dk/dv) pick their warps by autotuning (see triton_kernels.py).
WARPS, SCAN_ROWS = 8, 16
# Scans with programs to spare take wider row blocks: each program loads the whole [D, Dv] X
# at every step, so fewer, wider programs move less data. (rows, waves) of the state scan and
# of the gradient scan: the rows they take once a one-level scan in SCAN_ROWS-row blocks
# would need that many waves of resident programs (under a wave, wider blocks only leave SMs
# idle; the gradient scan's 64-row blocks pay from 4 waves on).
WIDE_SCAN = ((32, 1), (64, 4))
# Chunks of at least this many tokens (the 16-bit forward alone at head dim 128 runs 128)
# compute the increments in two halves of tokens (W's zero block skipped, 4 warps tuned in,
# two programs per SM), load the carried states late in the output kernel (less shared
# memory at once), and, without a backward pass to keep the states for, scan into state
# buffers of their own (no barrier in the scan's loop, so Triton pipelines its loads and the
# program fits 128 registers). These pay at chunk 128 only: at chunk 64 the halves' 32-token
# products cost more than the skipped block saves. Only at head dims (D and Dv) of 128: in
# bf16 at D = Dv = 16 the output kernel with late state loads makes an illegal memory access.
HALVES_FROM_CHUNK = 128
# From this head dim on, dq, dk and dv are computed by the launches in SPLIT_GRADS (each
# string names the gradients of one launch): fewer register spills. Each launch recomputes
# the chunk's shared terms, so two launches, not three.
SPLIT_GRADS_FROM, SPLIT_GRADS = 128, ("qk", "v")
# decay_form="paper": chunk size of its sequential walk (one program per head holds every
# state and chunk temporary: smaller chunks keep the registers in bounds; at 16 tokens and 32
# value columns the D = 64 forward does not spill, and chunks of 32 spill more).
PAPER_CHUNK = 16
# decay_form="paper": value columns per program (C, G, O columns are independent; backward
# sums the per-slice parts of dq, dk and dS0).
PAPER_BV = 32
# Value columns per program of the output kernel, 16-bit and fp32 inputs: each program
# recomputes the chunk's [C, C] mixing matrix, so wider slices repeat less work; fp32
# operands take twice the shared memory, so half as many columns.
OUTPUT_BV = {2: 128, 4: 64}
# Query rows per program of the output kernel: a chunk of 128 runs as two programs of 64 rows
# (the second also mixes with the first half), skipping the zero upper blocks of its C x C
# products.
OUTPUT_ROWS = 64
# State rows per program of the increments and gradient-terms kernels (at most D; chunks
# above 64 keep all D): each row block recomputes the chunk's [C, Dv] mixed values, so
# smaller blocks trade repeated work for more, smaller programs: the increments at D = 128
# run in two blocks of 64 rows, the gradient terms in one block (two cost more than they
# save there), and chunks above 64 in one block.
INCREMENTS_ROWS, GRAD_TERMS_ROWS = 64, 128


def _chunk_128_paths(C: int, D: int, DV: int) -> bool:
    """Whether a forward takes the chunk-128 paths (see HALVES_FROM_CHUNK)."""
    return C >= HALVES_FROM_CHUNK and min(D, DV) >= 128


def _chunk_buffers(B, H, NT, D, DV, q, n_dd, n_dv):
    """Per-chunk [D, D] and [D, DV] buffers: bf16 for bf16 inputs (memory), else fp32
    (fp16 would overflow: S grows with the sequence length)."""
    kw = dict(dtype=torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32,
              device=q.device)
    return ([torch.empty(B * H, NT, D, D, **kw) for _ in range(n_dd)]
            + [torch.empty(B * H, NT, D, DV, **kw) for _ in range(n_dv)])


@functools.lru_cache
def _resident_programs(device: torch.device, D: int) -> int:
    """About how many scan programs the device runs at once (8 warps each: two fit an SM's
    registers at D <= 64, one at D = 128). Off CUDA (the interpreter) the count of an H200,
    132 SMs."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count \
        if device.type == "cuda" else 132
    return sms * (2 if D <= 64 else 1)


def _segments(NT, row_programs, resident):
    """(chunks per segment, segment count) for a scan over NT chunks whose single level
    would run row_programs programs. Each scan step is a dependent load + matmul, so the
    time goes as waves x steps: one level costs ceil(P / R) NT, two levels (twice the
    memory passes) 2 ceil(P NSEG / R) SEG + NSEG. Picks the cheapest power-of-two SEG, so
    that B = 1 at 64k tokens fills the GPU while batches that already fill it keep one
    level."""
    def waves(programs):
        return -(-programs // resident)

    best, best_cost = (NT, 1), waves(row_programs) * NT
    n_seg = 2
    while n_seg <= NT // 2:
        seg = _pow2(_cdiv(NT, n_seg))  # few compiles over T
        used = _cdiv(NT, seg)
        cost = 2 * waves(row_programs * used) * seg + used
        if cost < best_cost:
            best, best_cost = (seg, used), cost
        n_seg *= 2
    return best


def _size_class(programs: int) -> int:
    """The autotune bucket of a launch of `programs` programs (see triton_kernels._SHAPE_KEY)."""
    return programs.bit_length()


def _loop_bound(n):
    """The scans loop to a power of two (masked past n): one compile per bucket, not per T."""
    return _pow2(n)


def _summaries(buf, NSEG, *cols):
    """[B*H, NSEG, D, cols] fp32 segment summaries, one per entry of cols (None: [.., D])."""
    BH, _, D, _ = buf.shape
    return [buf.new_empty(BH, NSEG, D, *(() if c is None else (c,)), dtype=torch.float32)
            for c in cols]


def _scan_plan(NT, D, BH, device, wide):
    """(rows per program, chunks per segment, segment count) of a scan over NT chunks:
    wide = (rows, waves) from WIDE_SCAN, taken when SCAN_ROWS-row programs would need that
    many waves, else SCAN_ROWS rows and, where those programs cannot fill the GPU, two
    levels (see _segments)."""
    resident = _resident_programs(device, D)
    programs = D // SCAN_ROWS * BH
    wide_rows, waves = wide
    if programs >= waves * resident:
        return min(wide_rows, D), NT, 1
    return (SCAN_ROWS, *_segments(NT, programs, resident))


def _scan_launch(shape, rows):
    """Launch options of the scans (which take the step length CL instead of C)."""
    return dict(num_warps=WARPS, BD=rows, **{k: v for k, v in shape.items() if k != "C"})


def _scan_states(inc, lg, init, final, T, C, shape, out=None):
    """Carried states from the increments inc = (dS, X, dA, Xn, An) (Xn, An: the denominator
    column vectors with normalize, else stand-ins): into out = (S, A, An) buffers of their
    own when given, else over the increments (in place); final state into final =
    (S1, A1, a1) when given, starting from init = (S0, A0, a0) when given. Long sequences:
    segment summaries, a scan over them, a rescan per segment."""
    ds, x, da, xn, an = inc
    BH, NT, D, DV = da.shape
    rows, SEG, NSEG = _scan_plan(NT, D, BH, da.device, WIDE_SCAN[0])
    launch = _scan_launch(shape, rows)

    def scan(n_seg, bufs, out, init, final, xp, n, seg, cl, summary):
        in_place = (bufs[0], bufs[2], bufs[4])
        kern.state_scan_kernel[(D // rows, n_seg, BH)](
            *bufs, *(out or in_place), lg, *(init or in_place), *(final or in_place),
            *(xp or bufs[1:4:2]), T, n, SEG=seg, CL=cl, HAS_INIT=init is not None,
            STORE_FINAL=final is not None, SUMMARY=summary,
            IN_PLACE=out is None, **launch)

    if NSEG == 1:
        return scan(1, inc, out, init, final, None, NT, _loop_bound(NT), C, False)
    s_seg, x_seg, a_seg = _summaries(da, NSEG, D, DV, DV)
    xn_seg, an_seg = _summaries(da, NSEG, None, None) if shape["NORMALIZE"] else (xn, an)
    scan(NSEG, inc, out, None, (s_seg, a_seg, an_seg), (x_seg, xn_seg), NT, SEG, C, True)
    scan(1, (s_seg, x_seg, a_seg, xn_seg, an_seg), None, init, final, None, NSEG,
         _loop_bound(NSEG), SEG * C, False)
    scan(NSEG, inc, out, (s_seg, a_seg, an_seg), None, None, NT, SEG, C, False)


def _scan_grads(inc, lg, final, init, T, C, shape):
    """Outgoing-state gradients written over inc = (Q^T b^2 dO, Z, X, Qn, Xn) (Qn, Xn: the
    denominator column vectors with normalize, else stand-ins), starting from the final-state
    gradients final = (gS1, gA1, ga1) when given; initial-state gradients into init when
    given."""
    qdo, z, x, qn, xn = inc
    BH, NT, D, DV = qdo.shape
    rows, SEG, NSEG = _scan_plan(NT, D, BH, qdo.device, WIDE_SCAN[1])
    launch = _scan_launch(shape, rows)

    def scan(n_seg, bufs, final, init, xq, n, seg, cl, summary):
        in_place = (bufs[1], bufs[0], bufs[3])
        kern.grad_scan_kernel[(D // rows, n_seg, BH)](
            *bufs, lg, *(final or in_place), *(init or in_place), *(xq or bufs[2::2]), T, n,
            SEG=seg, CL=cl, HAS_FINAL_GRAD=final is not None,
            STORE_INIT_GRAD=init is not None, SUMMARY=summary, **launch)

    if NSEG == 1:
        return scan(1, inc, final, init, None, NT, _loop_bound(NT), C, False)
    gs_seg, xq_seg, ga_seg = _summaries(qdo, NSEG, D, DV, DV)
    xqn_seg, gan_seg = _summaries(qdo, NSEG, None, None) if shape["NORMALIZE"] else (xn, qn)
    scan(NSEG, inc, None, (gs_seg, ga_seg, gan_seg), (xq_seg, xqn_seg), NT, SEG, C, True)
    scan(1, (ga_seg, gs_seg, xq_seg, gan_seg, xqn_seg), final, init, None, NSEG,
         _loop_bound(NSEG), SEG * C, False)
    scan(NSEG, inc, (gs_seg, ga_seg, gan_seg), None, None, NT, SEG, C, False)


def _den_vectors(q, NT, n, normalize):
    """n [B*H, NT, D] fp32 buffers for the denominator column (normalize), else stand-ins."""
    B, _, H, D = q.shape
    if not normalize:
        return [q] * n
    return [q.new_empty(B * H, NT, D, dtype=torch.float32) for _ in range(n)]


def _forward(q, k, v, log2g, init, C, want_final, normalize, eps, keep_states):
    """(o, den, final, chunk states): chunk states = (S, X, A, Xn, An), each chunk's start
    states S, A (An: the denominator column of A) and its X (Xn). keep_states (for the
    backward pass): the states overwrite the increments, which takes no extra memory."""
    B, T, H, D = q.shape
    DV = v.shape[-1]
    NT = _cdiv(T, C)
    prec = _precision(q.dtype)
    shape = dict(H=H, D=D, DV=DV, C=C, HAS_DECAY=log2g is not None, NORMALIZE=normalize,
                 PREC=prec)
    lg = q if log2g is None else log2g
    halves = _chunk_128_paths(C, D, DV)
    ds, x, da = _chunk_buffers(B, H, NT, D, DV, q, 1, 2)
    xn, an = _den_vectors(q, NT, 2, normalize)
    rows = D if C > 64 else min(D, INCREMENTS_ROWS)
    kern.chunk_increments_kernel[(D // rows, NT, B * H)](
        q, k, v, lg, ds, x, da, xn, an, T, NT, _size_class(D // rows * NT * B * H), BR=rows,
        HALVES=halves and rows == D and C >= 32, **shape)  # halves: all rows, 16+ tokens
    final = None
    if want_final:
        final = (q.new_empty(B, H, D, D, dtype=torch.float32),
                 q.new_empty(B, H, D, DV, dtype=torch.float32),
                 q.new_empty(B, H, D, dtype=torch.float32) if normalize else q)
    states = None
    if halves and not keep_states:
        states = (torch.empty_like(ds), torch.empty_like(da),
                  torch.empty_like(an) if normalize else an)
    _scan_states((ds, x, da, xn, an), lg, init, final, T, C, shape, states)
    if states is not None:
        ds, da, an = states
    o = torch.empty_like(v, dtype=q.dtype)
    den = q.new_empty(B, T, H, dtype=torch.float32) if normalize else q
    BV = min(DV, OUTPUT_BV[q.element_size()])
    BT = min(C, OUTPUT_ROWS)
    kern.chunk_output_kernel[(DV // BV, NT * C // BT, B * H)](
        q, k, v, lg, ds, da, an, o, den, eps, T, NT, _size_class(DV // BV * NT * C // BT * B * H),
        BT=BT, BV=BV, LATE_STATES=halves, **shape)
    return o, den, final, (ds, x, da, xn, an)


def _backward(q, k, v, log2g, states, do, dden, final_grads, C, want_init_grad):
    """dq, dk, dv (and the initial-state gradients) from the forward's chunk states."""
    B, T, H, D = q.shape
    DV = v.shape[-1]
    NT = _cdiv(T, C)
    normalize = dden is not None
    prec = _precision(q.dtype)
    shape = dict(H=H, D=D, DV=DV, C=C, HAS_DECAY=log2g is not None, NORMALIZE=normalize,
                 PREC=prec)
    lg = q if log2g is None else log2g
    dden = q if dden is None else dden
    s, x, a, xn, an = states
    z, qdo = _chunk_buffers(B, H, NT, D, DV, q, 1, 1)
    qn, = _den_vectors(q, NT, 1, normalize)
    rows = D if C > 64 else min(D, GRAD_TERMS_ROWS)
    kern.chunk_grad_terms_kernel[(D // rows, NT, B * H)](
        q, v, do, dden, lg, qdo, z, qn, T, NT, _size_class(D // rows * NT * B * H), BR=rows,
        **shape)
    init_grads = None
    if want_init_grad:
        init_grads = (q.new_empty(B, H, D, D, dtype=torch.float32),
                      q.new_empty(B, H, D, DV, dtype=torch.float32),
                      q.new_empty(B, H, D, dtype=torch.float32) if normalize else q)
    _scan_grads((qdo, z, x, qn, xn), lg, final_grads, init_grads, T, C, shape)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for part in SPLIT_GRADS if max(D, DV) >= SPLIT_GRADS_FROM else ("qkv",):
        kern.chunk_grads_kernel[(NT, B * H)](
            q, k, v, do, dden, lg, s, a, z, qdo, an, qn, dq, dk, dv, T, NT,
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


def _masked_forward(q, k, v, s0, a0, an0, log2g, chunk_size, want_final, normalize, eps,
                    keep_states=True):
    """((o, S1, A1, a1), den, chunk states) of _HLA2Masked's forward; None for the final
    states not asked for (a1 without normalize)."""
    init = None if s0 is None else (s0, a0, an0 if normalize else q)
    o, den, final, states = _forward(q, k, v, log2g, init, chunk_size, want_final, normalize,
                                     eps, keep_states)
    s1, a1, an1 = (None, None, None) if final is None else final
    return (o, s1, a1, an1 if normalize else None), den, states


class _HLA2Masked(torch.autograd.Function):
    """(q, k, v, S0, A0, a0) -> (o, S1, A1, a1) for masked hla2 with optional per-head decay
    (given as log2 g, not differentiated); a0, a1: the denominator state with normalize,
    whose output o = numerator / (denominator + eps) comes from the same launches."""

    @staticmethod
    def forward(ctx, q, k, v, s0, a0, an0, log2g, chunk_size, want_final, normalize, eps):
        outputs, den, states = _masked_forward(q, k, v, s0, a0, an0, log2g, chunk_size,
                                               want_final, normalize, eps)
        saved = (outputs[0], den) if normalize else ()
        ctx.save_for_backward(q, k, v, log2g, *states, *saved)
        ctx.chunk_size, ctx.normalize, ctx.eps = chunk_size, normalize, eps
        return outputs

    @staticmethod
    def backward(ctx, do, gs1, ga1, gan1):
        q, k, v, log2g, *states = ctx.saved_tensors
        states, saved = states[:5], states[5:]
        D, DV = q.shape[-1], v.shape[-1]
        dden = None
        if ctx.normalize:  # o = n / (den + eps): dn = do / (den + eps), dden = -(do . o) / ..
            o, den = saved
            dn, dden = _normalize_grads(do, o, den, ctx.eps)
            do, dden = dn.to(q.dtype), dden.contiguous()
        want_init_grad = any(ctx.needs_input_grad[3:6])
        final_grads = _final_grads(q, D, DV, ctx.normalize, (gs1, ga1, gan1))
        dq, dk, dv, init_grads = _backward(q, k, v, log2g, states, do.contiguous(), dden,
                                           final_grads, ctx.chunk_size, want_init_grad)
        gs0, ga0, gan0 = (None, None, None) if init_grads is None else init_grads
        gan0 = gan0 if ctx.normalize and init_grads is not None else None
        return dq, dk, dv, gs0, ga0, gan0, None, None, None, None, None


def _normalize_grads(do, o, den, eps):
    """(dn, dden) of o = n / (den + eps) for the upstream do ([B, T, H, Dv], den [B, T, H]):
    dn = do / (den + eps), dden = -(do . o) / (den + eps), both fp32. NaN and inf entries
    of o and den (outputs poisoned by a non-finite input) pass no gradient on, so a zero
    upstream there stays zero instead of becoming 0 * NaN, and the inputs before the bad
    token keep their gradients (the non-finite rule); a NaN upstream still reaches dn and
    dden. Costs one more pass over o than the plain formulas."""
    scale = torch.where(torch.isfinite(den), 1.0 / (den + eps), 0.0)
    o = torch.nan_to_num(o.float(), nan=0.0, posinf=0.0, neginf=0.0)
    dden = -(do.float() * o).sum(-1) * scale
    return do.float() * scale.unsqueeze(-1), dden


class _Normalized(torch.autograd.Function):
    """o = n / (den + eps) with the backward of _normalize_grads (n [.., Dv], den [..])."""

    @staticmethod
    def forward(ctx, n, den, eps):
        o = n / (den + eps).unsqueeze(-1)
        ctx.save_for_backward(o, den)
        ctx.eps = eps
        return o

    @staticmethod
    def backward(ctx, do):
        o, den = ctx.saved_tensors
        dn, dden = _normalize_grads(do, o, den, ctx.eps)
        return dn.to(o.dtype), dden.to(den.dtype), None


def _paper_forward(q, k, v, log2g, init, C, want_final, want_out, want_states):
    """Run paper_forward_kernel: (o | None, (S1, C1, G1) | None, per-chunk start states |
    None)."""
    B, T, H, D = q.shape
    DV = v.shape[-1]
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
    BV = min(DV, PAPER_BV)
    kern.paper_forward_kernel[(DV // BV, B * H)](
        q, k, v, log2g, *(init or (q, q, q)), o, *(final or (q, q, q)), *(states or (q, q, q)),
        T, NT, H=H, D=D, DV=DV, BV=BV, C=C, NT_BOUND=_loop_bound(NT), HAS_INIT=init is not None,
        STORE_OUT=want_out, STORE_FINAL=want_final, STORE_STATES=want_states,
        PREC=PAPER_PREC, num_warps=WARPS)
    return (o if want_out else None), final, states


class _HLA2Paper(torch.autograd.Function):
    """(q, k, v, S0, C0, G0) -> (o, S1, C1, G1) for masked hla2 with the paper's decayed
    recurrence (log2 g per head, not differentiated). Forward: 1 launch; backward: 2 (the
    forward walk again storing each chunk's start states, then the reverse walk) plus the
    sums of the per-slice dq, dk (and dS0) parts."""

    @staticmethod
    def forward(ctx, q, k, v, s0, c0, g0, log2g, chunk_size, want_final):
        init = None if s0 is None else (s0, c0, g0)
        o, final, _ = _paper_forward(q, k, v, log2g, init, chunk_size, want_final, True, False)
        ctx.save_for_backward(q, k, v, s0, c0, g0, log2g)
        ctx.chunk_size = chunk_size
        return (o,) + (final or (None, None, None))

    @staticmethod
    def backward(ctx, do, gs1, gc1, gg1):
        q, k, v, s0, c0, g0, log2g = ctx.saved_tensors
        B, T, H, D = q.shape
        DV, C = v.shape[-1], ctx.chunk_size
        init = None if s0 is None else (s0, c0, g0)
        _, _, states = _paper_forward(q, k, v, log2g, init, C, False, False, True)
        final_grads = None
        if any(x is not None for x in (gs1, gc1, gg1)):
            shapes = [(B, H, D, D), (B, H, D, DV), (B, H, D, DV)]
            final_grads = tuple(q.new_zeros(shp, dtype=torch.float32) if x is None
                                else x.float().contiguous() for x, shp in zip((gs1, gc1, gg1),
                                                                               shapes))
        want_init_grad = s0 is not None and any(ctx.needs_input_grad[3:6])
        BV = min(DV, PAPER_BV)
        n_slices = DV // BV  # value-column slices: dq, dk and dS0 come in parts to sum
        init_grads = None
        if want_init_grad:
            init_grads = (s0.new_empty(n_slices, *s0.shape), torch.empty_like(c0),
                          torch.empty_like(g0))
        dq_parts, dk_parts = (q.new_empty(n_slices, *q.shape, dtype=torch.float32)
                              for _ in range(2))
        dv = torch.empty_like(v)
        kern.paper_backward_kernel[(n_slices, B * H)](
            q, k, v, do.contiguous(), log2g, *states, *(final_grads or (q, q, q)),
            *(init_grads or (q, q, q)), dq_parts, dk_parts, dv, T, _cdiv(T, C), H=H,
            D=D, DV=DV, BV=BV, C=C, NT_BOUND=_loop_bound(_cdiv(T, C)),
            HAS_FINAL_GRAD=final_grads is not None, STORE_INIT_GRAD=want_init_grad,
            PREC=PAPER_PREC, num_warps=WARPS)
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


def _hla2_paper(q, k, v, *, normalize, eps, decay, C, initial_state, output_final_state):
    """hla2_triton for decay_form="paper" (q, k, v contiguous with H heads each)."""
    B, T, H, D = q.shape
    DV = v.shape[-1]
    width = _pow2(DV + 1) if normalize else DV
    v_in = _paper_values(v, normalize, width)
    s0 = c0 = g0 = None
    if initial_state is not None:
        s0 = initial_state["S"].float().expand(B, H, D, D).contiguous()
        c0 = _paper_state(initial_state, "C", "m", normalize, width)
        g0 = _paper_state(initial_state, "G", "h", normalize, width)
    log2g = torch.log2(decay.float()).contiguous()
    o, s1, c1, g1 = _HLA2Paper.apply(q, k, v_in, s0, c0, g0, log2g, C, output_final_state)
    if normalize:
        o = _Normalized.apply(o[..., :DV].float(), o[..., DV].float(), eps).to(q.dtype)
    if not output_final_state:
        return o, None
    final = {"S": s1, "C": c1[..., :DV].contiguous(), "G": g1[..., :DV].contiguous()}
    if normalize:
        final.update(m=c1[..., DV].contiguous(), h=g1[..., DV].contiguous())
    return o, final


def _chunk(chunk_size: int, dtype, head_dim: int, backward: bool) -> int:
    """The chunk the kernels run (the result does not depend on it, up to rounding):
    chunk_size where it is a power of two in [16, 128], else 64. fp32 inputs (exact,
    non-tensor-core dots) use at most 32, which keeps the D = 128 backward within the shared
    memory of an H100/H200; for the same reason a backward at head dim (D or Dv) 128 uses at
    most 64 (chunk 128 needs 320 KiB there, an H100 or H200 has 227). A 16-bit forward alone
    at head dim 128 runs chunk 128 whatever was asked: half the chunk states to scan and
    store."""
    chunk = chunk_size if chunk_size in CHUNK_SIZES else 64
    if dtype == torch.float32:
        return min(chunk, 32)
    if head_dim >= 128:
        return min(chunk, 64) if backward else 128
    return chunk


def hla2_triton(q, k, v, *, normalize=False, eps=1e-6, decay=None, decay_form="masked",
                chunk_size=64, initial_state=None, output_final_state=False):
    """Masked hla2 with the Triton kernels: (o [B, T, H, Dv], final state dict or None).

    Inputs are assumed validated by `mixers.hla.hla2` (see triton_unsupported_reason).
    """
    reason = triton_unsupported_reason(q, k, v, masked=True, ridge=0.0,
                                       decay_form=decay_form, decay=decay)
    if reason is not None:
        raise ValueError(reason)
    return hla2_triton_unchecked(q, k, v, normalize=normalize, eps=eps, decay=decay,
                                 decay_form=decay_form, chunk_size=chunk_size,
                                 initial_state=initial_state,
                                 output_final_state=output_final_state)


def hla2_triton_unchecked(q, k, v, *, normalize, eps, decay, decay_form, chunk_size,
                          initial_state, output_final_state):
    """hla2_triton for inputs already checked (mixers.hla.hla2 checks them once: until the
    first kernel starts the GPU waits for this host path)."""
    B, T, H, D = q.shape
    paper = decay is not None and decay_form == "paper"
    backward = torch.is_grad_enabled() and any(
        x.requires_grad for x in (q, k, v, *(initial_state or {}).values()))
    C = _chunk(chunk_size, q.dtype, max(D, v.shape[-1]), backward)
    shared_kv = k.shape[2] == 1 and H > 1
    if shared_kv:  # multi-query: every head runs on the shared k, v (and shared S)
        k, v = k.expand(B, T, H, D), v.expand(B, T, H, v.shape[-1])
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if paper:
        o, final = _hla2_paper(q, k, v, normalize=normalize, eps=eps, decay=decay,
                               C=min(C, PAPER_CHUNK), initial_state=initial_state,
                               output_final_state=output_final_state)
        if final is not None and shared_kv:
            final["S"] = final["S"][:, :1].contiguous()
        return o, final
    s0 = a0 = an0 = None
    if initial_state is not None:
        s0 = initial_state["S"].float().expand(B, H, D, D).contiguous()
        a0 = initial_state["A"].float().contiguous()
        if normalize:
            an0 = initial_state["a"].float().contiguous()
    log2g = None if decay is None else torch.log2(decay.float()).contiguous()
    args = (q, k, v, s0, a0, an0, log2g, C, output_final_state, normalize, float(eps))
    if backward:
        o, s1, a1, an1 = _HLA2Masked.apply(*args)
    else:  # inference: no autograd node, and the chunk states are not kept
        o, s1, a1, an1 = _masked_forward(*args, keep_states=False)[0]
    final = None
    if output_final_state:
        final = {"S": s1[:, :1].contiguous() if shared_kv else s1, "A": a1}
        if normalize:
            final["a"] = an1
    return o, final


def _state_tensor(state: dict, key: str) -> torch.Tensor:
    """The state entry as a contiguous fp32 tensor the kernel can update in place."""
    x = state[key]
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = state[key] = x.float().contiguous()
    return x


def hla2_step_triton(q_t, k_t, v_t, state, *, normalize=False, eps=1e-6, decay=None,
                     decay_form="masked"):
    """One decode token with the fused step kernel: q_t, k_t [B, H, D], v_t [B, H, Dv] ->
    (o_t [B, H, Dv], state). The state's fp32 tensors ("S", "A", and "a" with normalize)
    are updated in place; state=None starts from zeros. decay_form="paper" (state "S", "C",
    "G", and "m", "h" with normalize): see _paper_step."""
    reason = triton_unsupported_reason(q_t.unsqueeze(1), k_t.unsqueeze(1), v_t.unsqueeze(1),
                                       masked=True, ridge=0.0, decay_form=decay_form,
                                       decay=decay)
    if reason is not None:
        raise ValueError(reason)
    return step_unchecked(q_t, k_t, v_t, state, normalize=normalize, eps=eps, decay=decay,
                          decay_form=decay_form)


def step_unchecked(q_t, k_t, v_t, state, *, normalize, eps, decay, decay_form):
    """hla2_step_triton for inputs already checked (hla2_step checks them once: a decode
    step is host-bound, and the check is a noticeable part of its host time)."""
    B, H, D = q_t.shape
    DV = v_t.shape[-1]
    if decay is not None and decay_form == "paper":
        return _paper_step(q_t, k_t, v_t, state, normalize=normalize, eps=eps, decay=decay)
    if state is None:
        state = {"S": q_t.new_zeros(B, k_t.shape[1], D, D, dtype=torch.float32),
                 "A": q_t.new_zeros(B, H, D, DV, dtype=torch.float32)}
        if normalize:
            state["a"] = q_t.new_zeros(B, H, D, dtype=torch.float32)
    s, a = _state_tensor(state, "S"), _state_tensor(state, "A")
    a_den = _state_tensor(state, "a") if normalize else a
    g = a if decay is None else decay.float().contiguous()
    shared_kv = k_t.shape[1] == 1 and H > 1
    if shared_kv:  # one S for all heads: update it once here (decay is equal across heads)
        if decay is not None:
            s.mul_(decay[0])
        s.add_(k_t.float().unsqueeze(-1) * k_t.float().unsqueeze(-2))
    o = q_t.new_empty(B, H, DV)
    kern.decode_step_kernel[(B * H,)](
        q_t.contiguous(), k_t.contiguous(), v_t.contiguous(), s, a, a_den, g, o, eps, H=H,
        D=D, DV=DV, BR=16, HAS_DECAY=decay is not None, NORMALIZE=normalize,
        SHARED_KV=shared_kv, num_warps=4)
    return o, state


def _paper_step(q_t, k_t, v_t, state, *, normalize, eps, decay):
    """hla2_step_triton for decay_form="paper". S is updated in place; C and G (with
    normalize packed with m and h into one padded tensor for the kernel, then split back)
    are replaced by their new values in the state dict."""
    B, H, D = q_t.shape
    DV = v_t.shape[-1]
    width = _pow2(DV + 1) if normalize else DV
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
    kern.paper_decode_step_kernel[(B * H,)](
        q_t.contiguous(), k_t.contiguous(), _paper_values(v_t, normalize, width).contiguous(), s, c,
        g_state, decay.float().contiguous(), o, H=H, D=D, DV=width, BR=16,
        SHARED_KV=shared_kv, num_warps=4)
    state["C"], state["G"] = c[..., :DV].contiguous(), g_state[..., :DV].contiguous()
    if normalize:
        state["m"], state["h"] = c[..., DV].contiguous(), g_state[..., DV].contiguous()
        return (o[..., :DV] / (o[..., DV:DV + 1] + eps)).to(q_t.dtype), state
    return o.to(q_t.dtype), state
