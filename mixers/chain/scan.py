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
def chain_scan_kernel(BUF, LOG_G, X0, X1, T, H, NT, SIZE, C: tl.constexpr,
                      BLOCK: tl.constexpr, NT_BOUND: tl.constexpr, REVERSE: tl.constexpr,
                      HAS_DECAY: tl.constexpr, HAS_X0: tl.constexpr):
    acc: tl.constexpr = X1.dtype.element_ty
    pid, bh = tl.program_id(0), tl.program_id(1)
    at = pid * BLOCK + tl.arange(0, BLOCK)
    ok = at < SIZE
    head = bh.to(tl.int64) * SIZE + at
    first = bh.to(tl.int64) * NT * SIZE + at  # entry (bh, chunk 0); chunk c is c * stride on
    stride = (at * 0).to(tl.int64) + SIZE     # in int64: NT * SIZE may pass 2^31
    if HAS_X0:
        x = tl.load(X0 + head, mask=ok, other=0.0).to(acc)
    else:
        x = tl.zeros([BLOCK], dtype=acc)
    if HAS_DECAY:
        log_g = tl.load(LOG_G + bh % H).to(acc)
    # The increments of the next four steps are in flight while a step runs: a load stalls
    # only where its value is used, four steps after it was issued. Step s visits chunk
    # s (NT - 1 - s in reverse), clamped into range past the last; those steps read zeros.
    # (No helper calls in the loop: each costs a module patch under the interpreter.)
    sign = -1 if REVERSE else 1
    origin = NT - 1 if REVERSE else 0
    ahead0 = tl.load(BUF + first + origin * stride, mask=ok & (0 < NT), other=0.0)
    ahead1 = tl.load(BUF + first + tl.minimum(tl.maximum(origin + sign * 1, 0), NT - 1) * stride,
                     mask=ok & (1 < NT), other=0.0)
    ahead2 = tl.load(BUF + first + tl.minimum(tl.maximum(origin + sign * 2, 0), NT - 1) * stride,
                     mask=ok & (2 < NT), other=0.0)
    ahead3 = tl.load(BUF + first + tl.minimum(tl.maximum(origin + sign * 3, 0), NT - 1) * stride,
                     mask=ok & (3 < NT), other=0.0)
    for step in range(NT_BOUND):
        increment = ahead0
        ahead0, ahead1, ahead2 = ahead1, ahead2, ahead3
        far = tl.minimum(tl.maximum(origin + sign * (step + 4), 0), NT - 1)
        ahead3 = tl.load(BUF + first + far * stride, mask=ok & (step + 4 < NT), other=0.0)
        chunk = tl.minimum(tl.maximum(origin + sign * step, 0), NT - 1)
        real = step < NT
        tl.store(BUF + first + chunk * stride, x, mask=ok & real)
        if HAS_DECAY:
            n = tl.minimum(T - chunk * C, C).to(acc)
            x = x * tl.where(real, tl.exp(n * log_g), 1.0) + increment
        else:
            x = x + increment
    tl.store(X1 + head, x, mask=ok)
