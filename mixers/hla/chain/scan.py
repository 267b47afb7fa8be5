"""The scan over chunks of a link's states, forward and backward. Each chunk's entry of a
per-chunk buffer `[B * H, NT, DK, W]` holds its increment (states.py, grad_states.py) and
is replaced, in place, by the running value before it:

    forward, first chunk to last:  X_c = the start state of chunk c,        X <- g^n X + dS_c
    backward, last chunk to first: X_c = the gradient of chunk c's end state, X <- g^n X + dG_c

(n the chunk's real tokens), from X0 (zeros when absent); the value after the last step goes
to X1 (the final state, or the gradient of the start state). One program per block of
BLOCK entries of one (batch, head)'s DK x W state, all chunks in a loop; the loads do not
depend on the carried value, so each is issued four steps before its use, and the
increments, the work of the stage, were computed for all chunks at once. The loop's bound
is a compile-time power of two (one compile per bucket of NT; the Triton interpreter
cannot loop to a runtime bound): steps past the last chunk load zeros, decay by 1 and
change nothing."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chunk_at(step, NT, REVERSE: tl.constexpr):
    """The chunk a scan's step visits (clamped into range for steps past the last)."""
    if REVERSE:
        chunk = tl.maximum(NT - 1 - step, 0)
    else:
        chunk = tl.minimum(step, NT - 1)
    return chunk


@triton.jit
def _increment(BUF, bh, step, NT, SIZE, at, ok, REVERSE: tl.constexpr):
    """The increment a step reads (zeros past the last chunk)."""
    where = (bh.to(tl.int64) * NT + _chunk_at(step, NT, REVERSE)) * SIZE + at
    return tl.load(BUF + where, mask=ok & (step < NT), other=0.0)


@triton.jit
def chain_scan_kernel(BUF, LOG_G, X0, X1, T, H, NT, SIZE, C: tl.constexpr,
                      BLOCK: tl.constexpr, NT_BOUND: tl.constexpr, REVERSE: tl.constexpr,
                      HAS_DECAY: tl.constexpr, HAS_X0: tl.constexpr):
    acc: tl.constexpr = X1.dtype.element_ty
    pid, bh = tl.program_id(0), tl.program_id(1)
    at = pid * BLOCK + tl.arange(0, BLOCK)
    ok = at < SIZE
    head = bh.to(tl.int64) * SIZE + at
    if HAS_X0:
        x = tl.load(X0 + head, mask=ok, other=0.0).to(acc)
    else:
        x = tl.zeros([BLOCK], dtype=acc)
    if HAS_DECAY:
        log_g = tl.load(LOG_G + bh % H).to(acc)
    # The increments of the next four steps are in flight while a step runs: a load stalls
    # only where its value is used, four steps after it was issued.
    ahead0 = _increment(BUF, bh, 0, NT, SIZE, at, ok, REVERSE)
    ahead1 = _increment(BUF, bh, 1, NT, SIZE, at, ok, REVERSE)
    ahead2 = _increment(BUF, bh, 2, NT, SIZE, at, ok, REVERSE)
    ahead3 = _increment(BUF, bh, 3, NT, SIZE, at, ok, REVERSE)
    for step in range(NT_BOUND):
        increment = ahead0
        ahead0, ahead1, ahead2 = ahead1, ahead2, ahead3
        ahead3 = _increment(BUF, bh, step + 4, NT, SIZE, at, ok, REVERSE)
        chunk = _chunk_at(step, NT, REVERSE)
        real = step < NT
        tl.store(BUF + (bh.to(tl.int64) * NT + chunk) * SIZE + at, x, mask=ok & real)
        if HAS_DECAY:
            n = tl.minimum(T - chunk * C, C).to(acc)
            x = x * tl.where(real, tl.exp(n * log_g), 1.0) + increment
        else:
            x = x + increment
    tl.store(X1 + head, x, mask=ok)
