"""AHLA in parallel form: the whole sequence as one block of masked T x T products, with no
chunks and no carried summaries (fla's "parallel" layout). With W = Gam * (Q K^T),
Gam[t, s] = g^(t - s) for s <= t, g_in[t] = g^(t + 1), g_out[s] = g^(T - 1 - s):

    X  = W V + g_in (Q P0)                 rows x_t = P_t^T q_t
    O  = W X + g_in (Q E0)
    P' = g^T P0 + K^T (g_out V)
    E' = g^T E0 + K^T (g_out X)            (E_t = g E_{t-1} + k_t x_t^T)

Cost per head: 3 T^2 D-sized products (Q K^T, W V, W X), plus T D Dv ones for each start
state given and for the final state when asked for; the chunk form instead forms its d x dv
summaries for every chunk. Memory: T x T per head, so this form is for short sequences.
"""

from __future__ import annotations

import torch

from mixers.hla.sequence_decay import SequenceDecay, scaled


def ahla2_parallel(q, k, v, P0, E0, decay, need_final: bool):
    """q, k `[B, H, T, D]`, v `[B, H, T, Dv]` (compute dtype); P0, E0 `[B, H, D, Dv]` or None
    (zeros) -> (outputs `[B, H, T, Dv]`, (P, E), or None when not `need_final`)."""
    T = q.shape[2]
    log_g = None if decay is None else torch.log(decay.to(q.dtype))
    dec = SequenceDecay(log_g, T, q.dtype, q.device)
    W = (q @ k.mT) * dec.causal()
    X = W @ v
    if P0 is not None:
        X = X + scaled(q @ P0, dec.from_start())
    o = W @ X
    if E0 is not None:
        o = o + scaled(q @ E0, dec.from_start())
    if not need_final:
        return o, None
    P = k.mT @ scaled(v, dec.to_end())
    E = k.mT @ scaled(X, dec.to_end())
    if P0 is not None:
        P = P + scaled(P0, dec.total())
    if E0 is not None:
        E = E + scaled(E0, dec.total())
    return o, (P, E)
