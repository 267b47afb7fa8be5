"""State-dict helpers shared by the ahla2 and hla3 operators.

Internally a normalized operator runs on values with an extra column of ones, so a
value-side state and its denominator twin travel as one tensor: `[B, H, D, Dv + 1]` holds
e.g. P (first Dv columns) and m (last column). These helpers convert between that packed
form and the public state dict, and check a user's `initial_state`.
"""

from __future__ import annotations

import torch

from mixers.common import check_nonempty


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """States and internal arithmetic: float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def to_heads_first(x: torch.Tensor, dtype: torch.dtype, ones_column: bool = False) -> torch.Tensor:
    """`[B, T, H, X]` -> `[B, H, T, X]` in `dtype`, optionally with a column of ones appended."""
    x = x.transpose(1, 2).to(dtype)
    if ones_column:
        x = torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)
    return x


def pack(state: dict, key: str, twin: str | None, dtype: torch.dtype,
         device: torch.device) -> torch.Tensor:
    """`state[key]` ([B, H, D, Dv]) with `state[twin]` ([B, H, D]) appended as a column."""
    x = state[key].to(device=device, dtype=dtype)
    if twin is None:
        return x
    return torch.cat([x, state[twin].to(device=device, dtype=dtype).unsqueeze(-1)], dim=-1)


def unpack(x: torch.Tensor, key: str, twin: str | None) -> dict[str, torch.Tensor]:
    """Inverse of `pack`: `{key: x[..., :Dv], twin: x[..., Dv]}` (or `{key: x}`)."""
    if twin is None:
        return {key: x}
    return {key: x[..., :-1], twin: x[..., -1]}


def state_bytes(state: dict) -> int:
    """Bytes held by the tensors of a state dict."""
    return sum(x.numel() * x.element_size() for x in state.values())


def read_out(o: torch.Tensor, normalize: bool, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Packed `[..., Dv(+1)]` outputs -> numerator / (denominator + eps) when normalized."""
    if normalize:
        o = o[..., :-1] / (o[..., -1:] + eps)
    return o.to(dtype)


def check_token(q_t, k_t, v_t) -> tuple[int, int, int, int]:
    """One-token inputs `[B, H, D]`, `[B, H, D]`, `[B, H, Dv]`; returns (B, H, D, Dv)."""
    for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor of shape [B, H, D], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        check_nonempty(name, x)
    if k_t.dtype != q_t.dtype or v_t.dtype != q_t.dtype:
        raise ValueError(f"q_t, k_t, v_t must share a dtype, got {q_t.dtype}, {k_t.dtype}, {v_t.dtype}")
    if k_t.shape != q_t.shape or v_t.shape[:2] != q_t.shape[:2]:
        raise ValueError(f"q_t, k_t must be [B, H, D] and v_t [B, H, Dv] with one B and H, got "
                         f"{tuple(q_t.shape)}, {tuple(k_t.shape)}, {tuple(v_t.shape)}")
    B, H, D = q_t.shape
    return B, H, D, v_t.shape[2]
