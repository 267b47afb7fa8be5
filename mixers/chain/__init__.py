"""Causal linear attention with a per-head decay, in Triton: the one primitive the Triton
forms of ahla2 and causal hla3 are built from (paper §6 and §7).

    la(q, k, v; S0, g)_t = q_t^T S_t,   S_t = g S_{t-1} + k_t v_t^T,   S_{-1} = S0

Both operators are chains of it over the same queries (T x d outputs, d x dv states, no
d x d x dv products per chunk):

    ahla2:  X = la(q, k, v; P0, g),        o = la(q, k, X; E0, g)
    hla3:   Y = la(q, k, k; S0),  R = la(q, k, v; P0),   o = la(q, Y, R; F0)

For AHLA the rows of X are r_i = q_i^T P_i, and E_t = sum_{i<=t} g^(t-i) k_i r_i^T is
Alg. 2's E (each path j -> i -> t decays once per step). For causal hla3 the keys of the last
link are y_u = S^K_u q_u and its values r_u = q_u^T P_u, so its state is F_t = sum_{u<=t}
y_u r_u^T, the recurrence of mixers/hla/hla3 (F_t = F_{t-1} + (S^K_t q_t)(q_t^T P_t)). The
links' final states are the operators' states: (P, E) and (S^K, P, F).

  plan.py         ChainPlan, plan_chain: chunk, key and value blocks, warps, the scan's launch,
                  when a link walks, the forward's layout
  terms.py        a chunk's decay weights and causal mask
  states.py       forward: every chunk's increment of the state at once
  scan.py         the scan over chunks (forward and reverse) that turns increments into
                  each chunk's start state (or the gradient of its end state), in place
  output.py       forward: every chunk's outputs at once from its start state
  grad_states.py  backward: every chunk's increment of the state gradient at once
  grad_keys.py    backward: dq and dk of every chunk at once (added into buffers shared
                  by the links of a chain)
  grad_values.py  backward: dv of every chunk at once
  grad_fused.py   backward: dq, dk and dv of a chunk in one program (a plan's option)
  walk.py         the states of a short link (or their gradients) by walking the chunks,
                  in place of states.py (grad_states.py) and scan.py
  tiled.py        the forward in fla's layout (a plan's option): a state walk per key
                  block x value block tile and an output program per value block and chunk
  launch.py       forward() and backward() of one link: the launches above

Inputs are read in place from `[B, T, H, *]` tensors (last dim contiguous); rows past T and
columns past the head dims are masked loads of zero, so any head dim up to 512 runs with
power-of-two blocks and no copy. A link's values may carry a column of ones after the last
real one (the denominator of a normalized operator). Arithmetic, states and outputs in
float32 (float64 for float64 inputs); products of 16-bit inputs in tf32, which holds them
exactly.

Non-finite inputs (the rule of mixers/common.py) are kept inside the kernels: a NaN or
inf token reaches later chunks through the chunk states; within a chunk the causal mask
selects (a later row reads 0, not 0 * NaN) and non-finite values read as 0 with NaN added
to the rows from the first such row on. The backward kernels read non-finite q, k and v as
0 and add NaN to the gradient rows of the operator's own non-finite inputs (not of a link's
inputs that an earlier link computed). Normalized outputs are read out with
mixers.common.kernel_read_out.
"""

from mixers.chain.launch import backward, forward
from mixers.chain.plan import ChainPlan, plan_chain

__all__ = ["ChainPlan", "plan_chain", "forward", "backward"]
