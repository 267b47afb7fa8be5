"""hla3 (causal and paper variants): every form against the explicit float64 triple sums,
low precision, state continuation, gradients and input errors."""

import pytest
import torch

from hla_inputs import random_qkv
from mixers.hla.hla3 import hla3, hla3_flops, hla3_naive, hla3_state_bytes, hla3_step
from mixers.errors import relative_error

B, T, H, D, DV = 2, 11, 2, 3, 4
FORMS = {"causal": ("serial", "scan", "chunk", "parallel"), "paper": ("serial", "scan")}


def inputs(dtype=torch.float64, positive=False, seed=0, T=T):
    return random_qkv(B, T, H, D, DV, dtype=dtype, seed=seed, positive=positive, scale_qk=True)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("variant", ["causal", "paper"])
def test_forms_match_explicit_sum_float64(variant, normalize):
    q, k, v = inputs()
    ref = hla3_naive(q, k, v, variant=variant, normalize=normalize)
    _, ref_state = hla3(q, k, v, variant=variant, normalize=normalize, impl="serial",
                        output_final_state=True)
    for impl in FORMS[variant]:
        for chunk_size in (1, 4, 5, T, 64):
            o, state = hla3(q, k, v, variant=variant, normalize=normalize, impl=impl,
                            chunk_size=chunk_size, output_final_state=True)
            assert o.dtype == torch.float64
            assert relative_error(o, ref) < 1e-10, (impl, chunk_size)
            assert state.keys() == ref_state.keys()
            for key in state:
                assert relative_error(state[key], ref_state[key]) < 1e-10, (impl, chunk_size, key)


def test_causal_sum_is_the_causal_restriction_of_the_tensor_form():
    """sum_{u<=t} [W W^T]_{t,u} [W V]_u with W = L * QK^T: the causal third-order operator."""
    q, k, v = inputs()
    W = torch.tril(torch.einsum("bthd,bshd->bhts", q, k))
    expected = (torch.tril(W @ W.transpose(-1, -2)) @ W @ v.transpose(1, 2)).transpose(1, 2)
    assert relative_error(hla3_naive(q, k, v), expected) < 1e-12


def test_paper_and_causal_differ():
    q, k, v = inputs()
    assert relative_error(hla3(q, k, v, variant="paper")[0], hla3(q, k, v)[0]) > 0.1


@pytest.mark.parametrize("variant", ["causal", "paper"])
def test_low_precision_forms_agree_with_float64(variant):
    """float32: every form within 1e-5 of the float64 sum (normalized and not); bfloat16
    (the default form): within 1e-2 of the float64 sum on the same bf16-rounded inputs."""
    q, k, v = inputs(positive=True, T=24)
    for normalize in (False, True):
        ref = hla3_naive(q, k, v, variant=variant, normalize=normalize)
        for impl in FORMS[variant]:
            o, _ = hla3(*(x.float() for x in (q, k, v)), variant=variant, normalize=normalize,
                        impl=impl, chunk_size=8)
            assert o.dtype == torch.float32 and relative_error(o, ref) < 1e-5, (impl, normalize)
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    o, state = hla3(qb, kb, vb, variant=variant, chunk_size=8, output_final_state=True)
    assert o.dtype == torch.bfloat16
    assert relative_error(o, hla3_naive(qb, kb, vb, variant=variant)) < 1e-2
    assert all(x.dtype == torch.float32 for x in state.values())


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("variant,impl", [("causal", "serial"), ("causal", "scan"),
                                          ("causal", "chunk"), ("causal", "parallel"),
                                          ("paper", "serial"), ("paper", "scan")])
def test_continuation_and_decode_steps(variant, impl, normalize):
    q, k, v = inputs()
    opts = dict(variant=variant, normalize=normalize)
    full, full_state = hla3(q, k, v, impl="serial", output_final_state=True, **opts)
    first, state = hla3(q[:, :5], k[:, :5], v[:, :5], impl=impl, chunk_size=3,
                        output_final_state=True, **opts)
    second, _ = hla3(q[:, 5:], k[:, 5:], v[:, 5:], impl=impl, chunk_size=3,
                     initial_state=state, **opts)
    assert relative_error(torch.cat([first, second], dim=1), full) < 1e-10
    for t in range(5, T):
        o_t, state = hla3_step(q[:, t], k[:, t], v[:, t], state, **opts)
        assert relative_error(o_t, full[:, t]) < 1e-10
    for key in full_state:
        assert relative_error(state[key], full_state[key]) < 1e-10


def test_step_from_empty_state_matches_first_output():
    q, k, v = inputs()
    for variant in ("causal", "paper"):
        o, _ = hla3(q, k, v, variant=variant)
        o_0, state = hla3_step(q[:, 0], k[:, 0], v[:, 0], variant=variant)
        assert relative_error(o_0, o[:, 0]) < 1e-12
    assert set(state) == {"SK", "SQ", "P", "F"}


@pytest.mark.slow
def test_gradcheck_and_gradients_agree_between_forms():
    q, k, v = (x[:1, :5, :1, :2].clone().requires_grad_() for x in inputs(positive=True))
    for variant, impl in (("causal", "chunk"), ("causal", "parallel"), ("causal", "serial"),
                          ("paper", "serial")):
        for normalize in (False, True):
            fn = lambda q, k, v: hla3(q, k, v, variant=variant, normalize=normalize, impl=impl,
                                      chunk_size=2)[0]
            assert torch.autograd.gradcheck(fn, (q, k, v))
    q, k, v = (x.clone().requires_grad_() for x in inputs())
    weight = torch.randn(B, T, H, DV, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for variant, forms in FORMS.items():
        grads = {}
        for impl in forms:
            o, _ = hla3(q, k, v, variant=variant, normalize=True, impl=impl, chunk_size=4)
            grads[impl] = torch.autograd.grad((o * weight).sum(), (q, k, v))
        for impl in forms[1:]:
            for g, g_ref in zip(grads[impl], grads["serial"]):
                assert relative_error(g, g_ref) < 1e-10, (variant, impl)


def test_state_bytes_and_flops():
    q, k, v = inputs(dtype=torch.float32)
    _, state = hla3(q, k, v, normalize=True, output_final_state=True)
    assert set(state) == {"SK", "P", "F", "m", "eta"}
    assert hla3_state_bytes(state) == 4 * B * H * (D * D + 2 * D * DV + 2 * D)
    one = hla3_flops(1, 64, 1, 64, 64)
    assert hla3_flops(2, 100, 3, 64, 64) == 12 * one          # 100 tokens -> 2 chunks
    assert hla3_flops(1, 64, 1, 64, 64, mode="fwdbwd") == 3 * one
    assert hla3_flops(1, 1, 1, 64, 64, mode="decode") == 12 * 64 * 64


def test_bad_inputs_name_the_argument():
    q, k, v = inputs()
    cases = [
        (dict(impl="trtion"), "impl"),
        (dict(variant="paper", impl="chunk"), "impl"),
        (dict(variant="paper", impl="parallel"), "impl"),
        (dict(variant="masked"), "variant"),
        (dict(chunk_size=2.5), "chunk_size"),
        (dict(initial_state={"SK": torch.zeros(B, H, D, D), "P": torch.zeros(B, H, D, DV)}),
         "initial_state"),
        (dict(variant="paper", initial_state={"SK": torch.zeros(B, H, D, D),
                                              "P": torch.zeros(B, H, D, DV),
                                              "F": torch.zeros(B, H, D, DV)}), "initial_state"),
        (dict(initial_state={"SK": torch.zeros(B, H, D, DV), "P": torch.zeros(B, H, D, DV),
                             "F": torch.zeros(B, H, D, DV)}), r"initial_state\['SK'\]"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            hla3(q, k, v, **kwargs)
    with pytest.raises(TypeError, match="decay"):     # no decay for third order
        hla3(q, k, v, decay=0.9)
    with pytest.raises(ValueError, match="k must have the head dim"):
        hla3(q, k[..., :2], v)
    with pytest.raises(ValueError, match="variant"):
        hla3_step(q[:, 0], k[:, 0], v[:, 0], variant="tensor")
