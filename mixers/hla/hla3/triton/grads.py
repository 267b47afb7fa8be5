"""The gradients of one causal hla3 chunk (the backward's third stage, grad_chunks.py).
From the chunk's rows, its start states (S0, P0, F0) and the gradients of its end states
(dS, this value block's part; dP, dF), with r = Q P0 + LA V,
Bm = L * ((Q S0) Q^T + A LA^T) and Y = LA^T r (S0 and so S^K symmetric):

    dr  = Bm^T dO + (Q S0) dF + LA (K dF)          dBm = L * (dO r^T)
    dLA = dr V^T + dBm^T A + r (K dF)^T            dA  = dBm LA + L * dLA
    dQ  = dr P0^T + dO F0^T + (dBm + dBm^T) (Q S0) + r dF^T S0 + dA K
    dK  = dA^T Q + Y dF^T + K (dS + dS^T) + V dP^T
    dV  = LA^T dr + K dP

dQ and dK are this value block's parts (they sum over value columns).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def hla3_chunk_grads(q, k, v, A, LA, dO, S0, P0, F0, dS, dP, dF, C: tl.constexpr,
                     PRECISION: tl.constexpr, acc: tl.constexpr):
    """(dQ, dK, dV, dBm, dr, r) of one chunk (see the module's equations)."""
    rows = tl.arange(0, C)
    causal = rows[:, None] >= rows[None, :]
    r = tl.dot(q, P0, input_precision=PRECISION) + tl.dot(LA, v, input_precision=PRECISION)
    QS = tl.dot(q, S0, input_precision=PRECISION)
    Bm = tl.dot(QS, tl.trans(q), input_precision=PRECISION)
    Bm += tl.dot(A, tl.trans(LA), input_precision=PRECISION)
    Bm = tl.where(causal, Bm, 0.0).to(acc)
    kdF = tl.dot(k, dF, input_precision=PRECISION)
    dr = tl.dot(tl.trans(Bm), dO, input_precision=PRECISION)
    dr += tl.dot(QS, dF, input_precision=PRECISION)
    dr += tl.dot(LA, kdF, input_precision=PRECISION)
    dBm = tl.where(causal, tl.dot(dO, tl.trans(r), input_precision=PRECISION), 0.0).to(acc)
    dLA = tl.dot(dr, tl.trans(v), input_precision=PRECISION)
    dLA += tl.dot(tl.trans(dBm), A, input_precision=PRECISION)
    dLA += tl.dot(r, tl.trans(kdF), input_precision=PRECISION)
    dA = tl.dot(dBm, LA, input_precision=PRECISION) + tl.where(causal, dLA, 0.0).to(acc)
    rdF = tl.dot(r, tl.trans(dF), input_precision=PRECISION)
    dQ = tl.dot(dr, tl.trans(P0), input_precision=PRECISION)
    dQ += tl.dot(dO, tl.trans(F0), input_precision=PRECISION)
    dQ += tl.dot(dBm + tl.trans(dBm), QS, input_precision=PRECISION)
    dQ += tl.dot(rdF, S0, input_precision=PRECISION)
    dQ += tl.dot(dA, k, input_precision=PRECISION)
    Y = tl.dot(tl.trans(LA), r, input_precision=PRECISION)
    dK = tl.dot(tl.trans(dA), q, input_precision=PRECISION)
    dK += tl.dot(Y, tl.trans(dF), input_precision=PRECISION)
    dK += tl.dot(k, dS + tl.trans(dS), input_precision=PRECISION)
    dK += tl.dot(v, tl.trans(dP), input_precision=PRECISION)
    dV = tl.dot(tl.trans(LA), dr, input_precision=PRECISION)
    dV += tl.dot(k, dP, input_precision=PRECISION)
    return dQ, dK, dV, dBm, dr, r
