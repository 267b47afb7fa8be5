"""Input checks and small helpers shared by every operator (the HLA operators, linear
attention, Mamba-2 SSD, softmax attention).

The API rule, the same for every operator: errors are `ValueError`s that name the offending
argument, so a user sees what to fix.
* q, k, v are `[B, T, H, D]` (v: `[B, T, H, Dv]`) floating-point tensors with B, H, D, Dv
  >= 1 (`check_qkv`); T may be 0, and then the output is empty and the final state is the
  initial state (zeros without one).
* flags (masked, normalize, output_final_state) are bools (`check_flag`); chunk_size is a
  positive int, not a bool (`check_chunk_size`); eps is a positive finite number, not a
  bool (`check_eps`).

Non-finite inputs (the causality rule, for every operator and form here): a NaN or inf in
q, k or v at token t of batch row b and head h changes only the outputs of (b, h) at and
after t (with k and v shared by all query heads, multi-query: of every head of b); the
outputs before t, and all outputs of other batch rows and heads, are exactly those the
operator gives with that entry finite. Backward: with a zero upstream gradient at every
output the entry made non-finite, the gradients of all inputs before t are exactly those
of the finite inputs, and the gradient of the non-finite entry itself is NaN (training never
steps on silently cleaned inputs). Masked chunk products alone cannot keep this: a masked-
out later row still enters a matmul as 0 * NaN = NaN. So the PyTorch forms compute on the
finite part of their inputs (`FiniteInputs`: non-finite entries read as 0) and set the
outputs of (b, h) from the first non-finite token on, and its final state, to NaN; the
Triton kernels of hla2 and of the chain (ahla2, causal hla3) keep the rule inside the
kernels, with no pass over the inputs (hla2/triton/common.py, mixers/chain). Not held
to it:
PyTorch's SDPA kernels (sdpa: a non-finite v reaches earlier outputs, and the backward
spreads NaN for q, k and v), mamba_ssm's and flash-attn's kernels, which run unchanged; and
finite inputs so large that the operators' products overflow.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from mixers.dispatch import note

IMPLS = ("auto", "serial", "scan", "chunk", "parallel", "triton")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              shared_kv_ok: bool = False) -> tuple[int, int, int, int, int]:
    """Check `[B, T, H, D]` q, k and `[B, T, H, Dv]` v; return (B, T, H, D, Dv).

    With `shared_kv_ok`, k and v may have one head shared by all query heads (multi-query).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name} must have shape [B, T, H, D], got {tuple(x.shape)}")
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
        check_nonempty(name, x, time_dim=1)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, T, H, D = q.shape
    if k.shape[:2] != (B, T) or v.shape[:2] != (B, T):
        raise ValueError(f"q, k, v must agree on batch and length [B, T], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[3] != D:
        raise ValueError(f"k must have the head dim of q ({D}), got {k.shape[3]}")
    heads_ok = (H, 1) if shared_kv_ok else (H,)
    if k.shape[2] not in heads_ok or v.shape[2] != k.shape[2]:
        what = f"{H} heads" + (" or 1 shared head" if shared_kv_ok else "")
        raise ValueError(f"k and v must have {what}, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    return B, T, H, D, v.shape[3]


def check_decay(decay, heads: int, device: torch.device) -> torch.Tensor | None:
    """None, or the decay as an `[H]` tensor on `device`; each value in (0, 1]. A Python
    number becomes float64 (torch.as_tensor would round it to float32); a tensor must be
    floating-point (a bool or integer tensor is refused, not read as 1.0 or 0.0)."""
    if decay is None:
        return None
    if isinstance(decay, bool) or not isinstance(decay, (int, float, torch.Tensor)):
        raise ValueError(f"decay must be a float or a per-head tensor, got {decay!r}")
    if isinstance(decay, torch.Tensor) and not decay.is_floating_point():
        raise ValueError(f"decay must be a floating-point tensor, got dtype {decay.dtype}")
    g = torch.as_tensor(decay, dtype=None if isinstance(decay, torch.Tensor) else torch.float64,
                        device=device)
    if g.dim() == 0:
        g = g.expand(heads)
    if g.shape != (heads,):
        raise ValueError(f"decay must be a float or a per-head tensor of shape [{heads}], "
                         f"got shape {tuple(g.shape)}")
    if not bool(((g > 0) & (g <= 1)).all()):
        raise ValueError(f"decay must lie in (0, 1], got {g.tolist()}")
    return g


def check_nonempty(name: str, x: torch.Tensor, time_dim: int | None = None) -> None:
    """Every dimension of `x` but the time dimension is at least 1: an empty batch, zero
    heads or a zero head dim is refused here rather than failing in a reshape deep inside
    (T = 0 is a valid, empty sequence)."""
    if any(n < 1 for dim, n in enumerate(x.shape) if dim != time_dim):
        layout = "[B, H, D]" if time_dim is None else "[B, T, H, D]"
        raise ValueError(f"{name} must have shape {layout} with B, H, D >= 1, "
                         f"got {tuple(x.shape)}")


def check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")


def check_flag(name: str, value) -> None:
    """A flag is a bool: a truthy string or number is refused, not read as True."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


def check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def check_eps(eps) -> None:
    """eps (added to a denominator) is a positive finite number."""
    if (isinstance(eps, bool) or not isinstance(eps, (int, float))
            or not 0 < eps < math.inf):
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")


def pad_to_multiple(x: torch.Tensor, multiple: int, dim: int = 1) -> torch.Tensor:
    """Zero-pad `x` along `dim` up to a multiple of `multiple`.

    Exact for the outputs (the operators are causal, so padded tokens never reach earlier
    outputs) and for undecayed final states (zero tokens add nothing); with decay < 1 the
    padded steps still attenuate the state, so a decayed final state must be corrected or
    taken before the padding.
    """
    pad = (-x.shape[dim]) % multiple
    if pad == 0:
        return x
    widths = [0, 0] * (x.dim() - 1 - dim) + [0, pad]
    return F.pad(x, widths)


class _FinitePart(torch.autograd.Function):
    """x with its non-finite entries read as 0; the gradient passes, except at the tokens
    `bad` ([B, T, h]: with a non-finite entry), where every entry's gradient is NaN."""

    @staticmethod
    def forward(ctx, x, bad):
        ctx.save_for_backward(bad)
        return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)

    @staticmethod
    def backward(ctx, grad):
        bad, = ctx.saved_tensors
        return grad.masked_fill(bad.unsqueeze(-1), torch.nan), None


def poison(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x + (NaN where mask, else 0), mask broadcast over x's trailing dims (an addition:
    a broadcast one is a cheaper pass than masked_fill's)."""
    nan = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(mask, torch.nan)
    return x + nan.view(*mask.shape, *(1,) * (x.dim() - mask.dim()))


# Set within `inputs_trusted_finite()`: FiniteInputs then passes its inputs through.
_TRUSTED_FINITE = False


@contextlib.contextmanager
def inputs_trusted_finite() -> Iterator[None]:
    """Within the block, the PyTorch forms skip the non-finite rule's passes over their
    inputs and outputs (`FiniteInputs` passes everything through unchanged), for a caller
    whose inputs are finite by construction, such as a model in training: on finite inputs
    the rule changes no value, so only its cost goes. A non-finite input then spreads as the
    arithmetic spreads it. Read when an op is called (torch.compile specialises a trace on
    it)."""
    global _TRUSTED_FINITE
    previous, _TRUSTED_FINITE = _TRUSTED_FINITE, True
    try:
        yield
    finally:
        _TRUSTED_FINITE = previous


class FiniteInputs:
    """The non-finite rule of the PyTorch forms (see the module docstring).

    `FiniteInputs(*xs)` takes `[B, T, h, X]` tensors whose head counts h broadcast (H, or 1
    for heads shared by all): `.inputs` are the tensors with non-finite entries read as 0,
    `.outputs(o)` sets o `[B, T, H, ...]` to NaN from each (b, h)'s first non-finite token
    on, `.state(s)` sets a final state (a tensor or a dict of `[B, heads, ...]` tensors) to
    NaN for each (b, head) that took a non-finite input; a tensor with one head when the
    inputs have H > 1 (a state shared by all heads) counts only the one-head inputs. With
    every input finite the values are unchanged (exactly). Backward: the gradient of a token
    with a non-finite input is NaN in all its entries."""

    def __init__(self, *xs: torch.Tensor):
        self.inputs, self._bad = [], []  # _bad: [B, T, h] per input, True at a non-finite token
        self.trusted = _TRUSTED_FINITE
        if self.trusted:  # finite by the caller's word (inputs_trusted_finite): no passes
            self.inputs = list(xs)
            return
        for x in xs:
            # A NaN or inf entry makes its row's sum non-finite. Finite entries overflow the
            # sum only within a factor of the row length of float32's (float64's) largest
            # value, where the operators' products overflow anyway. One read of x, cheaper
            # than an entry-wise test.
            acc = torch.float64 if x.dtype == torch.float64 else torch.float32
            bad = ~torch.isfinite(x.sum(-1, dtype=acc))
            if torch.is_grad_enabled() and x.requires_grad:
                self.inputs.append(_FinitePart.apply(x, bad))
            else:
                self.inputs.append(torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0))
            self._bad.append(bad)

    def _bad_tokens(self, heads: int) -> torch.Tensor:
        """[B, T, heads]: a token of (b, head) with a non-finite input."""
        widest = max(bad.shape[2] for bad in self._bad)
        picked = [bad for bad in self._bad if heads == widest or bad.shape[2] == heads]
        out = picked[0]
        for bad in picked[1:]:
            out = out | bad
        return out.expand(-1, -1, heads)

    def outputs(self, o: torch.Tensor) -> torch.Tensor:
        if self.trusted:
            return o
        bad = self._bad_tokens(o.shape[2])                       # [B, T, H]
        # from the first bad token on: the first True along T by argmax (a reduction; a
        # cumulative sum along T, a strided scan, costs a multiple of the op at long T)
        T = bad.shape[1]
        if T == 0:
            return o
        first = torch.where(bad.any(1), bad.to(torch.uint8).argmax(1), T)  # [B, H]
        seen = torch.arange(T, device=bad.device)[None, :, None] >= first[:, None, :]
        return poison(o, seen)

    def state(self, state):
        if state is None or self.trusted:
            return state
        if isinstance(state, dict):
            return {key: self.state(x) for key, x in state.items()}
        return poison(state, self._bad_tokens(state.shape[1]).any(1))  # [B, heads]


def exclusive_cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sums of the entries strictly before each index along `dim` (zero at the first): the
    inclusive cumsum of `x` shifted by one. Not `x.cumsum(dim) - x`, which is inf - inf = NaN
    at and before a non-finite entry, and loses an earlier sum's precision next to a large
    entry."""
    first = torch.zeros_like(x.narrow(dim, 0, 1))
    return torch.cat([first, x.narrow(dim, 0, x.shape[dim] - 1)], dim).cumsum(dim)


def check_state(state, shapes: dict[str, tuple[int, ...]], name: str = "initial_state",
                device: torch.device | None = None) -> None:
    """`state` must be a dict with exactly the keys of `shapes`, each a tensor of that shape
    (and on `device` when given): the keys a state has depend on the operator's options."""
    if not isinstance(state, dict) or set(state) != set(shapes):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{name} must be a dict with keys {sorted(shapes)} for these options, "
                         f"got {got}")
    for key, shape in shapes.items():
        x = state[key]
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}[{key!r}] must have shape {shape}, got {got}")
        if device is not None and x.device != device:
            raise ValueError(f"{name}[{key!r}] must be on {device}, got {x.device}")


def pytorch_form(T: int, width: int) -> str:
    """The PyTorch form "auto" takes where the Triton kernels do not run: "parallel" (one
    masked T x T block) for sequences of at most twice the key width (the head dim, or a
    feature map's width), else "chunk". The T x T block costs T^2 work where the chunk form
    builds width x width summaries per chunk, so the parallel form is the faster while T is
    short against the width; docs/method.md gives the measurements the threshold comes
    from."""
    return "parallel" if T <= 2 * width else "chunk"


def resolve_impl(impl: str, fallback: str, q: torch.Tensor,
                 triton_unsupported: Callable[[], str | None],
                 auto_declines: str | None = None) -> str:
    """The form a dispatcher runs, noted for whoever listens (mixers.dispatch).

    impl="triton" is checked: `triton_unsupported()` names why the kernels cannot run the
    inputs (a ValueError then). "auto" takes Triton on CUDA where the kernels support the
    inputs and `auto_declines` names no reason to keep `fallback`; any other impl is kept."""
    if impl == "triton":
        reason = triton_unsupported()
        if reason is not None:
            raise ValueError(f"impl='triton' cannot run these inputs: {reason}")
    elif impl == "auto":
        why_not = ("no CUDA device" if not q.is_cuda else
                   auto_declines if auto_declines is not None else triton_unsupported())
        if why_not is not None:
            note(impl=fallback, fallback=f"not triton: {why_not}")
            return fallback
        impl = "triton"
    note(impl=impl)
    return impl


def normalize_grads(do, o, den, eps):
    """(dn, dden) of o = n / (den + eps) for the upstream do ([B, T, H, Dv], den [B, T, H]):
    dn = do / (den + eps), dden = -(do . o) / (den + eps), both in o's dtype (float32 at
    least). NaN and inf entries of o and den (outputs poisoned by a non-finite input) pass
    no gradient on, so a zero upstream there stays zero instead of becoming 0 * NaN, and the
    inputs before the bad token keep their gradients (the non-finite rule); a NaN upstream
    still reaches dn and dden. Costs one more pass over o than the plain formulas."""
    acc = torch.promote_types(o.dtype, torch.float32)
    den = den.to(acc)
    scale = torch.where(torch.isfinite(den), 1.0 / (den + eps), 0.0)
    o, do = torch.nan_to_num(o.to(acc), nan=0.0, posinf=0.0, neginf=0.0), do.to(acc)
    dden = -(do * o).sum(-1) * scale
    return do * scale.unsqueeze(-1), dden


class Normalized(torch.autograd.Function):
    """o = n / (den + eps) with the backward of normalize_grads (n [.., Dv], den [..])."""

    @staticmethod
    def forward(ctx, n, den, eps):
        o = n / (den + eps).unsqueeze(-1)
        ctx.save_for_backward(o, den)
        ctx.eps = eps
        return o

    @staticmethod
    def backward(ctx, do):
        o, den = ctx.saved_tensors
        dn, dden = normalize_grads(do, o, den, ctx.eps)
        return dn.to(o.dtype), dden.to(den.dtype), None


def kernel_read_out(o: torch.Tensor, normalize: bool, eps: float,
                    dtype: torch.dtype) -> torch.Tensor:
    """Packed outputs `[..., Dv(+1)]` of kernels that keep the non-finite rule inside (rows
    from a non-finite token on are NaN) -> o in `dtype`: when normalized, numerator /
    (denominator + eps) through Normalized, whose backward passes a zero upstream gradient
    at a poisoned row on as zero."""
    if normalize:
        o = Normalized.apply(o[..., :-1], o[..., -1], eps)
    return o.to(dtype)
