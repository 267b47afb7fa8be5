"""What the stages of the hla2 Triton kernels share: the chunk form (below), the @triton.jit
helpers every kernel calls, the autotuning of the per-chunk kernels, and the host helpers of
the launchers.

Masked hla2 in chunk form with optional per-head decay g (the "masked" decay form,
docs/discrepancies.md):
S_t = g S_{t-1} + k k^T, A_t = g^2 A_{t-1} + (S_t q_t) v_t^T, o_t = q_t^T A_t. Per chunk of
n <= C real tokens with carried state (S0, A0), local Q, K, V, local position s = 0..C-1 and
    b_s = g^(s+1),  e_s = g^(n-1-s) (0 past n),  Dm_ts = g^(t-s) (t >= s, else 0),
    G = g^n,  W = L * (Q K^T),  Wd = Dm * (Q K^T):
    O  = b^2 * (Q A0) + (Dm * (b * (Q S0 Q^T) + Wd W^T)) V            (row scalings)
    S1 = G S0 + K^T E K
    A1 = G^2 A0 + S0 X + K^T E W^T E V,  X = G Q^T E V                  (E = diag(e))
Without decay every factor is 1 and this is the plain chunk form. The per-chunk increments
dS = K^T E K, X, dA = K^T E W^T E V do not depend on the carried state, so they are
computed for all chunks in parallel (increments.py); a scan over chunks turns them into the
carried states (A needs one small matmul S0 X per chunk; scans.py), and the output kernel is
parallel again (output.py). The backward pass mirrors this with a reverse scan of the state
gradients (backward.py). Padded positions of the last chunk have zero q, k, v and do not
decay the state (n counts real tokens only).
Normalize (NORMALIZE) is the same form on a ones value column (E V = e): its X, dA and A
columns are [D] vectors carried next to the matrices in the same kernels, and the output
kernel divides by it. Its matrix-vector products are fp32 sums, not dots on 16 equal
columns: Triton 3.6 compiles such dots into out-of-bounds shared-memory reads on Hopper.

Layouts: q, k [B, T, H, D] and v, o [B, T, H, DV], contiguous, any D, DV up to 256. The
kernels hold D and DV in blocks PD, PDV, the next powers of two from 16 (_block), with every
load and store masked by the true dim (_dim_ok, _tile_ok): the padding reads as zero and adds
zero rows and columns to every product. Where a block equals its dim the masks are constant
true and fold away, so power-of-two dims compile as if there were none. Per-chunk buffers are
[B*H, NT, D, D] or [B*H, NT, D, DV], in bf16 for bf16 inputs (the matmuls read them in bf16
anyway; the scans accumulate in fp32) and fp32 otherwise; the scans overwrite the increments
with the states, unless the launch plan gives the states buffers of their own.
Loop bounds are compile-time powers of two (the Triton interpreter cannot loop over a
runtime bound with numpy 2); steps past the runtime count NT are masked, so one compile
serves every T of the same power-of-two bucket.
The parallel per-chunk kernels (increments, output, gradient terms, dq/dk/dv) write only
their own outputs, so the GPU may time them: they are autotuned over warp counts (see
_autotuned). The scans keep the fixed launch shape of the plan.

Non-finite inputs (the rule of mixers/common.py: a NaN or inf in q, k or v at token t
changes only the outputs at and after t). The increments take q, k, v as they are, so a
non-finite token makes its chunk's dS or dA, and every later chunk's carried state,
non-finite; X and its normalize column are stored with non-finite entries as 0 (dA carries
the value forward, and the backward's gA X^T stays 0 where gA is 0). The output kernel masks
its C x C products by selection, not by a multiply (a later row's NaN q or k reads 0, not
0 * NaN), and reads non-finite entries of v as 0 (in the masked M V a later row enters as
0 * v); it adds NaN to its rows from the first non-finite v row on. The backward kernels
read non-finite entries of q, k and v as 0 and add NaN to the gradients of those rows, so a
zero upstream gradient at the outputs from t on leaves every earlier gradient exact. The
paper form's walk reads non-finite entries of q, k and v as 0 throughout and carries a flag:
its outputs from the first non-finite token on, and its final states after one, are NaN.
None of this touches the scans' loops; the per-chunk kernels spend a compare and a select or
two per loaded entry (v in the output kernel, q, k, v in the backward) and a select per
C x C entry of the output's mixing matrix. Normalize's division passes a zero upstream
gradient at a poisoned output on as zero (normalize_grads in mixers/common.py).
"""

import torch
import triton
import triton.language as tl

from mixers.tiles import interpreted


def _autotuned(warps, key, first_only=None):
    """triton.autotune over num_warps in warps (the first is the fixed launch shape used
    before tuning, so tuning can only match or beat it), keyed on the arguments in key (see
    _SHAPE_KEY: the first call of each key picks). first_only(meta) -> True keeps
    only the first config for those compile-time arguments (where the others spill more
    registers). num_stages stays at its default: these kernels have no loops to
    pipeline. Under the interpreter (nothing to time) the plain kernel. A key that is not an
    argument would be ignored silently by triton.autotune, so it is an error here."""
    def wrap(kernel):
        unknown = set(key) - set(kernel.arg_names)
        if unknown:
            raise ValueError(f"autotune key {sorted(unknown)} names no argument of "
                             f"{kernel.__name__}")
        if interpreted():
            return kernel

        def prune(configs, named_args, **meta):
            return configs[:1] if first_only is not None and first_only(meta) else configs
        configs = [triton.Config({}, num_warps=w) for w in warps]
        return triton.autotune(configs, key=list(key),
                               prune_configs_by={"early_config_prune": prune})(kernel)
    return wrap


# Compile-time arguments shared by the per-chunk kernels' autotune keys (dtypes are keyed too).
# The kernels tuned over two warp counts also key on SIZE_CLASS, the bit length of the
# launch's program count (an argument the kernel body does not read): the best warp count
# depends on how many programs a launch runs, and without this key the first call of a shape
# (a short sequence, say) would choose the warps of every later size.
_SHAPE_KEY = ("D", "DV", "C", "HAS_DECAY", "NORMALIZE", "PREC")


@triton.jit
def _dim_ok(idx, N: tl.constexpr, BN: tl.constexpr):
    """idx < N for indices into a dim of N entries held in a block of BN (the next power of
    two, at least 16). Where the block is exactly N wide, a constant true instead: masks
    combined with it fold back to what they were without it, so a power-of-two head dim
    compiles as if there were no padding."""
    if BN == N:
        return tl.full(idx.shape, 1, tl.int1)
    return idx < N


@triton.jit
def _tile_ok(rows, cols, NR: tl.constexpr, BNR: tl.constexpr, NC: tl.constexpr,
             BNC: tl.constexpr):
    """[len(rows), len(cols)]: both indices inside their true dims (see _dim_ok)."""
    return _dim_ok(rows, NR, BNR)[:, None] & _dim_ok(cols, NC, BNC)[None, :]


@triton.jit
def _load_tokens(ptr, i_b, i_h, t, T, H: tl.constexpr, W: tl.constexpr, BW: tl.constexpr):
    """[len(t), BW] rows of a [B, T, H, W] tensor; rows past T and columns past W (the
    block's padding) read as zero."""
    cols = tl.arange(0, BW)
    offs = ((i_b * T + t).to(tl.int64) * H + i_h)[:, None] * W + cols[None, :]
    return tl.load(ptr + offs, mask=(t < T)[:, None] & _dim_ok(cols, W, BW)[None, :],
                   other=0.0)


@triton.jit
def _store_tokens(ptr, val, i_b, i_h, t, T, H: tl.constexpr, W: tl.constexpr,
                  BW: tl.constexpr):
    cols = tl.arange(0, BW)
    offs = ((i_b * T + t).to(tl.int64) * H + i_h)[:, None] * W + cols[None, :]
    tl.store(ptr + offs, val.to(ptr.dtype.element_ty),
             mask=(t < T)[:, None] & _dim_ok(cols, W, BW)[None, :])


@triton.jit
def _load_columns(ptr, i_b, i_h, t, T, cols, H: tl.constexpr, W: tl.constexpr,
                  BW: tl.constexpr):
    """[len(t), len(cols)] entries of a [B, T, H, W] tensor (cols index a block of BW);
    rows past T and columns past W read as zero."""
    offs = ((i_b * T + t).to(tl.int64) * H + i_h)[:, None] * W + cols[None, :]
    return tl.load(ptr + offs, mask=(t < T)[:, None] & _dim_ok(cols, W, BW)[None, :],
                   other=0.0)


@triton.jit
def _load_den(ptr, i_b, i_h, t, T, H: tl.constexpr):
    """[len(t)] entries of a [B, T, H] fp32 tensor; past T zero."""
    return tl.load(ptr + (i_b * T + t).to(tl.int64) * H + i_h, mask=t < T, other=0.0)


@triton.jit
def _overwrite_barrier():
    """Before a program overwrites in place what it has just read: every thread must have
    read the old values first. A value can be loaded by one thread (or several replicas in
    other warps) and stored by another, and warps run unsynchronised, so without this a
    lagging warp may read the new value (a wrong result now and then, not an error)."""
    tl.debug_barrier()


@triton.jit
def _mat_offsets(rows, cols, NCOL: tl.constexpr):
    return rows[:, None] * NCOL + cols[None, :]


@triton.jit
def _log2_decay(log2g, i_h, HAS_DECAY: tl.constexpr):
    """log2 of this head's decay (0 without decay)."""
    if HAS_DECAY:
        return tl.load(log2g + i_h)
    return 0.0


@triton.jit
def _chunk_decay(i_c, T, lg, C: tl.constexpr):
    """Decay factors of chunk i_c (see the module docstring): causal mask, b, e, Dm, G."""
    s = tl.arange(0, C)
    n = tl.minimum(T - i_c * C, C)
    causal = s[:, None] >= s[None, :]
    b = tl.exp2((s + 1).to(tl.float32) * lg)
    e = tl.where(s < n, tl.exp2((n - 1 - s).to(tl.float32) * lg), 0.0)
    dm = tl.where(causal, tl.exp2((s[:, None] - s[None, :]).to(tl.float32) * lg), 0.0)
    return causal, b, e, dm, tl.exp2(n.to(tl.float32) * lg)


@triton.jit
def _chunk_gamma(i_c, T, lg, C: tl.constexpr):
    """G = g^n for chunk i_c with n real tokens."""
    return tl.exp2(tl.minimum(T - i_c * C, C).to(tl.float32) * lg)


# ---- host side ---------------------------------------------------------------------------
# Integer helpers: triton.cdiv and triton.next_power_of_2 are jit functions whose Python
# calls cost microseconds each, and the launch path makes about twenty of them.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def _block(n: int) -> int:
    """The block a head dim of n entries is held in: the smallest power of two >= n and
    >= 16 (tl.dot's smallest size). A power of two from 16 is its own block."""
    return max(16, _pow2(n))


def _size_class(programs: int) -> int:
    """The autotune bucket of a launch of `programs` programs (see _SHAPE_KEY)."""
    return programs.bit_length()


def _loop_bound(n):
    """The scans loop to a power of two (masked past n): one compile per bucket, not per T."""
    return _pow2(n)


def _chunk_buffers(B, H, NT, D, DV, q, n_dd, n_dv):
    """Per-chunk [D, D] and [D, DV] buffers: bf16 for bf16 inputs (memory), else fp32
    (fp16 would overflow: S grows with the sequence length)."""
    kw = dict(dtype=torch.bfloat16 if q.dtype == torch.bfloat16 else torch.float32,
              device=q.device)
    return ([torch.empty(B * H, NT, D, D, **kw) for _ in range(n_dd)]
            + [torch.empty(B * H, NT, D, DV, **kw) for _ in range(n_dv)])


def _den_vectors(q, NT, n, normalize):
    """n [B*H, NT, D] fp32 buffers for the denominator column (normalize), else stand-ins."""
    B, _, H, D = q.shape
    if not normalize:
        return [q] * n
    return [q.new_empty(B * H, NT, D, dtype=torch.float32) for _ in range(n)]


def _state_tensor(state: dict, key: str) -> torch.Tensor:
    """The state entry as a contiguous fp32 tensor the kernel can update in place."""
    x = state[key]
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = state[key] = x.float().contiguous()
    return x




def _shape_args(q, v, log2g, normalize, plan):
    """The compile-time arguments every masked-form kernel takes (the scans take the step
    length CL instead of C)."""
    _, _, H, D = q.shape
    DV = v.shape[-1]
    return dict(H=H, D=D, DV=DV, PD=_block(D), PDV=_block(DV), C=plan.chunk,
                HAS_DECAY=log2g is not None, NORMALIZE=normalize, PREC=plan.precision)
