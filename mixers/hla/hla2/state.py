"""The hla2 state: which summaries an option set carries, their shapes, and the packed
"extended" layout the forms compute with.

Three operator forms share the code below:
* "masked":   masked HLA2, no decay or decay_form="masked"; state S, A (+ a), ridge adds C (+ m).
* "paper":    masked HLA2 with the paper's §4.3 decayed recurrence; state S, C, G (+ m, h).
* "unmasked": q_t^T S_t C_t; state S, C (+ m).

With normalize=True every value-side summary gains its denominator twin (A|a, C|m, G|h). The
forms append a column of ones to v and pack each pair into one [.., D, Dv+1] tensor, so the
numerator and denominator come out of the same matmuls.
"""

from __future__ import annotations

import torch

DECAY_FORMS = ("masked", "paper")

# value-side summary -> its denominator twin under normalize=True
_TWIN = {"A": "a", "C": "m", "G": "h"}


def operator_form(masked: bool, decay, decay_form: str) -> str:
    if not masked:
        return "unmasked"
    return "paper" if decay_form == "paper" and decay is not None else "masked"


def value_keys(form: str, ridge: float) -> tuple[str, ...]:
    """The [D, Dv] summaries a form carries besides S."""
    if form == "masked":
        return ("A", "C") if ridge != 0 else ("A",)
    if form == "paper":
        return ("C", "G")
    return ("C",)


def state_shapes(form: str, normalize: bool, ridge: float, batch: int, heads: int,
                 kv_heads: int, head_dim: int, value_dim: int) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the public state dict for these options."""
    shapes = {"S": (batch, kv_heads, head_dim, head_dim)}
    for key in value_keys(form, ridge):
        shapes[key] = (batch, heads, head_dim, value_dim)
        if normalize:
            shapes[_TWIN[key]] = (batch, heads, head_dim)
    return shapes


def pack(state: dict, form: str, normalize: bool, ridge: float) -> dict:
    """Public state -> {"S", and each value key as [.., D, Dv(+1)]}."""
    packed = {"S": state["S"]}
    for key in value_keys(form, ridge):
        x = state[key]
        packed[key] = torch.cat([x, state[_TWIN[key]].unsqueeze(-1)], -1) if normalize else x
    return packed


def unpack(packed: dict, form: str, normalize: bool, ridge: float) -> dict:
    state = {"S": packed["S"]}
    for key in value_keys(form, ridge):
        x = packed[key]
        if normalize:
            state[key], state[_TWIN[key]] = x[..., :-1].contiguous(), x[..., -1].contiguous()
        else:
            state[key] = x
    return state


def zero_packed(form: str, normalize: bool, ridge: float, batch: int, heads: int, kv_heads: int,
                head_dim: int, value_dim: int, dtype, device) -> dict:
    shapes = state_shapes(form, False, ridge, batch, heads, kv_heads, head_dim,
                          value_dim + int(normalize))
    return {key: torch.zeros(shape, dtype=dtype, device=device) for key, shape in shapes.items()}


def with_ones(v: torch.Tensor) -> torch.Tensor:
    """Append a ones column to v: the denominator is the numerator with every v_j = 1."""
    return torch.cat([v, torch.ones_like(v[..., :1])], -1)


def compute_inputs(q, k, v, packed: dict, normalize: bool) -> tuple:
    """q, k, v in the state's (compute) dtype; v with the ones column when normalizing."""
    dtype = packed["S"].dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return q, k, with_ones(v) if normalize else v


def finish(o_ext: torch.Tensor, normalize: bool, eps: float) -> torch.Tensor:
    """Split the packed output into numerator / (denominator + eps) when normalizing."""
    if not normalize:
        return o_ext
    return o_ext[..., :-1] / (o_ext[..., -1:] + eps)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64; everything else accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
