"""Fused Triton forms of masked hla2 (its chunk form): a differentiable chunked op,
hla2_triton, and a decode step, hla2_step_triton. Each checks that the kernels support its
inputs and runs; mixers.hla.hla2 (hla2, hla2_step with impl="triton") validates a call once
and runs the unchecked internals.

One module per stage, each with its @triton.jit kernels and the host function that launches
them; every launcher takes the call's LaunchPlan (plan.py), computed once per call from its
shape, dtype, device and whether a backward pass follows:
  common.py      the chunk form's equations, layouts and non-finite rule; shared helpers
  plan.py        what the kernels support; LaunchPlan, ScanPlan, plan_launch
  increments.py  forward 1: per-chunk increments (grid D/increments_rows x NT x B*H; D, Dv
                 here and below their power-of-two blocks)
  scans.py       forward 2 and backward 2: the state scan and the reverse gradient scan
                 (grid D/rows x n_seg x B*H, a loop over the chunks of a segment)
  output.py      forward 3: outputs per chunk (grid Dv/output_cols x NT C/output_rows x B*H)
  backward.py    backward 1 and 3: gradient terms Q^T dO and Q^T P Q per chunk, then dq/dk/dv
                 (one launch per entry of grad_launches: two from head dim 128)
  chunked.py     hla2_triton: the stages combined, with the autograd function
  paper.py       decay_form="paper": its sequential walks, forward, backward and decode step
  decode.py      hla2_step_triton: the masked form's decode step
  chained.py     masked hla2 as two chained causal linear attentions (mixers/chain) for
                 the inputs the kernels above do not take: head dims 257 to 512, fp16 and
                 fp32 above 128, float64 (mixers.hla.hla2's impl="triton" picks it)
The backward reads each chunk's start states and X from the forward, which keeps them. When
its 16-row programs cannot fill the GPU (B = 1 at 64k tokens), a scan runs in two levels
(ScanPlan.n_seg > 1). A 16-bit forward alone at chunk 128 and head dim 128 takes its own
paths (increments_halves, late_states, states_out_of_place: increments in two halves of
tokens, the output's late state loads, and the states scanned into buffers of their own, 2
more per-chunk buffers).
Memory: per-chunk [D, D] and [D, Dv] buffers per head, bf16 for bf16 inputs (as many
elements per token as q when C = D): the forward's 3 (states S, A and X) are kept for
backward, which adds 2 (normalize adds fp32 [D] vectors per chunk, and a [B, T, H] fp32
denominator); segment summaries are fp32 and small. Scan loop bounds are powers of two
(masked past the chunk count), so a sweep over T compiles them once per power-of-two bucket.

Supported: masked hla2, no decay, decay_form="masked" or "paper" (per-head decay),
normalize (masked form: the denominator is a ones value column carried as [D] vectors next
to A in the same launches), initial_state with gradients, output_final_state, any T,
any head dims D and Dv from 1 to 256 (MAX_HEAD_DIM), independently: each is held in a block
of the next power of two from 16, with loads and stores masked by the true dim inside the
kernels (the inputs are neither copied nor padded); powers of two from 16 to 128 are their
own blocks and run the tuned launches. fp16/bf16/fp32 inputs, multi-query (k, v with one
head: broadcast to the query heads, S returned once).
Not supported (the dispatcher falls back): masked=False, ridge != 0, the paper decay form
above head dim 64 (PAPER_MAX_HEAD_DIM), and the masked form's chunked op with fp16 or fp32
inputs at a head dim above 128 (their fp32 chunk states' [D, D] tiles do not fit an SM's
shared memory; bf16 runs there, and so does the decode step in every dtype).
fp16 inputs feed the carried state S to fp16 matmuls, which overflow once S exceeds 65504
(long sequences of large keys); prefer bf16.
"""

from mixers.hla.hla2.triton.chained import chain_unsupported_reason, hla2_chain_unchecked
from mixers.hla.hla2.triton.chunked import _hla2_triton_unchecked, hla2_triton
from mixers.hla.hla2.triton.decode import _step_unchecked, hla2_step_triton
from mixers.hla.hla2.triton.plan import (CHUNK_SIZES, DTYPES, HEAD_DIMS, MAX_HEAD_DIM,
                                         PAPER_MAX_HEAD_DIM, LaunchPlan, ScanPlan, plan_call,
                                         plan_launch, triton_unsupported_reason)

__all__ = ["hla2_triton", "hla2_step_triton", "triton_unsupported_reason",
           "chain_unsupported_reason", "LaunchPlan",
           "ScanPlan", "plan_launch", "plan_call", "HEAD_DIMS", "MAX_HEAD_DIM", "CHUNK_SIZES",
           "DTYPES", "PAPER_MAX_HEAD_DIM"]
