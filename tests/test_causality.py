"""The non-finite rule (mixers/common.py): a NaN or inf in q, k or v at token t of batch
row b and head h changes only the outputs of (b, h) at and after t, in every operator and
form; with a zero upstream gradient at the outputs it made non-finite, the gradients of the
inputs before t are those without it.

Each case puts one NaN (or inf) entry into q, k or v at a token in the middle of the second
of three chunks, and compares with the same call on the finite inputs: the outputs of (0, 0)
before that token, and every output of the other batch row and head, must be finite and
equal (bit for bit: the masked products only ever multiply the entry by zero). The Triton
forms run in the interpreter on CPU (tests/conftest.py)."""

import functools
import os

import pytest
import torch

from grids import parametrize
from hla2_plans import chunk_128_paths, split_output_rows, two_level_scans
from mixers.attention import sdpa_attention
from mixers.hla import ahla2, hla2, hla3
from mixers.hla.hla2.triton import hla2_triton, plan_call
from mixers.linear_attn import linear_attn
from mixers.mamba2 import mamba2_ssd

TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, H = 2, 2
ENTRY = 3  # the feature (or value column) that is made non-finite


# Triton forms whose paths need chunks of 32: halves of 16 rows (tl.dot's smallest size).
CHUNK_32 = ("hla2-triton-chunk-128-paths", "hla2-triton-split-rows-decay")


def _tokens(name):
    """(T, bad token): three chunks of the form's chunk size (16 where it has none), the
    bad token in the second chunk, 3 past its middle (in the second half of its rows)."""
    chunk = 32 if name in CHUNK_32 else 16
    return 3 * chunk, chunk + chunk // 2 + 3


def _ssd(impl):
    def op(q, k, v, **options):
        dt = torch.tensor([0.05, 0.2], dtype=q.dtype, device=q.device)
        A = torch.tensor([-1.0, -3.0], dtype=q.dtype, device=q.device)
        return mamba2_ssd(q, k, v, dt=dt, A=A, impl=impl, chunk_size=16, **options)
    return op


def _op(fn, **bound):
    return lambda q, k, v, **options: fn(q, k, v, **bound, **options)


DECAY = torch.tensor([0.9, 0.75], dtype=torch.float64)
TORCH_FORMS = {
    "hla2-serial": _op(hla2, impl="serial"),
    "hla2-scan": _op(hla2, impl="scan", chunk_size=16),
    "hla2-chunk": _op(hla2, impl="chunk", chunk_size=16),
    "hla2-serial-decay-normalize": _op(hla2, impl="serial", decay=DECAY, normalize=True),
    "hla2-scan-decay-normalize": _op(hla2, impl="scan", chunk_size=16, decay=DECAY,
                                     normalize=True),
    "hla2-chunk-decay-normalize": _op(hla2, impl="chunk", chunk_size=16, decay=DECAY,
                                      normalize=True),
    "hla2-chunk-unmasked": _op(hla2, impl="chunk", chunk_size=16, masked=False),
    "hla2-chunk-paper-decay": _op(hla2, impl="chunk", chunk_size=16, decay=DECAY,
                                  decay_form="paper"),
    "hla2-chunk-ridge": _op(hla2, impl="chunk", chunk_size=16, ridge=0.5),
    "hla2-parallel-decay-normalize": _op(hla2, impl="parallel", decay=DECAY, normalize=True),
    "hla2-parallel-unmasked-ridge": _op(hla2, impl="parallel", masked=False, ridge=0.5),
    "hla2-parallel-paper-decay": _op(hla2, impl="parallel", decay=DECAY, decay_form="paper"),
    "ahla2-serial": _op(ahla2, impl="serial"),
    "ahla2-scan": _op(ahla2, impl="scan"),
    "ahla2-chunk": _op(ahla2, impl="chunk", chunk_size=16),
    "ahla2-chunk-decay-normalize": _op(ahla2, impl="chunk", chunk_size=16, decay=DECAY,
                                       normalize=True),
    "ahla2-parallel-decay-normalize": _op(ahla2, impl="parallel", decay=DECAY,
                                          normalize=True),
    "ahla2-triton": _op(ahla2, impl="triton", chunk_size=16),
    "ahla2-triton-decay-normalize": _op(ahla2, impl="triton", chunk_size=16, decay=DECAY,
                                        normalize=True),
    "hla3-serial": _op(hla3, impl="serial"),
    "hla3-scan": _op(hla3, impl="scan"),
    "hla3-chunk": _op(hla3, impl="chunk", chunk_size=16),
    "hla3-triton-normalize": _op(hla3, impl="triton", chunk_size=16, normalize=True),
    "hla3-chunk-normalize": _op(hla3, impl="chunk", chunk_size=16, normalize=True),
    "hla3-parallel-normalize": _op(hla3, impl="parallel", normalize=True),
    "hla3-paper-serial": _op(hla3, variant="paper", impl="serial"),
    "hla3-paper-scan": _op(hla3, variant="paper", impl="scan"),
    "linear-attn": _op(linear_attn, chunk_size=16),
    "linear-attn-elu1-normalize": _op(linear_attn, chunk_size=16, feature_map="elu1",
                                      normalize=True),
    "linear-attn-parallel": _op(linear_attn, impl="parallel"),
    "linear-attn-parallel-taylor-normalize": _op(linear_attn, impl="parallel",
                                                 feature_map="taylor", normalize=True),
    "linear-attn-parallel-elu1-normalize": _op(linear_attn, impl="parallel",
                                               feature_map="elu1", normalize=True),
    "linear-attn-triton-elu1-normalize": _op(linear_attn, impl="triton", chunk_size=16,
                                             feature_map="elu1", normalize=True),
    "mamba2-chunk": _ssd("chunk"),
    "mamba2-naive": _ssd("naive"),
}


def _triton(variant, chunk_size, decay=None, **bound):
    """The Triton op with its default launch plan changed by variant(plan): a path the
    default takes only at larger shapes (mixers/hla/hla2/triton/plan.py)."""
    def op(q, k, v, **options):
        g = None if decay is None else decay.to(q.device)
        plan = variant(plan_call(q, k, v, decay=g, chunk_size=chunk_size, **bound))
        return hla2_triton(q, k, v, decay=g, chunk_size=chunk_size, plan=plan, **bound,
                           **options)
    return op


TRITON_FORMS = {
    "hla2-triton": _op(hla2, impl="triton", chunk_size=16),
    "hla2-triton-decay-normalize": _op(hla2, impl="triton", chunk_size=16, decay=DECAY,
                                       normalize=True),
    # chunks of 32 as two programs of 16 query rows (the second mixes with the first)
    "hla2-triton-split-rows-decay": _triton(split_output_rows, 32, DECAY),
    # scans over segments of 2 chunks, a scan over the segments, and a rescan
    "hla2-triton-two-level-normalize": _triton(two_level_scans, 16, normalize=True),
    # increments in halves of tokens, late state loads, and without backward the scan into
    # buffers of its own, at chunk 32
    "hla2-triton-chunk-128-paths": _triton(chunk_128_paths, 32, DECAY, normalize=True),
    "hla2-triton-paper-decay": _op(hla2, impl="triton", chunk_size=16, decay=DECAY,
                                   decay_form="paper"),
    "hla2-triton-paper-decay-normalize": _op(hla2, impl="triton", chunk_size=16, decay=DECAY,
                                             decay_form="paper", normalize=True),
} if TRITON else {}

# name -> (op, dtype, head dim): the paper hla3 scan holds d^3 dv tensors per token
FORMS = {name: (op, torch.float64, 4 if name.startswith("hla3-paper") else 16)
         for name, op in TORCH_FORMS.items()}
FORMS.update({name: (op, torch.float32, 16) for name, op in TRITON_FORMS.items()})
FORMS["sdpa"] = (sdpa_attention, torch.float64, 16)
if TRITON:  # float64 takes hla2's chain of two linear attentions, not its fused kernels
    FORMS["hla2-triton-chain-decay-normalize"] = (
        _op(hla2, impl="triton", chunk_size=16, decay=DECAY, normalize=True), torch.float64, 16)


def _inputs(name, seed=0):
    """q, k, v of form `name` on DEVICE; |q|, |k| keep every normalised form's denominator
    positive."""
    _, dtype, d = FORMS[name]
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, _tokens(name)[0], H, d, generator=gen, dtype=torch.float64) * 0.3
               for _ in range(3))
    return [x.to(DEVICE, dtype) for x in (q.abs(), k.abs(), v)]


def _with_bad(xs, which, value, bad):
    xs = [x.clone() for x in xs]
    xs[which][0, bad, 0, ENTRY] = value
    return xs


def _run(name, xs, grad_up=None):
    """(outputs, final state) of form `name` on xs; with grad_up, the gradients of xs for
    the upstream gradient grad_up(o) instead of the state."""
    op, _, _ = FORMS[name]
    if grad_up is None:
        with torch.no_grad():
            return op(*xs, output_final_state=True)
    xs = [x.clone().requires_grad_() for x in xs]
    o, _ = op(*xs)
    return o.detach(), torch.autograd.grad(o, xs, grad_up(o.detach()))


@functools.cache
def _finite_run(name):
    """(outputs, final state) of form `name` on its finite inputs, shared by the cases of
    the form (the Triton forms run in the interpreter: each call takes seconds)."""
    return _run(name, _inputs(name))


def _upstream(o):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(o.shape, generator=gen, dtype=torch.float64).to(DEVICE, o.dtype)


def _equal(got, want):
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _check_untouched(got, want, bad):
    """Every entry but (0, >= bad, 0) finite and equal: (0, 0) before the bad token, all of
    (0, 1) and of batch row 1."""
    assert torch.isfinite(got[0, :bad, 0]).all()
    _equal(got[0, :bad, 0], want[0, :bad, 0])
    _equal(got[0, :, 1], want[0, :, 1])
    _equal(got[1], want[1])


def _state_tensors(state):
    return state if isinstance(state, dict) else {"k": state.keys(), "v": state.values()}


# ahla2's and hla3's Triton forms are chains of one linear-attention kernel, linear_attn's:
# one family, whose kernels read NaN and inf through the same test (|x| < inf).
CHAIN_FORMS = ("ahla2-triton", "ahla2-triton-decay-normalize", "hla3-triton-normalize",
               "linear-attn-triton-elu1-normalize", "hla2-triton-chain-decay-normalize")
# (form, value): NaN and inf for every form, but for the chain inf in one form only.
FORWARD_CASES = [(name, value) for name in FORMS for value in ("nan", "inf")
                 if value == "nan" or name not in CHAIN_FORMS[1:]]
INTERPRETED = set(TRITON_FORMS) | set(CHAIN_FORMS)  # the forms run by the Triton interpreter
WHICH = "qkv"


def _grid(cases, fast):
    """(name, value, which) for every case and each of q, k, v, ids "name-value-which"; the
    cases for which fast(name, value, which) fails are slow (tests/grids.py)."""
    grid = [(name, value, which) for name, value in cases for which in range(3)]
    ids = [f"{name}-{value}-{WHICH[which]}" for name, value, which in grid]
    return parametrize("name, value, which", grid, ids=ids, fast=lambda case: fast(*case))


def _forward_fast(name, value, which):
    """Each PyTorch form with NaN in q and inf in v (NaN in v without an inf case), each
    interpreted form once, NaN in v."""
    if name in INTERPRETED:
        return (value, which) == ("nan", 2)
    return (value, which) in (("nan", 0), ("inf", 2)) or (
        (value, which) == ("nan", 2) and (name, "inf") not in FORWARD_CASES)


@_grid(FORWARD_CASES, _forward_fast)
def test_non_finite_input_changes_only_later_outputs(name, which, value):
    value = float(value)
    xs, (_, bad) = _inputs(name), _tokens(name)
    o, state = _finite_run(name)
    o_bad, state_bad = _run(name, _with_bad(xs, which, value, bad))
    _check_untouched(o_bad, o, bad)
    assert not torch.isfinite(o_bad[0, bad, 0]).all()  # the bad token's own output shows it
    if name == "sdpa":  # the state is the KV cache: it holds the inputs as they are
        return
    state, state_bad = _state_tensors(state), _state_tensors(state_bad)
    assert not all(torch.isfinite(x[0, 0]).all() for x in state_bad.values())
    for key, x in state_bad.items():
        _equal(x[0, 1:], state[key][0, 1:])
        _equal(x[1], state[key][1])


# (form, value): NaN everywhere; inf for the PyTorch forms and for forms of hla2's kernels
# (the kernels test NaN and inf alike, with the helpers of mixers/tiles.py that hla2's
# and the chain's kernels share; the interpreter's backward is slow).
INF_KERNEL_FORMS = ("hla2-triton", "hla2-triton-paper-decay")
BACKWARD_CASES = [(name, value) for name in FORMS
                  for value in ("nan", "inf")
                  if value == "nan" or name in INF_KERNEL_FORMS
                  or (name not in TRITON_FORMS and name not in CHAIN_FORMS)]


# The backward cases of the fast suite: NaN in q for each of the three slowest PyTorch forms
# (scans of d^2 and d^3 states), NaN in k and inf in v for the other PyTorch forms, and the
# interpreted kernels in one form of hla2's kernels and one of the chain.
SLOW_SCANS = ("hla2-scan", "hla3-scan", "hla3-paper-scan")
INTERPRETED_FAST = (("hla2-triton", "nan", 1), ("linear-attn-triton-elu1-normalize", "nan", 2))


def _backward_fast(name, value, which):
    if name in INTERPRETED:
        return (name, value, which) in INTERPRETED_FAST
    if name in SLOW_SCANS:
        return (value, which) == ("nan", 0)
    return (value, which) in (("nan", 1), ("inf", 2))


@_grid(BACKWARD_CASES, _backward_fast)
def test_non_finite_input_keeps_earlier_gradients(name, which, value):
    """Upstream gradient: random, zero at every output the bad entry made non-finite. The
    gradients of q, k and v before the bad token (and all of the other batch row and head)
    are finite and equal to those of the finite inputs with the same upstream gradient; the
    gradient of the bad entry is NaN."""
    xs, (_, bad) = _inputs(name), _tokens(name)
    xs_bad = _with_bad(xs, which, float(value), bad)
    up = []  # the upstream gradient, from the outputs of the run with the bad entry

    def zero_where_not_finite(o):
        up.append(torch.where(torch.isfinite(o), _upstream(o), 0.0))
        return up[0]

    _, grads_bad = _run(name, xs_bad, grad_up=zero_where_not_finite)
    _, grads = _run(name, xs, grad_up=lambda o: up[0])
    for grad_bad, grad in zip(grads_bad, grads):
        assert torch.isfinite(grad_bad[0, :bad, 0]).all()
        _equal(grad_bad[0, :bad, 0], grad[0, :bad, 0])
        _equal(grad_bad[0, :, 1], grad[0, :, 1])
        _equal(grad_bad[1], grad[1])
    assert torch.isnan(grads_bad[which][0, bad, 0, ENTRY])


@pytest.mark.parametrize("which", [0, 1, 2], ids=["q", "k", "v"])
def test_shared_heads_take_the_shared_non_finite_input(which):
    """Multi-query hla2 (k, v one head for all query heads): a NaN in the shared k or v
    reaches every head of its batch row from the bad token on, a NaN in one head's q only
    that head; the other batch row is untouched, and the shared S only takes k and v."""
    q, k, v = _inputs("hla2-chunk")
    k, v = k[:, :, :1].contiguous(), v[:, :, :1].contiguous()
    op, (_, bad) = _op(hla2, impl="chunk", chunk_size=16), _tokens("hla2-chunk")
    o, state = op(q, k, v, output_final_state=True)
    o_bad, state_bad = op(*_with_bad([q, k, v], which, float("nan"), bad),
                          output_final_state=True)
    heads = [0] if which == 0 else [0, 1]
    for h in range(H):
        _equal(o_bad[0, :bad, h], o[0, :bad, h])
        assert torch.isnan(o_bad[0, bad:, h]).all() == (h in heads)
    _equal(o_bad[1], o[1])
    assert torch.isnan(state_bad["S"][0]).all() == (which > 0)
    _equal(state_bad["S"][1], state["S"][1])
