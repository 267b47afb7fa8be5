"""Mamba-2's SSD scan as a harness op: C = q, B = k, x = v, with a per-head decay.

`mamba2_ssd(q, k, v, dt=..., A=...)` runs the serial recurrence ("naive"), our chunked
PyTorch SSD ("chunk") or mamba_ssm's Triton kernel ("triton"); "auto" takes Triton on CUDA
when mamba-ssm is installed. The registry op binds data-independent, seeded per-head dt and
A (`ssd_parameters`), like a freshly initialised Mamba-2 layer; the layer computes dt from
its input. State: {"h": [B, H, N, P]} (N = state size = head_dim of q/k, P = value dim).
"""

from __future__ import annotations

import functools
import importlib.util
import math

import torch

from mixers.dispatch import note, opaque
from mixers.common import (FiniteInputs, check_choice, check_chunk_size, check_flag,
                               check_qkv)
from mixers.mamba2.chunk import ssd_chunk
from mixers.mamba2.naive import expand_groups, ssd_naive, ssd_step

IMPLS = ("auto", "naive", "chunk", "triton")


@functools.lru_cache(maxsize=64)
def ssd_parameters(heads: int, seed: int = 0, device=None, dtype=torch.float32):
    """Per-head (dt, A) as Mamba-2 initialises them: dt log-uniform in [1e-3, 0.1],
    A uniform in [-16, -1]. Seeded, so the op and its decoder agree; cached, so decode steps
    do not pay a host-to-device copy. Treat the returned tensors as read-only. Drawn on the
    CPU whatever the default device (a `torch.device` context would otherwise put them, and
    the cache, on it); `device` None means the CPU."""
    generator = torch.Generator().manual_seed(seed)
    cpu = torch.device("cpu")
    log_dt = torch.rand(heads, generator=generator, dtype=torch.float64, device=cpu)
    dt = torch.exp(log_dt * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    A = -(1 + 15 * torch.rand(heads, generator=generator, dtype=torch.float64, device=cpu))
    device = cpu if device is None else device
    return dt.to(device=device, dtype=dtype), A.to(device=device, dtype=dtype)


def _pick_impl(impl: str, x: torch.Tensor) -> str:
    check_choice("impl", impl, IMPLS)
    if impl != "auto":
        note(impl=impl)
        return impl
    why_not = ("no CUDA device" if not x.is_cuda else
               "mamba-ssm not installed" if importlib.util.find_spec("mamba_ssm") is None else None)
    if why_not is None:
        note(impl="triton", kernel="mamba_ssm")
        return "triton"
    note(impl="chunk", fallback=f"not mamba_ssm's Triton kernel: {why_not}")
    return "chunk"


def ssd(x, dt, A, B, C, *, D=None, impl="auto", chunk_size=64, initial_state=None):
    """SSD in Mamba's naming: x `[b, T, h, P]`, dt `[b, T, h]`, A `[h]`, B/C `[b, T, g, N]`
    with g dividing h; returns (y, final state `[b, h, N, P]`). The naive and chunk forms
    keep the non-finite rule of mixers/common.py (a non-finite x, B, C or dt at token t
    changes only outputs at and after t); mamba_ssm's Triton kernel is run as it is."""
    check_chunk_size(chunk_size)
    impl = _pick_impl(impl, x)
    if x.shape[1] == 0:  # no tokens: no output rows, and the start state is the final one
        b, _, h, P = x.shape
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        state = (torch.zeros(b, h, B.shape[-1], P, dtype=dtype, device=x.device)
                 if initial_state is None else initial_state.to(dtype, copy=True))
        return x.new_zeros(b, 0, h, P), state
    if impl in ("naive", "chunk"):  # the non-finite rule (mixers/common.py), dt included
        h = x.shape[2]
        guard = FiniteInputs(x, expand_groups(B, h), expand_groups(C, h), dt.unsqueeze(-1))
        x, B, C, dt = guard.inputs
        dt = dt.squeeze(-1)
        if impl == "naive":
            y, state = ssd_naive(x, dt, A, B, C, D=D, initial_state=initial_state)
        else:
            y, state = ssd_chunk(x, dt, A, B, C, D=D, chunk_size=chunk_size,
                                 initial_state=initial_state)
        return guard.outputs(y), guard.state(state)
    from mixers.mamba2.triton import ssd_triton  # mamba_ssm's kernel: not held to the rule

    # kept out of a torch.compile trace (its own autotuned launchers); the PyTorch forms trace
    return opaque(ssd_triton, x, dt, A, B, C, D=D, chunk_size=chunk_size,
                  initial_state=initial_state)


def mamba2_ssd(q, k, v, *, dt, A, D=None, impl="auto", chunk_size=64, initial_state=None,
               output_final_state=False):
    """Harness op: q, k `[B, T, H, N]` (or one shared head), v `[B, T, H, P]`; dt `[H]` or
    `[B, T, H]` (> 0), A `[H]` (< 0), D `[H]` or None; returns (o, {"h"} | None)."""
    B_, T, H, N, P = check_qkv(q, k, v, shared_kv_ok=True)
    check_flag("output_final_state", output_final_state)
    if dt.dim() == 1:  # kept in float32 (float64): bf16 would round dt by ~0.4%
        dt = dt.to(torch.float64 if v.dtype == torch.float64 else torch.float32)
        dt = dt.expand(B_, T, H)
    h0 = None if initial_state is None else initial_state["h"]
    if h0 is not None and tuple(h0.shape) != (B_, H, N, P):
        raise ValueError(f"initial_state['h'] must have shape {(B_, H, N, P)}, "
                         f"got {tuple(h0.shape)}")
    y, h = ssd(v, dt, A, k, q, D=D, impl=impl, chunk_size=chunk_size, initial_state=h0)
    return y.to(v.dtype), ({"h": h} if output_final_state else None)


class SSDDecoder:
    """One-token SSD recurrence with the registry op's seeded per-head dt and A."""

    def __init__(self, seed: int = 0, d_skip: bool = False):
        self.seed, self.d_skip = seed, d_skip

    def init_state(self, batch, heads, head_dim, value_dim, context_len, device, dtype):
        dtype = torch.float64 if dtype == torch.float64 else torch.float32
        return {"h": torch.randn(batch, heads, head_dim, value_dim, device=device, dtype=dtype)}

    def step(self, q, k, v, state):
        h, heads = state["h"], v.shape[1]
        dt, A = ssd_parameters(heads, self.seed, q.device, h.dtype)
        D = torch.ones_like(dt) if self.d_skip else None
        q, k = (expand_groups(x.unsqueeze(1), heads).squeeze(1) for x in (q, k))
        y, h = ssd_step(v.to(h.dtype), dt.expand(v.shape[0], -1), A, k.to(h.dtype),
                        q.to(h.dtype), h, D)
        return y.to(v.dtype), {"h": h}

    def state_bytes(self, state):
        return state["h"].nbytes


def ssd_flops(batch, seq_len, heads, head_dim, value_dim, mode, *, chunk_size=64, **_):
    """Chunk SSD FLOPs: per token 2C(N+P) for the masked chunk products (C B^T and its
    product with x) and 4 N P for chunk-state build and read; backward counted as 2x."""
    N, P, C = head_dim, value_dim, chunk_size
    if mode == "decode":
        return float(batch * heads * 4 * N * P)
    fwd = float(batch * heads * seq_len * (2 * C * (N + P) + 4 * N * P))
    return fwd if mode == "fwd" else 3 * fwd


__all__ = ["IMPLS", "ssd", "mamba2_ssd", "ssd_parameters", "SSDDecoder", "ssd_flops",
           "ssd_naive", "ssd_chunk"]
