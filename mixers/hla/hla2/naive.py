"""hla2 as explicit finite sums (paper §3 and §4.3, masked; docs/discrepancies.md), computed in float64: the ground truth every
other form (serial, scan, chunk, Triton) must reproduce, outputs and final states alike.

With w(t, i, j) = (q_t . k_i)(q_j . k_i) and per-head decay g (1 without decay), from a
zero state:
* masked, decay_form="masked":  o_t = sum_{i <= j <= t} g^{(t-i)+(t-j)} w v_j
* masked, decay_form="paper":   o_t = sum_{i, j <= t} g^{2t-i-j} w v_j
                                      - sum_{j < i <= t} g^{t-1-j} w v_j
                                (the closed form of the paper's §4.3 recurrence)
* unmasked:                     o_t = sum_{i, j <= t} g^{2t-i-j} w v_j
ridge adds ridge * sum_{j <= t} g^{t-j} (q_t . q_j) v_j (the S_t + ridge*I read-out);
normalize divides by the same sums with v_j = 1, plus eps.

The sums are evaluated through the state summaries as sums over tokens (state.py names
them; t counts from 0, and X0 is a summary of the initial state):
  S_t = g^(t+1) S0 + sum_{i <= t} g^(t-i) k_i k_i^T
  C_t = g^(t+1) C0 + sum_{j <= t} g^(t-j) q_j v_j^T
  masked:   A_t = g^(2(t+1)) A0 + sum_{j <= t} g^(2(t-j)) (S_j q_j) v_j^T,  o_t = q_t^T A_t
            (+ ridge q_t^T C_t)
  unmasked: o_t = q_t^T (S_t + ridge I) C_t
  paper:    G_t = g^(t+1) G0 + sum_{i <= t} g^(t-i) k_i (k_i^T C_{i-1}),
            o_t = q_t^T (S_t + ridge I) C_t - q_t^T G_t
Every term is a token sum with its decay power, so nothing is carried token to token, an
initial state enters as its decayed summaries, and the cost is O(T^2 D) per head.
"""

from __future__ import annotations

import torch

from mixers.hla.hla2.state import (operator_form, pack, unpack, value_keys, with_ones,
                                   zero_packed)


def hla2_naive(q, k, v, *, masked=True, normalize=False, eps=1e-6, ridge=0.0, decay=None,
               decay_form="masked", initial_state=None) -> torch.Tensor:
    """o [B, T, H, Dv] in float64 from `initial_state` (None: zeros; the keys of state.py);
    k, v may have one shared head (multi-query)."""
    o, _ = _explicit_sums(q, k, v, masked=masked, normalize=normalize, ridge=ridge,
                          decay=decay, decay_form=decay_form, initial_state=initial_state)
    if normalize:
        o = o[..., :-1] / (o[..., -1:] + eps)
    return o.transpose(1, 2)


def hla2_naive_final_state(q, k, v, *, masked=True, normalize=False, eps=1e-6, ridge=0.0,
                           decay=None, decay_form="masked", initial_state=None) -> dict:
    """The state after the last token (the keys and shapes of state.py), in float64, from
    `initial_state` (None: zeros). `eps` does not enter the state."""
    _, final = _explicit_sums(q, k, v, masked=masked, normalize=normalize, ridge=ridge,
                              decay=decay, decay_form=decay_form, initial_state=initial_state)
    kv_heads = k.shape[2]
    form = operator_form(masked, decay, decay_form)
    if kv_heads == 1 and final["S"].shape[1] > 1:  # multi-query: S is stored once
        if not torch.equal(final["S"], final["S"][:, :1].expand_as(final["S"])):
            raise ValueError("a shared S needs one decay for every head")
        final["S"] = final["S"][:, :1]
    return unpack(final, form, normalize, ridge)


def _explicit_sums(q, k, v, *, masked, normalize, ridge, decay, decay_form, initial_state):
    """(o' [B, H, T, Dv'], final packed state [B, H, ...]): the outputs before the division
    by the denominator (its column appended when normalizing, Dv' = Dv + 1) and the final
    summaries with every head's S."""
    form = operator_form(masked, decay, decay_form)
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))  # [B, H, T, .]
    B, H, T, D = q.shape
    k, v = k.expand(-1, H, -1, -1), v.expand(-1, H, -1, -1)
    if normalize:
        v = with_ones(v)
    if initial_state is None:
        start = zero_packed(form, normalize, ridge, B, H, 1, D, v.shape[-1] - int(normalize),
                            torch.float64, q.device)
    else:
        start = pack(initial_state, form, normalize, ridge)
    start = {key: x.double().expand(-1, H, -1, -1) for key, x in start.items()}

    g = torch.ones(H, dtype=torch.float64) if decay is None else \
        torch.as_tensor(decay, dtype=torch.float64).expand(H)
    g = g.to(q.device)
    pos = torch.arange(T, device=q.device)
    lag = pos.view(T, 1) - pos.view(1, T)                          # [t, s] = t - s

    def lagged(shift=0, strict=False):
        """[H, t, s]: g^(t-s-shift) where s <= t (s < t if strict), else 0."""
        inside = lag > 0 if strict else lag >= 0
        return torch.where(inside, g.view(H, 1, 1) ** (lag - shift).clamp(min=0), 0.0)

    def from_start(offset):
        """[H, T, 1]: g^(t + offset), the decay of an initial summary at token t."""
        return (g.view(H, 1) ** (pos + offset)).unsqueeze(-1)

    def to_end(left, right, power=1):
        """sum_s g^(power (T-1-s)) left_s right_s^T: [B, H, ., .], a summary at the end."""
        weight = g.view(H, 1) ** (power * (T - 1 - pos))
        return torch.einsum("hs,bhsd,bhse->bhde", weight, left, right)

    def read(x, summary):
        """x_t^T summary for every t: [B, H, T, .]."""
        return torch.einsum("bhtd,bhde->bhte", x, summary)

    def decayed_sum(weights, values):
        """sum_s weights[t, s] values_s."""
        return torch.einsum("bhts,bhse->bhte", weights, values)

    qk = q @ k.transpose(-1, -2)                                   # [t, s] = q_t . k_s
    final = {"S": g.view(H, 1, 1) ** T * start["S"] + to_end(k, k)}
    if "C" in value_keys(form, ridge):
        final["C"] = g.view(H, 1, 1) ** T * start["C"] + to_end(q, v)
    if form == "masked":
        # u_j = S_j q_j
        u = from_start(1) * read(q, start["S"].transpose(-1, -2)) + decayed_sum(lagged() * qk, k)
        o = (from_start(1) ** 2 * read(q, start["A"])
             + decayed_sum(lagged() ** 2 * (q @ u.transpose(-1, -2)), v))
        final["A"] = g.view(H, 1, 1) ** (2 * T) * start["A"] + to_end(u, v, power=2)
        if ridge:
            o = o + ridge * (from_start(1) * read(q, start["C"])
                             + decayed_sum(lagged() * (q @ q.transpose(-1, -2)), v))
        return o, final
    # r_t = (S_t + ridge I)^T q_t, read out against C_t
    r = from_start(1) * read(q, start["S"]) + decayed_sum(lagged() * qk, k) + ridge * q
    o = from_start(1) * read(r, start["C"]) + decayed_sum(lagged() * (r @ q.transpose(-1, -2)), v)
    if form == "paper":
        # c_i = k_i^T C_{i-1}
        c = from_start(0) * read(k, start["C"]) \
            + decayed_sum(lagged(shift=1, strict=True) * qk.transpose(-1, -2), v)
        o = o - from_start(1) * read(q, start["G"]) - decayed_sum(lagged() * qk, c)
        final["G"] = g.view(H, 1, 1) ** T * start["G"] + to_end(k, c)
    return o, final
