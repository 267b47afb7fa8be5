"""hla2 in chunk-parallel matmul form (docs/kernels.md), for every option.

Split the sequence into chunks of L tokens (local positions r, s, u = 1..L) with carried
states at the chunk start, P = Q K^T, lower = [r >= s], Gam[r, s] = g^(r-s) [r >= s],
Wd = P * Gam, and diag(g^e) written as rows(e). Every term below is a batched matmul over
all chunks at once; the carried states are exclusive decayed prefix sums over chunks.

masked (weights g^((t-i)+(t-j)) on i <= j <= t; carried S0, A0):
    O  = ((P*lower) Wd^T * Gam^2) V + rows(2r) Q A0 + ((Q S0 Q^T) * Gam^2 * g^s) V
    S' = g^L S0 + K^T rows(L-u) K
    A' = g^2L A0 + S0 Q^T rows(2L-s) V + K^T Wd^T rows(2(L-s)) V
unmasked (carried S0, C0), o_t = q_t^T S_t C_t:
    O  = rows(2r) Q S0 C0 + rows(r) ((Q S0 Q^T) * Gam) V + rows(r) Wd K C0 + ((Wd P^T) * Gam) V
    C' = g^L C0 + Q^T rows(L-s) V
paper (§4.3 recurrence, G_t = g G_{t-1} + k_t k_t^T C_{t-1}; carried S0, C0, G0):
    O  = unmasked O - rows(r) Q G0 - rows(r-1) (P*lower) K C0 - Wd R V,
         R[u, s] = g^(u-1-s) (k_u . q_s) [s < u]
    G' = g^L G0 + g^(L-1) (K^T K) C0 + K^T rows(L-u) R V
ridge adds ridge * (rows(r) Q C0 + ((Q Q^T) * Gam) V); normalize runs v with a ones column.

Padding: a short last chunk is zero-padded; padded tokens cannot reach real outputs, and the
final state is recomputed from the last chunk's start with its true length, so padding never
decays it.
"""

from __future__ import annotations

import math

import torch

from mixers.common import pad_to_multiple
from mixers.hla.hla2.state import compute_inputs, finish, value_keys

# decay power each summary takes per token: S, C, G decay by g, A by g^2
_POWER = {"S": 1, "C": 1, "G": 1, "A": 2}


class _Decay:
    """Decay factors for a chunk of `length` tokens at local positions 1..length.

    log_g: [Hg, 1, 1, 1] or None (no decay: every factor is 1 and is skipped, so the
    undecayed path does no elementwise work for it)."""

    def __init__(self, log_g: torch.Tensor | None, length: int, dtype, device):
        self.log_g, self.length = log_g, length
        self.pos = torch.arange(1, length + 1, dtype=dtype, device=device)
        diff = self.pos.view(-1, 1) - self.pos.view(1, -1)  # r - s
        self.lower = (diff >= 0).to(dtype)
        strict = (diff > 0).to(dtype)
        if log_g is None:
            self.gamma, self.shifted = self.lower, strict
        else:
            self.gamma = torch.exp(log_g * diff.clamp(min=0)) * self.lower
            # g^(u-1-s) for s < u: how C_{u-1} weighs earlier tokens (paper cross term)
            self.shifted = torch.exp(log_g * (diff - 1).clamp(min=0)) * strict

    def rows(self, exponent) -> torch.Tensor | None:
        """[Hg, 1, L, 1]: scales row r by g^exponent[r]."""
        return None if self.log_g is None else torch.exp(self.log_g * exponent.view(-1, 1))

    def cols(self, exponent) -> torch.Tensor | None:
        """[Hg, 1, 1, L]: scales column s by g^exponent[s]."""
        return None if self.log_g is None else torch.exp(self.log_g * exponent.view(1, -1))

    def power(self, exponent: float) -> torch.Tensor | None:
        return None if self.log_g is None else torch.exp(self.log_g * exponent)


def _scale(x: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
    return x if factor is None else x * factor


def _blocks(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """[B, T, h, d] -> [B, h, N, chunk, d], zero-padded."""
    x = pad_to_multiple(x, chunk)
    B, T, h, d = x.shape
    return x.view(B, T // chunk, chunk, h, d).permute(0, 3, 1, 2, 4).contiguous()


def _deltas(form, ridge, qc, kc, vc, P, Wd, dec) -> dict:
    """Per-chunk contributions to the end-of-chunk states that need no carried state."""
    L, pos = dec.length, dec.pos
    d = {"S": kc.mT @ _scale(kc, dec.rows(L - pos))}
    if form != "masked" or ridge:
        d["C"] = qc.mT @ _scale(vc, dec.rows(L - pos))
    if form == "masked":
        d["X"] = qc.mT @ _scale(vc, dec.rows(2 * L - pos))
        d["A"] = kc.mT @ (Wd.mT @ _scale(vc, dec.rows(2 * (L - pos))))
    elif form == "paper":
        d["RV"] = (P.mT * dec.shifted) @ vc
        d["Kbar"] = kc.mT @ kc
        d["G"] = kc.mT @ _scale(d["RV"], dec.rows(L - pos))
    return d


def _increment(key, starts, d, dec) -> torch.Tensor:
    """What a chunk adds to summary `key`, given the other summaries at its start."""
    if key == "A":
        return starts["S"] @ d["X"] + d["A"]
    if key == "G":
        return _scale(d["Kbar"] @ starts["C"], dec.power(dec.length - 1)) + d["G"]
    return d[key]


def _exclusive_scan(increments, init, log_rho):
    """starts[0] = init, starts[n] = rho * starts[n-1] + increments[n-1] along dim 2.

    Log-depth (Hillis-Steele) when decayed, so it stays cheap for thousands of chunks."""
    x = torch.cat([init.unsqueeze(2), increments[:, :, :-1]], 2)
    if log_rho is None:
        return x.cumsum(2)
    step = 1
    while step < x.shape[2]:
        shifted = torch.exp(step * log_rho) * x[:, :, :-step]
        x = torch.cat([x[:, :, :step], x[:, :, step:] + shifted], 2)
        step *= 2
    return x


def _outputs(form, ridge, qc, kc, vc, P, Wd, dec, starts, d) -> torch.Tensor:
    pos = dec.pos
    QS0 = qc @ starts["S"]
    if form == "masked":
        gamma2 = dec.gamma ** 2
        W = Wd if dec.log_g is None else P * dec.lower
        o = ((W @ Wd.mT) * gamma2) @ vc
        o = o + _scale(qc @ starts["A"], dec.rows(2 * pos))
        o = o + _scale((QS0 @ qc.mT) * gamma2, dec.cols(pos)) @ vc
    else:
        KC0 = kc @ starts["C"]
        o = _scale(QS0 @ starts["C"], dec.rows(2 * pos))
        o = o + _scale(((QS0 @ qc.mT) * dec.gamma) @ vc + Wd @ KC0, dec.rows(pos))
        o = o + ((Wd @ P.mT) * dec.gamma) @ vc
        if form == "paper":
            o = o - _scale(qc @ starts["G"], dec.rows(pos)) - Wd @ d["RV"]
            o = o - _scale((P * dec.lower) @ KC0, dec.rows(pos - 1))
    if ridge:
        o = o + ridge * (_scale(qc @ starts["C"], dec.rows(pos)) + ((qc @ qc.mT) * dec.gamma) @ vc)
    return o


def hla2_chunk(q, k, v, *, form, normalize, eps, ridge, g, packed, chunk_size,
               output_final_state) -> tuple:
    """[B, T, H, .] inputs, packed initial state -> (o, packed final state | None), both in
    the state's (compute) dtype."""
    B, T, H, _ = q.shape
    q, k, v = compute_inputs(q, k, v, packed, normalize)
    dtype = q.dtype
    chunk = min(chunk_size, T)
    log_g = None if g is None else g.log().view(-1, 1, 1, 1)
    dec = _Decay(log_g, chunk, dtype, q.device)
    qc, kc, vc = (_blocks(x, chunk) for x in (q, k, v))
    P = qc @ kc.mT
    Wd = P * dec.gamma

    d = _deltas(form, ridge, qc, kc, vc, P, Wd, dec)
    starts = {}
    for key in ("S",) + value_keys(form, ridge):
        log_rho = None if g is None else _POWER[key] * chunk * log_g
        starts[key] = _exclusive_scan(_increment(key, starts, d, dec), packed[key], log_rho)

    o = finish(_outputs(form, ridge, qc, kc, vc, P, Wd, dec, starts, d), normalize, eps)
    o = o.permute(0, 2, 3, 1, 4).reshape(B, -1, H, o.shape[-1])[:, :T]

    final = None
    if output_final_state:
        tail = T - (math.ceil(T / chunk) - 1) * chunk
        last = [x[:, :, -1:, :tail] for x in (qc, kc, vc)]
        dec_tail = _Decay(log_g, tail, dtype, q.device)
        P_tail = last[0] @ last[1].mT
        d_tail = _deltas(form, ridge, *last, P_tail, P_tail * dec_tail.gamma, dec_tail)
        last_starts = {key: x[:, :, -1:] for key, x in starts.items()}
        final = {key: (_scale(last_starts[key], dec_tail.power(_POWER[key] * tail))
                       + _increment(key, last_starts, d_tail, dec_tail)).squeeze(2)
                 for key in starts}
    return o, final
