"""Fused Triton forms of masked hla2 (spec §4): a differentiable chunked op and a decode step.

Forward, 3 launches: chunk increments (grid NT x B*H), state scan (grid D/16 x B*H, a loop
over the NT chunks), output (grid Dv/64 x NT x B*H). Backward, 4-5 launches: increments plus
the gradient terms Q^T dO and Q^T P Q, the state scan again (the carried states are
recomputed, not saved: only q, k, v and the initial state are kept for backward), a reverse
scan of the state gradients, and dq/dk/dv (one launch, two from head dim 128). When its
D/16 x B*H programs cannot fill the GPU (B = 1 at 64k tokens), a scan runs in two levels:
segments of chunks summarise themselves in parallel (grid D/16 x NSEG x B*H), a short scan
chains the summaries, and the segments rescan from their start states (see _segments).
Per-chunk buffers ([D, D] and [D, Dv] per chunk and head, bf16 for bf16 inputs) live only
inside one pass: 3 in forward, 5 in backward; segment summaries are fp32 and small. Scan
loop bounds are powers of two (masked past the chunk count), so a sweep over T compiles
them once per power-of-two bucket (see triton_kernels.py, which also holds the math).

Supported: masked hla2, no decay or decay_form="masked" (per-head decay), normalize (the
denominator runs as a second op on a ones value block), initial_state with gradients,
output_final_state, any T, Dv != D, head dims 16/32/64/128, fp16/bf16/fp32 inputs,
multi-query (k, v with one head: broadcast to the query heads, S returned once).
Not supported (the dispatcher falls back): masked=False, ridge != 0, decay_form="paper".
fp16 inputs feed the carried state S to fp16 matmuls, which overflow once S exceeds 65504
(long sequences of large keys); prefer bf16.
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from mixers.hla.hla2 import triton_kernels as kern

HEAD_DIMS = (16, 32, 64, 128)
CHUNK_SIZES = (16, 32, 64, 128)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_unsupported_reason(q, k, v, *, masked, ridge, decay_form, decay) -> str | None:
    """None when the Triton kernels can run these inputs and options, else why not."""
    if not masked:
        return "the Triton kernels implement masked hla2 only (masked=False)"
    if ridge != 0:
        return "the Triton kernels do not implement ridge != 0"
    if decay is not None and decay_form == "paper":
        return "the Triton kernels do not implement decay_form='paper'"
    if q.device.type != "cuda" and not _interpreted():
        return f"the Triton kernels need a CUDA device (got {q.device}) or TRITON_INTERPRET=1"
    if q.dtype not in DTYPES:
        return f"the Triton kernels support float16, bfloat16 and float32, got {q.dtype}"
    if k.shape[2] not in (1, q.shape[2]):
        return f"k and v must have {q.shape[2]} heads or one shared head, got {k.shape[2]}"
    if q.shape[-1] not in HEAD_DIMS or v.shape[-1] not in HEAD_DIMS:
        return (f"the Triton kernels need head dims in {HEAD_DIMS}, got D={q.shape[-1]}, "
                f"Dv={v.shape[-1]}")
    return None


def _precision(dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


# Launch shapes checked with ptxas for sm_90a: 8 warps and 16-row scan blocks keep the
# increments, output and scan kernels free of spills at D = Dv = 64 (little at 128).
WARPS, SCAN_ROWS = 8, 16
# From this head dim on, dq/dk and dv are computed by two launches (fewer register spills).
SPLIT_GRADS_FROM = 128


def _chunk_buffers(B, H, NT, D, DV, q, n_dd, n_dv):
    """Per-chunk [D, D] and [D, DV] buffers: bf16 for bf16 inputs (memory), else fp32
    (fp16 would overflow: S grows with the sequence length)."""
    kw = dict(dtype=torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32,
              device=q.device)
    return ([torch.empty(B * H, NT, D, D, **kw) for _ in range(n_dd)]
            + [torch.empty(B * H, NT, D, DV, **kw) for _ in range(n_dv)])


@functools.lru_cache
def _resident_programs(device: torch.device, D: int) -> int:
    """About how many scan programs the device runs at once (8 warps each: 2 per SM fit the
    registers ptxas reports at D <= 64, 1 at D = 128). The interpreter assumes an H200."""
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
        seg = triton.next_power_of_2(triton.cdiv(NT, n_seg))  # few compiles over T
        used = triton.cdiv(NT, seg)
        cost = 2 * waves(row_programs * used) * seg + used
        if cost < best_cost:
            best, best_cost = (seg, used), cost
        n_seg *= 2
    return best


def _loop_bound(n):
    """The scans loop to a power of two (masked past n): one compile per bucket, not per T."""
    return triton.next_power_of_2(n)


def _summaries(buf, NSEG, *cols):
    """[B*H, NSEG, D, cols] fp32 segment summaries, one per entry of cols."""
    BH, _, D, _ = buf.shape
    return [buf.new_empty(BH, NSEG, D, c, dtype=torch.float32) for c in cols]


def _scan_launch(shape):
    """Launch options of the scans (which take the step length CL instead of C)."""
    return dict(num_warps=WARPS, BD=SCAN_ROWS, **{k: v for k, v in shape.items() if k != "C"})


def _scan_states(ds, x, da, lg, s0, a0, s1, a1, T, C, shape):
    """Carried states written over the increments (ds, da); final state into s1, a1 (when
    given). Long sequences: segment summaries, a scan over them, a rescan per segment."""
    BH, NT, D, DV = da.shape
    SEG, NSEG = _segments(NT, D // SCAN_ROWS * BH, _resident_programs(da.device, D))
    launch = _scan_launch(shape)

    def scan(n_seg, bufs, init, final, n, seg, cl, summary):
        kern.state_scan_kernel[(D // SCAN_ROWS, n_seg, BH)](
            *bufs[:3], lg, *(init or bufs[3:]), *(final or bufs[3:]), bufs[1], T, n, SEG=seg,
            CL=cl, HAS_INIT=init is not None, STORE_FINAL=final is not None, SUMMARY=summary,
            **launch)

    init = None if s0 is None else (s0, a0)
    final = None if s1 is None else (s1, a1)
    if NSEG == 1:
        return scan(1, (ds, x, da, ds, da), init, final, NT, _loop_bound(NT), C, False)
    s_seg, x_seg, a_seg = _summaries(da, NSEG, D, DV, DV)
    kern.state_scan_kernel[(D // SCAN_ROWS, NSEG, BH)](
        ds, x, da, lg, ds, da, s_seg, a_seg, x_seg, T, NT, SEG=SEG, CL=C, HAS_INIT=False,
        STORE_FINAL=True, SUMMARY=True, **launch)
    scan(1, (s_seg, x_seg, a_seg, s_seg, a_seg), init, final, NSEG, _loop_bound(NSEG), SEG * C,
         False)
    scan(NSEG, (ds, x, da, ds, da), (s_seg, a_seg), None, NT, SEG, C, False)


def _scan_grads(qdo, z, x, lg, gs1, ga1, gs0, ga0, T, C, shape):
    """Outgoing-state gradients written over (z, qdo), starting from the final-state
    gradients gs1, ga1 (when given); initial-state gradients into gs0, ga0 (when given)."""
    BH, NT, D, DV = qdo.shape
    SEG, NSEG = _segments(NT, D // SCAN_ROWS * BH, _resident_programs(qdo.device, D))
    launch = _scan_launch(shape)

    def scan(n_seg, bufs, final, init, n, seg, cl):
        kern.grad_scan_kernel[(D // SCAN_ROWS, n_seg, BH)](
            *bufs, lg, *(final or bufs[1::-1]), *(init or bufs[1::-1]), bufs[2], T, n,
            SEG=seg, CL=cl, HAS_FINAL_GRAD=final is not None,
            STORE_INIT_GRAD=init is not None, SUMMARY=False, **launch)

    final = None if gs1 is None else (gs1, ga1)
    init = None if gs0 is None else (gs0, ga0)
    if NSEG == 1:
        return scan(1, (qdo, z, x), final, init, NT, _loop_bound(NT), C)
    gs_seg, xq_seg, ga_seg = _summaries(qdo, NSEG, D, DV, DV)
    kern.grad_scan_kernel[(D // SCAN_ROWS, NSEG, BH)](
        qdo, z, x, lg, z, qdo, gs_seg, ga_seg, xq_seg, T, NT, SEG=SEG, CL=C,
        HAS_FINAL_GRAD=False, STORE_INIT_GRAD=True, SUMMARY=True, **launch)
    scan(1, (ga_seg, gs_seg, xq_seg), final, init, NSEG, _loop_bound(NSEG), SEG * C)
    scan(NSEG, (qdo, z, x), (gs_seg, ga_seg), None, NT, SEG, C)


def _forward(q, k, v, log2g, s0, a0, C, want_final):
    B, T, H, D = q.shape
    DV = v.shape[-1]
    NT = triton.cdiv(T, C)
    prec, warps = _precision(q.dtype), WARPS
    shape = dict(H=H, D=D, DV=DV, C=C, HAS_DECAY=log2g is not None, PREC=prec)
    lg = q if log2g is None else log2g
    ds, x, da = _chunk_buffers(B, H, NT, D, DV, q, 1, 2)
    kern.chunk_increments_kernel[(NT, B * H)](
        q, k, v, q, lg, ds, x, da, x, ds, T, NT, WITH_GRAD=False, num_warps=warps, **shape)
    s1 = a1 = None
    if want_final:
        s1 = q.new_empty(B, H, D, D, dtype=torch.float32)
        a1 = q.new_empty(B, H, D, DV, dtype=torch.float32)
    _scan_states(ds, x, da, lg, s0, a0, s1, a1, T, C, shape)
    o = torch.empty_like(v, dtype=q.dtype)
    BV = min(DV, 64)
    kern.chunk_output_kernel[(DV // BV, NT, B * H)](
        q, k, v, lg, ds, da, o, T, NT, BV=BV, num_warps=warps, **shape)
    return o, s1, a1


def _backward(q, k, v, log2g, s0, a0, do, gs1, ga1, C, want_init_grad):
    B, T, H, D = q.shape
    DV = v.shape[-1]
    NT = triton.cdiv(T, C)
    prec, warps = _precision(q.dtype), WARPS
    shape = dict(H=H, D=D, DV=DV, C=C, HAS_DECAY=log2g is not None, PREC=prec)
    lg = q if log2g is None else log2g
    ds, z, x, da, qdo = _chunk_buffers(B, H, NT, D, DV, q, 2, 3)
    kern.chunk_increments_kernel[(NT, B * H)](
        q, k, v, do, lg, ds, x, da, qdo, z, T, NT, WITH_GRAD=True, num_warps=warps, **shape)
    _scan_states(ds, x, da, lg, s0, a0, None, None, T, C, shape)
    gs0 = ga0 = None
    if want_init_grad:
        gs0 = q.new_empty(B, H, D, D, dtype=torch.float32)
        ga0 = q.new_empty(B, H, D, DV, dtype=torch.float32)
    has_final_grad = gs1 is not None or ga1 is not None
    if has_final_grad:
        gs1 = torch.zeros(B, H, D, D, dtype=torch.float32, device=q.device) if gs1 is None \
            else gs1.float().contiguous()
        ga1 = torch.zeros(B, H, D, DV, dtype=torch.float32, device=q.device) if ga1 is None \
            else ga1.float().contiguous()
    _scan_grads(qdo, z, x, lg, gs1, ga1, gs0, ga0, T, C, shape)
    del x  # only the scans read X; freeing it lowers the peak of the last launches
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    parts = [(True, False), (False, True)] if max(D, DV) >= SPLIT_GRADS_FROM else [(True, True)]
    for want_qk, want_v in parts:
        kern.chunk_grads_kernel[(NT, B * H)](
            q, k, v, do, lg, ds, da, z, qdo, dq, dk, dv, T, NT, WANT_QK=want_qk, WANT_V=want_v,
            num_warps=warps, **shape)
    return dq, dk, dv, gs0, ga0


class _HLA2Masked(torch.autograd.Function):
    """(q, k, v, S0, A0) -> (o, S1, A1) for masked hla2 with optional per-head decay
    (given as log2 g, not differentiated)."""

    @staticmethod
    def forward(ctx, q, k, v, s0, a0, log2g, chunk_size, want_final):
        o, s1, a1 = _forward(q, k, v, log2g, s0, a0, chunk_size, want_final)
        ctx.save_for_backward(q, k, v, s0, a0, log2g)
        ctx.chunk_size = chunk_size
        return o, s1, a1

    @staticmethod
    def backward(ctx, do, gs1, ga1):
        q, k, v, s0, a0, log2g = ctx.saved_tensors
        want_init_grad = s0 is not None and (ctx.needs_input_grad[3] or ctx.needs_input_grad[4])
        dq, dk, dv, gs0, ga0 = _backward(q, k, v, log2g, s0, a0, do.contiguous(), gs1, ga1,
                                         ctx.chunk_size, want_init_grad)
        return dq, dk, dv, gs0, ga0, None, None, None


def _chunk(chunk_size: int, dtype) -> int:
    """The kernels need a power-of-two chunk in [16, 128]; other sizes run with 64 (the
    result does not depend on the chunk size). fp32 inputs (exact, non-tensor-core dots)
    use at most 32, which keeps the D = 128 backward within the shared memory of an H100/H200."""
    chunk = chunk_size if chunk_size in CHUNK_SIZES else 64
    return min(chunk, 32) if dtype == torch.float32 else chunk


def _masked_op(q, k, v, s0, a0, log2g, chunk_size, want_final):
    return _HLA2Masked.apply(q, k, v, s0, a0, log2g, chunk_size, want_final)


def _empty_sequence(q, k, v, normalize, initial_state, output_final_state):
    """T = 0: no output rows; the final state is the initial one (or zeros)."""
    B, _, H, D = q.shape
    o = q.new_empty(B, 0, H, v.shape[-1])
    if not output_final_state:
        return o, None
    if initial_state is not None:
        return o, {key: x.float().clone() for key, x in initial_state.items()}
    final = {"S": q.new_zeros(B, k.shape[2], D, D, dtype=torch.float32),
             "A": q.new_zeros(B, H, D, v.shape[-1], dtype=torch.float32)}
    if normalize:
        final["a"] = q.new_zeros(B, H, D, dtype=torch.float32)
    return o, final


def hla2_triton(q, k, v, *, normalize=False, eps=1e-6, decay=None, decay_form="masked",
                chunk_size=64, initial_state=None, output_final_state=False):
    """Masked hla2 with the Triton kernels: (o [B, T, H, Dv], final state dict or None).

    Inputs are assumed validated by `mixers.hla.hla2` (see triton_unsupported_reason).
    """
    reason = triton_unsupported_reason(q, k, v, masked=True, ridge=0.0,
                                       decay_form=decay_form, decay=decay)
    if reason is not None:
        raise ValueError(reason)
    B, T, H, D = q.shape
    if T == 0:
        return _empty_sequence(q, k, v, normalize, initial_state, output_final_state)
    C = _chunk(chunk_size, q.dtype)
    shared_kv = k.shape[2] == 1 and H > 1
    if shared_kv:  # multi-query: every head runs on the shared k, v (and shared S)
        k, v = k.expand(B, T, H, D), v.expand(B, T, H, v.shape[-1])
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    s0 = a0 = a_den0 = None
    if initial_state is not None:
        s0 = initial_state["S"].float().expand(B, H, D, D).contiguous()
        a0 = initial_state["A"].float().contiguous()
        if normalize:
            a_den0 = initial_state["a"].float().unsqueeze(-1).expand(B, H, D, 16).contiguous()
    log2g = None if decay is None else torch.log2(decay.float()).contiguous()
    o, s1, a1 = _masked_op(q, k, v, s0, a0, log2g, C, output_final_state)
    final = None
    if output_final_state:
        final = {"S": s1[:, :1].contiguous() if shared_kv else s1, "A": a1}
    if normalize:
        ones = q.new_ones(B, T, H, 16)
        den, _, a_den1 = _masked_op(q, k, ones, s0, a_den0, log2g, C,
                                     output_final_state)
        o = (o.float() / (den[..., :1].float() + eps)).to(q.dtype)
        if output_final_state:
            final["a"] = a_den1[..., 0]
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
    are updated in place; state=None starts from zeros."""
    reason = triton_unsupported_reason(q_t.unsqueeze(1), k_t.unsqueeze(1), v_t.unsqueeze(1),
                                       masked=True, ridge=0.0, decay_form=decay_form,
                                       decay=decay)
    if reason is not None:
        raise ValueError(reason)
    B, H, D = q_t.shape
    DV = v_t.shape[-1]
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
