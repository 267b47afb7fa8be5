"""hla2 by associative scans over segment summaries (paper §4.1, §4.2).

A segment X of n tokens ending at e carries, with decay g (1 without decay), rho = g^n:
  S = sum_i g^(e-i) k_i k_i^T,  C = sum_j g^(e-j) q_j v_j^T,
  G = sum_{j < i} c(i, j) k_i k_i^T q_j v_j^T, and the read-out is o_t = q_t^T (S C - G).
The cross weight c and so the concatenation (A then B) depend on the form:
* masked, c = g^((e-i)+(e-j)):  G = rho_B^2 G_A + G_B + rho_B S_B C_A
  (the paper's decay-aware operator has rho_B G_A here, which matches neither recurrence).
* paper (§4.3 recurrence), c = g^(e-1-j), independent of i, so the segment also carries the
  undecayed key moment Sbar = sum_i k_i k_i^T:  G = rho_B G_A + G_B + g^(n_B-1) Sbar_B C_A.
* unmasked: no G (eq. 4.1's monoid part); S, C combine as rho_B X_A + X_B.
Forward: an exclusive scan within every chunk and one across chunk summaries (the initial
state is the leftmost segment), then each token's state is carry (+) prefix (+) token.
Both scans are log-depth (Hillis-Steele) and materialise per-token states: a reference form.
"""

from __future__ import annotations

import torch

from mixers.common import pad_to_multiple
from mixers.hla.hla2.state import compute_inputs, finish


def _combine(a: dict, b: dict, form: str, log_g: torch.Tensor) -> dict:
    """Segment a followed by segment b."""
    rho = torch.exp(b["n"] * log_g)
    out = {"n": a["n"] + b["n"], "S": rho * a["S"] + b["S"], "C": rho * a["C"] + b["C"]}
    if form == "masked":
        out["G"] = rho ** 2 * a["G"] + b["G"] + rho * (b["S"] @ a["C"])
    elif form == "paper":
        out["Sbar"] = a["Sbar"] + b["Sbar"]
        out["G"] = rho * a["G"] + b["G"] + torch.exp((b["n"] - 1) * log_g) * (b["Sbar"] @ a["C"])
    return out


def _narrow(seg: dict, dim: int, start: int, length: int) -> dict:
    return {key: x.narrow(dim, start, length) for key, x in seg.items()}


def _cat(first: dict, second: dict, dim: int) -> dict:
    return {key: torch.cat([first[key], second[key]], dim) for key in first}


def _inclusive_scan(seg: dict, dim: int, combine) -> dict:
    length = seg["n"].shape[dim]
    step = 1
    while step < length:
        earlier = _narrow(seg, dim, 0, length - step)
        merged = combine(earlier, _narrow(seg, dim, step, length - step))
        seg = _cat(_narrow(seg, dim, 0, step), merged, dim)
        step *= 2
    return seg


def _identity_like(seg: dict, dim: int) -> dict:
    return {key: torch.zeros_like(x.narrow(dim, 0, 1)) for key, x in seg.items()}


def hla2_scan(q, k, v, *, form, normalize, eps, ridge, g, packed, chunk_size,
              output_final_state) -> tuple:
    """[B, T, H, .] inputs, packed initial state -> (o, packed final state | None)."""
    B, T, H, _ = q.shape
    q, k, v = compute_inputs(q, k, v, packed, normalize)
    dtype = q.dtype
    chunk = min(chunk_size, T)
    log_g = torch.zeros(1, dtype=dtype, device=q.device) if g is None else g.log()
    log_g = log_g.view(-1, 1, 1, 1, 1)

    def blocks(x):  # [B, T, h, d] -> [B, h, N, chunk, d]
        x = pad_to_multiple(x, chunk)
        return x.view(B, -1, chunk, x.shape[2], x.shape[3]).permute(0, 3, 1, 2, 4)

    qc, kc, vc = blocks(q), blocks(k), blocks(v)
    real = pad_to_multiple(torch.ones(1, T, dtype=dtype, device=q.device), chunk)
    tokens = {"n": real.view(1, 1, -1, chunk, 1, 1),  # padded tokens are empty segments
              "S": kc.unsqueeze(-1) * kc.unsqueeze(-2),
              "C": qc.unsqueeze(-1) * vc.unsqueeze(-2)}
    if form != "unmasked":
        tokens["G"] = torch.zeros_like(tokens["C"])
    if form == "paper":
        tokens["Sbar"] = tokens["S"]

    init = {"S": packed["S"], "C": packed["C"] if "C" in packed else torch.zeros_like(packed["A"])}
    if form == "masked":  # any (C, G) with S C - G = A reads out the same
        init["G"] = packed["S"] @ init["C"] - packed["A"]
    elif form == "paper":
        init["G"], init["Sbar"] = packed["G"], torch.zeros_like(packed["S"])
    init = {key: x.reshape(x.shape[:2] + (1, 1) + x.shape[2:]) for key, x in init.items()}
    init["n"] = torch.zeros(1, 1, 1, 1, 1, 1, dtype=dtype, device=q.device)

    def combine(a, b):
        return _combine(a, b, form, log_g)

    local = _inclusive_scan(tokens, 3, combine)
    prefixes = _cat(_identity_like(local, 3), _narrow(local, 3, 0, chunk - 1), 3)
    summaries = _narrow(local, 3, chunk - 1, 1)
    num_chunks = qc.shape[2]
    carries = _inclusive_scan(_cat(init, _narrow(summaries, 2, 0, num_chunks - 1), 2), 2, combine)
    states = combine(combine(carries, prefixes), tokens)

    q_row = qc.unsqueeze(-2)
    o = (q_row @ states["S"] + ridge * q_row) @ states["C"]
    if form != "unmasked":
        o = o - q_row @ states["G"]
    o = finish(o.squeeze(-2), normalize, eps)
    o = o.permute(0, 2, 3, 1, 4).reshape(B, -1, H, o.shape[-1])[:, :T]

    final = None
    if output_final_state:
        last = num_chunks - 1
        end = combine(_narrow(carries, 2, last, 1), _narrow(summaries, 2, last, 1))
        end = {key: x.flatten(2, 3).squeeze(2) for key, x in end.items()}
        final = {"S": end["S"]}
        if form == "masked":
            final["A"] = end["S"] @ end["C"] - end["G"]
            if ridge:
                final["C"] = end["C"]
        else:
            final["C"] = end["C"]
            if form == "paper":
                final["G"] = end["G"]
    return o, final
