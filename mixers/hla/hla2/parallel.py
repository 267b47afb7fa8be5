"""hla2 in parallel form, for every option: the whole sequence as one block of masked T x T
products, with no chunks and no carried summaries (fla's "parallel" layout). The sums are
naive.py's, in the compute dtype. With P = Q K^T, Gam_p[t, s] = g^(p (t - s)) for s <= t,
g_in^p[t] = g^(p (t + 1)), g_out^p[s] = g^(p (T - 1 - s)) (sequence_decay.py):

masked (u_t = S_t q_t; the chain Y = la(q, k, k), o = la(q, Y, v) with decays g, g^2):
    U  = (Gam_1 * P) K + g_in Q S0^T
    O  = (Gam_2 * Q U^T) V + g_in^2 Q A0      (+ ridge ((Gam_1 * Q Q^T) V + g_in Q C0))
    A' = g^2T A0 + U^T (g_out^2 V)
unmasked (r_t = (S_t + ridge I)^T q_t):
    R  = (Gam_1 * P) K + ridge Q + g_in Q S0
    O  = (Gam_1 * R Q^T) V + g_in R C0
paper (c_i = C_{i-1}^T k_i; the unmasked O minus the §4.3 correction):
    Cb = (Gam_1 shifted one token, strict * P^T) V + g^i K C0
    O  = unmasked O - (Gam_1 * P) Cb - g_in Q G0
    G' = g^T G0 + K^T (g_out Cb)
and S' = g^T S0 + K^T (g_out K), C' = g^T C0 + Q^T (g_out V) where carried.

Cost per head: about 4 T^2 D-sized products (masked), against the chunk form's per-chunk
d x d summaries and its (P * L) Wd^T product, cubic in the chunk; memory T x T per head, so
this form is for short sequences. Start-state terms are skipped for a zero start, final
summaries when not asked for.
"""

from __future__ import annotations

from mixers.hla.hla2.state import compute_inputs, finish, value_keys
from mixers.hla.sequence_decay import SequenceDecay, scaled


def hla2_parallel(q, k, v, *, form, normalize, eps, ridge, g, packed, zero_start,
                  output_final_state) -> tuple:
    """[B, T, H, .] inputs (k, v may have one head), packed initial state (its values unread
    when `zero_start`) -> (o [B, T, H, Dv], packed final state | None), both in the state's
    (compute) dtype."""
    q, k, v = compute_inputs(q, k, v, packed, normalize)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))                      # [B, h, T, .]
    T = q.shape[2]
    dec = SequenceDecay(None if g is None else g.log(), T, q.dtype, q.device)
    start = None if zero_start else packed
    P = q @ k.mT
    Wd = P * dec.causal()
    keys = ("S",) + value_keys(form, ridge)
    summaries = {}                               # what the final state sums besides its start

    if form == "masked":
        U = Wd @ k
        if start is not None:
            U = U + scaled(q @ start["S"].mT, dec.from_start())
        o = ((q @ U.mT) * dec.causal(2)) @ v
        if start is not None:
            o = o + scaled(q @ start["A"], dec.from_start(2))
        if ridge:
            o = o + ridge * ((q @ q.mT) * dec.causal()) @ v
            if start is not None:
                o = o + ridge * scaled(q @ start["C"], dec.from_start())
        summaries["A"] = lambda: U.mT @ scaled(v, dec.to_end(2))
    else:
        R = Wd @ k
        if ridge:
            R = R + ridge * q
        if start is not None:
            R = R + scaled(q @ start["S"], dec.from_start())
        o = ((R @ q.mT) * dec.causal()) @ v
        if start is not None:
            o = o + scaled(R @ start["C"], dec.from_start())
        if form == "paper":
            Cb = (P.mT * dec.causal(shift=1)) @ v
            if start is not None:
                Cb = Cb + scaled(k @ start["C"], dec.from_start(offset=0))
                o = o - scaled(q @ start["G"], dec.from_start())
            o = o - Wd @ Cb
            summaries["G"] = lambda: k.mT @ scaled(Cb, dec.to_end())
    o = finish(o, normalize, eps).transpose(1, 2)
    if not output_final_state:
        return o, None

    kv = dec.heads(k.shape[1])                   # a shared S decays as every head alike
    summaries["S"] = lambda: k.mT @ scaled(k, kv.to_end())
    summaries["C"] = lambda: q.mT @ scaled(v, dec.to_end())
    final = {}
    for key in keys:
        power, decay = (2, dec) if key == "A" else (1, kv if key == "S" else dec)
        final[key] = summaries[key]()
        if start is not None:
            final[key] = final[key] + scaled(start[key], decay.total(power))
    return o, final
