"""The API rule every operator follows (mixers/common.py): flags are bools, chunk_size is
a positive int, eps a positive finite number, T = 0 gives an empty output and the initial
(or zero) state, and an empty batch or zero heads is refused; each violation is a
ValueError that names the argument."""

import math
import os

import pytest
import torch

from mixers.attention import sdpa_attention
from mixers.hla import ahla2, ahla2_step, hla2, hla2_step, hla3, hla3_step
from mixers.linear_attn import linear_attn
from mixers.mamba2 import mamba2_ssd

TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def _ssd(impl):
    def op(q, k, v, **options):
        H = q.shape[2]
        dt = torch.full((H,), 0.1, dtype=q.dtype)
        return mamba2_ssd(q, k, v, dt=dt, A=-torch.ones(H, dtype=q.dtype), impl=impl,
                          **options)
    return op


def _with(op, **bound):
    return lambda q, k, v, **options: op(q, k, v, **bound, **options)


# name -> (op, its flags, takes chunk_size, takes eps)
OPS = {
    "hla2-serial": (_with(hla2, impl="serial"), ("masked", "normalize", "output_final_state"),
                    True, True),
    "hla2-scan": (_with(hla2, impl="scan"), ("masked", "normalize", "output_final_state"),
                  True, True),
    "hla2-chunk": (_with(hla2, impl="chunk"), ("masked", "normalize", "output_final_state"),
                   True, True),
    "hla2-parallel": (_with(hla2, impl="parallel"),
                      ("masked", "normalize", "output_final_state"), True, True),
    "ahla2-serial": (_with(ahla2, impl="serial"), ("normalize", "output_final_state"), True,
                     True),
    "ahla2-scan": (_with(ahla2, impl="scan"), ("normalize", "output_final_state"), True, True),
    "ahla2-chunk": (_with(ahla2, impl="chunk"), ("normalize", "output_final_state"), True,
                    True),
    "ahla2-parallel": (_with(ahla2, impl="parallel"), ("normalize", "output_final_state"), True,
                       True),
    "hla3-serial": (_with(hla3, impl="serial"), ("normalize", "output_final_state"), True, True),
    "hla3-scan": (_with(hla3, impl="scan"), ("normalize", "output_final_state"), True, True),
    "hla3-chunk": (_with(hla3, impl="chunk"), ("normalize", "output_final_state"), True, True),
    "hla3-parallel": (_with(hla3, impl="parallel"), ("normalize", "output_final_state"), True,
                      True),
    "hla3-paper-serial": (_with(hla3, variant="paper", impl="serial"),
                          ("normalize", "output_final_state"), True, True),
    "hla3-paper-scan": (_with(hla3, variant="paper", impl="scan"),
                        ("normalize", "output_final_state"), True, True),
    "linear-attn": (linear_attn, ("normalize", "output_final_state"), True, True),
    "linear-attn-parallel": (_with(linear_attn, impl="parallel"),
                             ("normalize", "output_final_state"), True, True),
    "mamba2-chunk": (_ssd("chunk"), ("output_final_state",), True, False),
    "mamba2-naive": (_ssd("naive"), ("output_final_state",), True, False),
    "sdpa": (sdpa_attention, ("output_final_state",), False, False),
}
if TRITON:
    OPS["hla2-triton"] = (_with(hla2, impl="triton"),
                          ("masked", "normalize", "output_final_state"), True, True)


def _dtype(name):
    return torch.float32 if name == "hla2-triton" else torch.float64


def _inputs(name, B=1, T=5, H=2, D=16, Dv=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, T, H, D), (B, T, H, D), (B, T, H, Dv))
    return [torch.randn(*shape, generator=gen, dtype=_dtype(name)) * 0.5 for shape in shapes]


def _steps():
    """(name, step, flag) of the single-token steps that take flags."""
    return [("hla2_step", hla2_step, "masked"), ("hla2_step", hla2_step, "normalize"),
            ("ahla2_step", ahla2_step, "normalize"), ("hla3_step", hla3_step, "normalize")]


@pytest.mark.parametrize("value", ["yes", 1])
@pytest.mark.parametrize("name, flag", [(name, flag) for name, (_, flags, _, _) in OPS.items()
                                        for flag in flags])
def test_flags_must_be_bool(name, flag, value):
    op = OPS[name][0]
    with pytest.raises(ValueError, match=f"{flag} must be a bool"):
        op(*_inputs(name), **{flag: value})


@pytest.mark.parametrize("name, step, flag", _steps())
def test_step_flags_must_be_bool(name, step, flag):
    q, k, v = (x[:, 0] for x in _inputs(name))
    with pytest.raises(ValueError, match=f"{flag} must be a bool"):
        step(q, k, v, **{flag: "yes"})


@pytest.mark.parametrize("name", [name for name, entry in OPS.items() if entry[2]])
def test_chunk_size_must_be_a_positive_int_not_a_bool(name):
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        OPS[name][0](*_inputs(name), chunk_size=True)


@pytest.mark.parametrize("eps", [0.0, True, math.inf])
@pytest.mark.parametrize("name", [name for name, entry in OPS.items() if entry[3]])
def test_eps_must_be_positive_and_finite(name, eps):
    with pytest.raises(ValueError, match="eps must be a positive finite number"):
        OPS[name][0](*_inputs(name), normalize=True, eps=eps)


def _state_values(state, empty=False):
    """A state dict, or a KV cache's filled keys and values (none of them when `empty`: the
    zero state of softmax attention is an empty cache)."""
    if isinstance(state, dict):
        return {key: torch.zeros_like(x) for key, x in state.items()} if empty else state
    keys, values = state.keys(), state.values()
    return {"k": keys[:, :, :0], "v": values[:, :, :0]} if empty else {"k": keys, "v": values}


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("name", list(OPS))
def test_empty_sequence_returns_the_start_state(name, with_state):
    """T = 0: an empty output in q's dtype and, as final state, the initial state (zeros,
    of the shapes a non-empty call returns, without one)."""
    op = OPS[name][0]
    q, k, v = _inputs(name, B=2, T=4)
    _, state = op(q, k, v, output_final_state=True)
    empty = [x[:, :0] for x in (q, k, v)]
    o, final = op(*empty, initial_state=state if with_state else None, output_final_state=True)
    assert o.shape == (2, 0, 2, 16) and o.dtype == q.dtype
    want, got = _state_values(state, empty=not with_state), _state_values(final)
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].shape == want[key].shape, key
        torch.testing.assert_close(got[key].double(), want[key].double(), rtol=0, atol=0)


@pytest.mark.parametrize("dim", [0, 2])
@pytest.mark.parametrize("name", list(OPS))
def test_empty_batch_or_heads_are_refused(name, dim):
    """B = 0 or H = 0 is refused with a ValueError naming q (not a reshape error inside)."""
    shape = [1, 5, 2, 16]
    shape[dim] = 0
    q, k, v = (torch.zeros(shape, dtype=_dtype(name)) for _ in range(3))
    with pytest.raises(ValueError, match=r"q must have shape \[B, T, H, D\] with B, H, D >= 1"):
        OPS[name][0](q, k, v)


@pytest.mark.parametrize("op", [hla2, ahla2, hla3, linear_attn])
def test_auto_off_cuda_takes_the_parallel_form_up_to_twice_the_head_dim(op):
    """impl="auto" without CUDA: "parallel" for T <= 2 D, "chunk" beyond (common.pytorch_form;
    D is the key width, the identity map's too), and the same outputs as the form it
    names."""
    from mixers.dispatch import noting

    gen = torch.Generator().manual_seed(0)
    for T, form in ((8, "parallel"), (9, "chunk")):
        q, k, v = (torch.randn(1, T, 2, 4, generator=gen, dtype=torch.float64) for _ in "qkv")
        with noting() as notes:
            o, _ = op(q, k, v)
        assert notes["impl"] == form, (T, notes)
        assert torch.equal(o, op(q, k, v, impl=form)[0])


def test_auto_off_cuda_measures_a_feature_map_by_its_width():
    """Based's Taylor map turns 4 key dims into 21 features: parallel up to T = 42."""
    from mixers.dispatch import noting

    gen = torch.Generator().manual_seed(0)
    for T, form in ((42, "parallel"), (43, "chunk")):
        q, k, v = (torch.randn(1, T, 2, 4, generator=gen, dtype=torch.float64) for _ in "qkv")
        with noting() as notes:
            linear_attn(q, k, v, feature_map="taylor")
        assert notes["impl"] == form, (T, notes)


@pytest.mark.parametrize("name", ["hla2-chunk", "sdpa", "linear-parallel"])
def test_trusted_finite_inputs_change_no_value_and_skip_the_rule(name):
    """Within inputs_trusted_finite the PyTorch forms give the same outputs and gradients on
    finite inputs, bit for bit, and no longer poison a non-finite token's later outputs
    (the rule's passes are skipped: its NaN spreads as the arithmetic spreads it)."""
    from mixers.common import inputs_trusted_finite

    op = {"hla2-chunk": _with(hla2, impl="chunk"), "sdpa": sdpa_attention,
          "linear-parallel": _with(linear_attn, impl="parallel")}[name]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 12, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))

    def run():
        o, _ = op(q, k, v)
        grads = torch.autograd.grad((o * torch.arange(o.numel()).view_as(o)).sum(), (q, k, v))
        return o.detach(), grads

    plain = run()
    with inputs_trusted_finite():
        trusted = run()
    assert torch.equal(plain[0], trusted[0])
    assert all(torch.equal(a, b) for a, b in zip(plain[1], trusted[1]))
    bad = q.detach().clone()
    bad[0, 5, 0, 0] = math.inf
    with torch.no_grad():
        guarded, _ = op(bad, k, v)
        with inputs_trusted_finite():
            unguarded, _ = op(bad, k, v)
    assert torch.isnan(guarded[0, 5:, 0]).all()
    assert not torch.equal(guarded.isnan(), unguarded.isnan())
