"""hla2 as a token-by-token recurrence (paper §3.1, §4.3: the "equivalent state").

Per token, with decay g (1 when None):
* masked:   S = g S + k k^T, A = g^2 A + (S q) v^T, o = q^T A            (+ ridge q^T C)
* paper:    G = g G + k (k^T C_prev), S = g S + k k^T, C = g C + q v^T,
            o = q^T (S + ridge I) C - q^T G
* unmasked: S, C as above, o = q^T (S + ridge I) C
The packed state stores each value summary as [.., D, Dv(+1)] (see state.py).
"""

from __future__ import annotations

import torch

from mixers.hla.hla2.state import compute_inputs, finish


def _decayed(x: torch.Tensor, g: torch.Tensor | None, power: int = 1) -> torch.Tensor:
    return x if g is None else x * g.view(-1, 1, 1) ** power


def step_packed(packed: dict, q_t, k_t, v_t, *, form: str, ridge: float, g) -> tuple:
    """One token: q_t [B, H, D], k_t [B, Hk, D], v_t [B, Hk, Dv'] -> (packed output, new state)."""
    S = _decayed(packed["S"], g) + k_t.unsqueeze(-1) * k_t.unsqueeze(-2)
    new = {"S": S}
    q_row = q_t.unsqueeze(-2)  # [B, H, 1, D]
    if "C" in packed:
        new["C"] = _decayed(packed["C"], g) + q_t.unsqueeze(-1) * v_t.unsqueeze(-2)
    if form == "masked":
        new["A"] = _decayed(packed["A"], g, 2) + (S @ q_t.unsqueeze(-1)) * v_t.unsqueeze(-2)
        out = q_row @ new["A"]
        if ridge:
            out = out + ridge * (q_row @ new["C"])
    else:
        out = (q_row @ S + ridge * q_row) @ new["C"]
        if form == "paper":
            cross = k_t.unsqueeze(-1) * (k_t.unsqueeze(-2) @ packed["C"])
            new["G"] = _decayed(packed["G"], g) + cross
            out = out - q_row @ new["G"]
    return out.squeeze(-2), new


def hla2_serial(q, k, v, *, form, normalize, eps, ridge, g, packed) -> tuple:
    """Run the recurrence over [B, T, H, .] inputs from packed state; return (o, packed)."""
    q, k, v = compute_inputs(q, k, v, packed, normalize)
    outs = []
    for t in range(q.shape[1]):
        out, packed = step_packed(packed, q[:, t], k[:, t], v[:, t], form=form, ridge=ridge, g=g)
        outs.append(out)
    o_ext = torch.stack(outs, 1) if outs else q.new_zeros(*q.shape[:3], v.shape[-1])
    return finish(o_ext, normalize, eps), packed
