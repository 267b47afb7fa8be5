"""ahla2: every form against the explicit float64 sum, against each other in low precision,
state continuation, gradients and input errors."""

import importlib

import pytest
import torch

from hla_inputs import random_qkv
from mixers.hla.ahla2 import ahla2, ahla2_flops, ahla2_naive, ahla2_state_bytes, ahla2_step
from mixers.errors import relative_error

B, T, H, D, DV = 2, 13, 3, 4, 5
DECAYS = {"none": None, "float": 0.9, "per_head": torch.tensor([0.5, 0.8, 1.0], dtype=torch.float64)}
FORMS = ("serial", "scan", "chunk", "parallel")


def inputs(dtype=torch.float64, positive=False, seed=0, T=T, B=B):
    return random_qkv(B, T, H, D, DV, dtype=dtype, seed=seed, positive=positive, scale_qk=True)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("decay", DECAYS.values(), ids=DECAYS.keys())
def test_forms_match_explicit_sum_float64(decay, normalize):
    q, k, v = inputs()
    ref = ahla2_naive(q, k, v, normalize=normalize, decay=decay)
    _, ref_state = ahla2(q, k, v, normalize=normalize, decay=decay, impl="serial",
                         output_final_state=True)
    for impl in FORMS:
        for chunk_size in (1, 4, 5, T, 64):
            o, state = ahla2(q, k, v, normalize=normalize, decay=decay, impl=impl,
                             chunk_size=chunk_size, output_final_state=True)
            assert o.dtype == torch.float64
            assert relative_error(o, ref) < 1e-10, (impl, chunk_size)
            assert state.keys() == ref_state.keys()
            for key in state:   # padding of a partial last chunk must not decay the state
                assert relative_error(state[key], ref_state[key]) < 1e-10, (impl, chunk_size, key)


def test_explicit_sum_equals_decayed_matrix_form():
    """The naive weights g^(t-j) on j <= i <= t are ((L_g * QK^T)(L_g * QK^T)) V."""
    q, k, v = inputs()
    g = DECAYS["per_head"]
    pos = torch.arange(T)
    lag = (pos.view(-1, 1) - pos.view(1, -1)).double()
    L_g = torch.where(lag >= 0, g.view(H, 1, 1) ** lag.clamp(min=0), 0)       # [H, T, T]
    W = L_g * torch.einsum("bthd,bshd->bhts", q, k)
    expected = (W @ W @ v.transpose(1, 2)).transpose(1, 2)
    assert relative_error(ahla2_naive(q, k, v, decay=g), expected) < 1e-12


def test_paper_decayed_R_rule_breaks_the_scan(monkeypatch):
    """§6.2 says R attenuates as rho_B R_A + R_B; with decay the cross term needs the
    undecayed R (scan.py), and the paper's rule is far off."""
    scan = importlib.import_module("mixers.hla.ahla2.scan")
    q, k, v = inputs(T=16)
    ref = ahla2_naive(q, k, v, decay=0.8)

    def paper_combine(a, b):
        (R_a, P_a, E_a, rho_a), (R_b, P_b, E_b, rho_b) = a, b
        return rho_b * R_a + R_b, rho_b * P_a + P_b, rho_b * (E_a + R_b @ P_a) + E_b, rho_a * rho_b

    assert relative_error(ahla2(q, k, v, decay=0.8, impl="scan")[0], ref) < 1e-10
    monkeypatch.setattr(scan, "combine", paper_combine)
    assert relative_error(ahla2(q, k, v, decay=0.8, impl="scan")[0], ref) > 1e-2


@pytest.mark.parametrize("normalize", [False, True])
def test_low_precision_forms_agree_with_float64(normalize):
    """float32: every form within 1e-5 of the float64 sum; bfloat16 chunk: within 1e-2 of the
    float64 sum on the same (bf16-rounded) inputs."""
    q, k, v = inputs(positive=True, T=40)
    ref = ahla2_naive(q, k, v, normalize=normalize, decay=0.95)
    for impl in FORMS:
        o, _ = ahla2(*(x.float() for x in (q, k, v)), normalize=normalize, decay=0.95,
                     impl=impl, chunk_size=16)
        assert o.dtype == torch.float32 and relative_error(o, ref) < 1e-5, impl
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    ref_b = ahla2_naive(qb, kb, vb, normalize=normalize, decay=0.95)
    o, state = ahla2(qb, kb, vb, normalize=normalize, decay=0.95, impl="chunk", chunk_size=16,
                     output_final_state=True)
    assert o.dtype == torch.bfloat16 and relative_error(o, ref_b) < 1e-2
    assert all(x.dtype == torch.float32 for x in state.values())


@pytest.mark.parametrize("impl", FORMS)
@pytest.mark.parametrize("normalize", [False, True])
def test_continuation_and_decode_steps(impl, normalize):
    q, k, v = inputs()
    decay = DECAYS["per_head"]
    full, full_state = ahla2(q, k, v, normalize=normalize, decay=decay, impl="serial",
                             output_final_state=True)
    first, state = ahla2(q[:, :6], k[:, :6], v[:, :6], normalize=normalize, decay=decay,
                         impl=impl, chunk_size=4, output_final_state=True)
    second, _ = ahla2(q[:, 6:], k[:, 6:], v[:, 6:], normalize=normalize, decay=decay,
                      impl=impl, chunk_size=4, initial_state=state)
    assert relative_error(torch.cat([first, second], dim=1), full) < 1e-10
    for t in range(6, T):
        o_t, state = ahla2_step(q[:, t], k[:, t], v[:, t], state, normalize=normalize, decay=decay)
        assert relative_error(o_t, full[:, t]) < 1e-10
    for key in full_state:
        assert relative_error(state[key], full_state[key]) < 1e-10


def test_step_from_empty_state_matches_first_output():
    q, k, v = inputs()
    o, _ = ahla2(q, k, v, impl="chunk")
    o_0, state = ahla2_step(q[:, 0], k[:, 0], v[:, 0])
    assert relative_error(o_0, o[:, 0]) < 1e-12 and set(state) == {"P", "E"}


def test_gradcheck_and_gradients_agree_between_forms():
    q, k, v = (x[:1, :5, :1, :2].clone().requires_grad_() for x in inputs(positive=True))
    for impl in ("chunk", "parallel", "serial"):
        for normalize in (False, True):
            fn = lambda q, k, v: ahla2(q, k, v, normalize=normalize, decay=0.8, impl=impl,
                                       chunk_size=2)[0]
            assert torch.autograd.gradcheck(fn, (q, k, v))
    q, k, v = (x.clone().requires_grad_() for x in inputs())
    weight = torch.randn(B, T, H, DV, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = {}
    for impl in FORMS:
        o, _ = ahla2(q, k, v, decay=0.9, normalize=True, impl=impl, chunk_size=4)
        grads[impl] = torch.autograd.grad((o * weight).sum(), (q, k, v))
    for impl in FORMS[1:]:
        for g, g_ref in zip(grads[impl], grads["serial"]):
            assert relative_error(g, g_ref) < 1e-10


def test_state_bytes_and_flops():
    q, k, v = inputs(dtype=torch.float32)
    _, state = ahla2(q, k, v, normalize=True, output_final_state=True)
    assert ahla2_state_bytes(state) == 4 * B * H * (2 * D * DV + 2 * D)
    one = ahla2_flops(1, 64, 1, 64, 64, chunk_size=64)
    assert ahla2_flops(2, 128, 3, 64, 64) == 12 * one
    assert ahla2_flops(1, 64, 1, 64, 64, mode="fwdbwd") == 3 * one
    assert ahla2_flops(1, 1, 1, 64, 64, mode="decode") == 8 * 64 * 64


def test_bad_inputs_name_the_argument():
    q, k, v = inputs()
    cases = [
        (dict(impl="trtion"), "impl"),
        (dict(decay=1.5), "decay"),
        (dict(decay=torch.tensor([0.9, 0.9])), "decay"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(eps=-1.0), "eps"),
        (dict(initial_state={"P": torch.zeros(B, H, D, DV)}), "initial_state"),
        (dict(initial_state={"P": torch.zeros(B, H, D, DV), "E": torch.zeros(B, H, D, D)}),
         r"initial_state\['E'\]"),
        (dict(normalize=True, initial_state={"P": torch.zeros(B, H, D, DV),
                                             "E": torch.zeros(B, H, D, DV)}), "initial_state"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            ahla2(q, k, v, **kwargs)
    with pytest.raises(ValueError, match="q"):
        ahla2(q[0], k, v)
    with pytest.raises(ValueError, match="dtype"):
        ahla2(q, k.float(), v)
    with pytest.raises(ValueError, match="v_t"):
        ahla2_step(q[:, 0], k[:, 0], v[:, 0, 0])
