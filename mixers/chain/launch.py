"""One link of a chain (mixers/chain), forward and backward: the kernel launches."""

from __future__ import annotations

import torch
import triton

from mixers.dispatch import listening, note
from mixers.tiles import interpreted
from mixers.chain.grad_fused import chain_grad_fused_kernel
from mixers.chain.grad_keys import chain_grad_keys_kernel
from mixers.chain.grad_states import chain_grad_states_kernel
from mixers.chain.grad_values import chain_grad_values_kernel
from mixers.chain.output import chain_output_kernel
from mixers.chain.plan import ChainPlan
from mixers.chain.scan import chain_scan_kernel
from mixers.chain.states import chain_states_kernel
from mixers.chain.tiled import chain_tiled_output_kernel, chain_tiled_states_kernel
from mixers.chain.walk import chain_grad_walk_kernel, chain_walk_kernel


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x itself when its last dim is contiguous (what the kernels' row loads need), else a
    contiguous copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def strides(*tensors) -> tuple[int, ...]:
    """The batch, token and head strides of `[B, T, H, *]` tensors, in order."""
    return tuple(x.stride(i) for x in tensors for i in range(3))


def log_decay(decay, dtype):
    """log g per head in `dtype`, contiguous (a float decay arrives as an expanded tensor),
    or None."""
    return torch.log(decay.to(dtype)).contiguous() if decay is not None else None


def launch_options(plan: ChainPlan, has_decay: bool) -> dict:
    """The compile-time arguments every chunk kernel of a link takes from its plan."""
    return dict(C=plan.chunk, BK=plan.block_k, BV=plan.block_v, HAS_DECAY=has_decay,
                PRECISION=plan.precision, num_warps=plan.warps, num_stages=plan.stages)


def scan(buffer, log_g, start, end, T: int, plan: ChainPlan, reverse: bool) -> None:
    """The chunk scan (scan.py) of a per-chunk buffer `[B * H, NT, DK, W]` of increments,
    in place, from `start` (`[B, H, DK, W]` or None: zeros) into `end`."""
    BH, NT, DK, W = buffer.shape
    size = DK * W
    chain_scan_kernel[(triton.cdiv(size, plan.scan_block), BH)](
        buffer, log_g if log_g is not None else end, start if start is not None else end, end,
        T, end.shape[1], NT, size, C=plan.chunk, BLOCK=plan.scan_block,
        NT_BOUND=triton.next_power_of_2(NT), REVERSE=reverse, HAS_DECAY=log_g is not None,
        HAS_X0=start is not None, num_warps=plan.scan_warps)


NARROW = (torch.bfloat16, torch.float16)


def raw_products(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether tiled.py multiplies tiles of a and b as loaded: one 16-bit dtype, float32
    accumulation (its products exact)."""
    return a.dtype == b.dtype and a.dtype in NARROW and dtype == torch.float32


def forward(q, k, v, S0, log_g, ones: bool, plan: ChainPlan, dtype: torch.dtype,
            keep_starts: bool = False, out_dtype: torch.dtype | None = None,
            need_final: bool = True):
    """la(q, k, v; S0, g) on `[B, T, H, DK]` q, k and `[B, T, H, DV]` v (last dims
    contiguous; v gets a column of ones after its last when `ones`): the outputs
    `[B, T, H, DV + ones]` (in `out_dtype`, default `dtype`: the kernel rounds its `dtype`
    results once as it stores them) and final state `[B, H, DK, DV + ones]` in `dtype`, and
    with `keep_starts` every chunk's start state `[B * H, NT, DK, DV + ones]` (else None; in
    `dtype`, or bfloat16 under the plan's `narrow_starts`).
    S0: `[B, H, DK, DV + ones]` or None (zeros); log_g: `[H]` in `dtype` or None (no decay).
    A link of one chunk from a zero start whose final state is not needed (`need_final`
    False) has no state at all: no states are computed, and the final state and the start
    states come back as None (backward takes that). The plan's layout picks the kernels
    (ChainPlan.layout); inputs, outputs, states and their dtypes are the same for both."""
    B, T, H, DK = q.shape
    DV = v.shape[-1]
    W = DV + ones
    NT = triton.cdiv(T, plan.chunk)
    NK, NV = triton.cdiv(DK, plan.block_k), triton.cdiv(W, plan.block_v)
    stateless = NT == 1 and S0 is None and not need_final
    tiled = plan.layout == "fla"
    walked = not stateless and not tiled and plan.walks(NT, NK * NV * B * H)
    if listening():  # the launch plan, for the results' `resolved`
        note(chain_plan=f"chunk {plan.chunk}, blocks {plan.block_k} x {plan.block_v}, "
                        f"{plan.warps} warps, {plan.stages} stages, {plan.precision}, "
                        + ("fla layout, " if tiled else "")
                        + ("scores once, " if plan.scores_once and not tiled else "")
                        + ("fused backward, " if plan.fused_backward else "")
                        + ("no state" if stateless else "states walked" if walked or tiled
                           else f"scan blocks of {plan.scan_block}"))
    out = torch.empty(B, T, H, W, dtype=out_dtype or dtype, device=q.device)
    starts = S1 = None
    if not stateless:
        starts = torch.empty(B * H, NT, DK, W, device=q.device,
                             dtype=torch.bfloat16 if plan.narrow_starts else dtype)
        S1 = torch.empty(B, H, DK, W, dtype=dtype, device=q.device)
    # the output kernel computes in STARTS' dtype: without states, a stand-in of `dtype`
    read_starts = starts if starts is not None else torch.empty(1, dtype=dtype, device=q.device)
    gate = log_g if log_g is not None else read_starts
    common = launch_options(plan, log_g is not None)
    if tiled:
        if not stateless:
            chain_tiled_states_kernel[(NK, NV, B * H)](
                k, v, gate, S0.contiguous() if S0 is not None else S1, starts, S1, T, H, DK,
                DV, W, NT, *strides(k, v), ONES=ones, HAS_S0=S0 is not None,
                KV_RAW=raw_products(k, v, dtype),
                # the interpreter's loop bound; a GPU loops to NT (one compile for every NT)
                NT_BOUND=triton.next_power_of_2(NT) if interpreted() else 1, **common)
        chain_tiled_output_kernel[(NV, NT, B * H)](
            q, k, v, gate, read_starts, S1 if S1 is not None else read_starts, out, T, H, DK,
            DV, W, NT, *strides(q, k, v), NK=NK,
            HAS_STATE=not stateless, ONES=ones, QK_RAW=raw_products(q, k, dtype), **common)
        return out, S1, starts if keep_starts else None
    if walked:
        chain_walk_kernel[(NK, NV, B * H)](
            k, v, gate, S0.contiguous() if S0 is not None else S1, starts, S1, T, H, DK, DV, W,
            NT, *strides(k, v), NT_BOUND=triton.next_power_of_2(NT), ONES=ones,
            HAS_S0=S0 is not None, **common)
    elif not stateless:
        chain_states_kernel[(NT, NK * NV, B * H)](k, v, gate, starts, T, H, DK, DV, W, NT, NV,
                                                  *strides(k, v), ONES=ones, **common)
        scan(starts, log_g, S0.contiguous() if S0 is not None else None, S1, T, plan,
             reverse=False)
    chain_output_kernel[(NT, 1 if plan.scores_once else NV, B * H)](
        q, k, v, gate, read_starts, out, T, H, DK, DV, W, NT,
        *strides(q, k, v), NK=NK, NV=NV, SCORES_ONCE=plan.scores_once,
        HAS_STATE=not stateless, ONES=ones, **common)
    return out, S1, starts if keep_starts else None


def backward(q, k, v, log_g, ones: bool, starts, grad_out, grad_S1, dq, dk, dv,
             plan: ChainPlan, want_dS0: bool,
             poison: tuple[bool, bool, bool] = (True, True, True)):
    """Adds the link's gradients into float buffers: dq and dk `[B, T, H, DK]`, dv
    `[B, T, H, DV]` (each may be shared with other links), given the gradients of its
    outputs `[B, T, H, DV + ones]` and of its final state (or None). Returns the gradient
    of its start state when `want_dS0`, else None. `poison` (for q, k, v): NaN is added to
    the gradient rows of that input's non-finite rows; False for an input an earlier link
    computed, whose gradient goes on to that link's backward. `starts` None: the forward
    had no state (one chunk from a zero start, no final state), so there is no state
    gradient either: grad_S1 must be None, and no start-state gradient comes back."""
    B, T, H, DK = q.shape
    DV = v.shape[-1]
    W = DV + ones
    NT = triton.cdiv(T, plan.chunk)
    dtype = dq.dtype
    grad_out = grad_out.to(dtype).contiguous()
    stateless = starts is None
    if stateless and (NT != 1 or grad_S1 is not None):
        raise ValueError("a link without states has one chunk and no final-state gradient")
    ends = dS0 = None
    if not stateless:
        ends = torch.empty(starts.shape, dtype=dtype, device=q.device)  # starts may be 16-bit
        dS0 = torch.empty(B, H, DK, W, dtype=dtype, device=q.device)
    gate = log_g if log_g is not None else dq
    common = launch_options(plan, log_g is not None)
    NK, NV = triton.cdiv(DK, plan.block_k), triton.cdiv(W, plan.block_v)
    dS1 = grad_S1.to(dtype).contiguous() if grad_S1 is not None else None
    if stateless:
        starts = ends = dq  # stand-ins: without HAS_STATE the kernels read neither
    elif plan.walks(NT, NK * NV * B * H):
        chain_grad_walk_kernel[(NK, NV, B * H)](
            q, gate, grad_out, dS1 if dS1 is not None else dS0, ends, dS0, T, H, DK, W, NT,
            *strides(q), NT_BOUND=triton.next_power_of_2(NT), HAS_DS1=dS1 is not None,
            **common)
    else:
        chain_grad_states_kernel[(NT, NK * NV, B * H)](q, gate, grad_out, ends, T, H, DK, W, NT,
                                                       NV, *strides(q), **common)
        scan(ends, log_g, dS1, dS0, T, plan, reverse=True)
    if plan.fused_backward:
        chain_grad_fused_kernel[(NT, 1, B * H)](
            q, k, v, gate, starts, ends, grad_out, dq, dk, dv, T, H, DK, DV, W, NT,
            *strides(q, k, v), NK=NK, NV=NV, HAS_STATE=not stateless, ONES=ones,
            POISON_Q=poison[0], POISON_K=poison[1], POISON_V=poison[2], **common)
    else:
        chain_grad_keys_kernel[(NT, NK, B * H)](
            q, k, v, gate, starts, ends, grad_out, dq, dk, T, H, DK, DV, W, NT,
            *strides(q, k, v), NV=NV, HAS_STATE=not stateless, ONES=ones,
            POISON_Q=poison[0], POISON_K=poison[1], **common)
        chain_grad_values_kernel[(NT, triton.cdiv(DV, plan.block_v), B * H)](
            q, k, v, gate, ends, grad_out, dv, T, H, DK, DV, W, NT, *strides(q, k, v),
            NK=NK, HAS_STATE=not stateless, POISON_V=poison[2], **common)
    return dS0 if want_dS0 else None


def key_moments_forward(q, k, S0, log_g, plan: ChainPlan, dtype: torch.dtype, keep: bool,
                        need_final: bool):
    """The link y_t = S_t q_t, S_t = g S_{t-1} + k_t k_t^T (la(q, k, k; S0^T): its state is
    S^T, which is S for any state the link makes), that hla3 and hla2's chain begin with.
    S0 (`[B, H, D, D]` or None: zeros) goes in, and the final S comes out, transposed, so
    that a start state that is not symmetric is read, and differentiated, as the PyTorch
    forms read it. -> (Y, final S or None, the chunk start states for key_moments_backward)."""
    Y, S1, starts = forward(q, k, k, S0.mT if S0 is not None else None, log_g, False, plan,
                            dtype, keep, need_final=need_final)
    return Y, S1.mT.contiguous() if S1 is not None else None, starts


def key_moments_backward(q, k, log_g, starts, grad_Y, grad_S, dq, dk, plan: ChainPlan,
                         want_dS0: bool):
    """key_moments_forward's backward: adds into dq and dk (the link's values are its keys)
    and returns the gradient of S0 (when `want_dS0`, else None)."""
    dS0 = backward(q, k, k, log_g, False, starts, grad_Y,
                   grad_S.mT if grad_S is not None else None, dq, dk, dk, plan,
                   want_dS0=want_dS0)
    return dS0.mT if dS0 is not None else None
