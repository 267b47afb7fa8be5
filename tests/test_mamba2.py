"""Mamba-2 SSD: explicit sum, serial recurrence, chunk form, Triton loader, block."""

import importlib.util
import sys

import pytest
import torch

from hla_bench.registry import get
from mixers.mamba2 import mamba2_ssd, ssd, ssd_parameters
from mixers.mamba2.chunk import ssd_chunk
from mixers.mamba2.layer import Mamba2Block
from mixers.mamba2.naive import ssd_naive
from mixers.mamba2.triton import load_chunk_scan


def ssd_inputs(b=2, T=29, h=4, P=5, N=6, groups=1, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype)

    x, B, C = randn(b, T, h, P), randn(b, T, groups, N), randn(b, T, groups, N)
    dt = 0.3 * torch.rand(b, T, h, generator=generator, dtype=dtype)
    A = -4 * torch.rand(h, generator=generator, dtype=dtype) - 0.1
    return x, dt, A, B, C


def explicit_ssd(x, dt, A, B, C):
    """y_t = sum_{s<=t} exp(A sum_{s<r<=t} dt_r) dt_s (C_t . B_s) x_s (groups = heads)."""
    cum = (dt * A).cumsum(1)                                         # [b, T, h]
    T = x.shape[1]
    decay = (cum[:, :, None] - cum[:, None, :]).exp()                # [b, t, s, h]
    decay = decay * torch.ones(T, T, dtype=x.dtype).tril()[None, :, :, None]
    scores = torch.einsum("bthn,bshn->btsh", C, B)
    return torch.einsum("btsh,bsh,bshp->bthp", decay * scores, dt, x)


def test_naive_recurrence_matches_explicit_sum():
    x, dt, A, B, C = ssd_inputs(groups=4)
    y, _ = ssd_naive(x, dt, A, B, C)
    torch.testing.assert_close(y, explicit_ssd(x, dt, A, B, C), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("groups,chunk_size", [(1, 8), (4, 7), (2, 64)])
def test_chunk_matches_naive_with_state_and_skip(groups, chunk_size):
    x, dt, A, B, C = ssd_inputs(groups=groups)
    D = torch.randn(4, dtype=torch.float64)
    h0 = torch.randn(2, 4, 6, 5, dtype=torch.float64)
    y, state = ssd_naive(x, dt, A, B, C, D=D, initial_state=h0)
    y_chunk, state_chunk = ssd_chunk(x, dt, A, B, C, D=D, chunk_size=chunk_size,
                                     initial_state=h0)
    torch.testing.assert_close(y_chunk, y, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state_chunk, state, rtol=1e-10, atol=1e-10)


def test_op_state_continues_across_calls():
    q, k = torch.randn(2, 2, 33, 3, 8, dtype=torch.float64).unbind(0)
    v = torch.randn(2, 33, 3, 4, dtype=torch.float64)
    dt, A = ssd_parameters(3, seed=1, dtype=torch.float64)
    full, full_state = mamba2_ssd(q, k, v, dt=dt, A=A, chunk_size=16, output_final_state=True)
    head, state = mamba2_ssd(q[:, :20], k[:, :20], v[:, :20], dt=dt, A=A, chunk_size=16,
                             output_final_state=True)
    tail, state = mamba2_ssd(q[:, 20:], k[:, 20:], v[:, 20:], dt=dt, A=A, impl="naive",
                             initial_state=state, output_final_state=True)
    torch.testing.assert_close(torch.cat([head, tail], 1), full)
    torch.testing.assert_close(state["h"], full_state["h"])
    assert state["h"].shape == (2, 3, 8, 4)


def test_op_rejects_bad_impl_and_state():
    q = torch.randn(1, 4, 2, 3)
    dt, A = ssd_parameters(2)
    with pytest.raises(ValueError, match="impl"):
        mamba2_ssd(q, q, q, dt=dt, A=A, impl="cuda")
    with pytest.raises(ValueError, match=r"initial_state\['h'\]"):
        mamba2_ssd(q, q, q, dt=dt, A=A, initial_state={"h": torch.zeros(1, 2, 3, 4)})


def test_ssd_parameters_are_seeded_and_in_mamba_ranges():
    dt, A = ssd_parameters(16, seed=3)
    again, _ = ssd_parameters(16, seed=3)
    other, _ = ssd_parameters(16, seed=4)
    assert torch.equal(dt, again) and not torch.equal(dt, other)
    assert ((dt >= 1e-3) & (dt <= 0.1)).all() and ((A >= -16) & (A <= -1)).all()


def test_registry_op_picks_chunk_on_cpu_and_matches_naive():
    q, k, v = torch.randn(3, 1, 40, 2, 8, dtype=torch.float64).unbind(0)
    o_auto, _ = get("mamba2-ssd").op()(q, k, v)
    o_naive, _ = get("mamba2-ssd").op(impl="naive")(q, k, v)
    torch.testing.assert_close(o_auto, o_naive)


def test_block_maps_shape_and_backprops():
    torch.manual_seed(0)
    block = Mamba2Block(32, 4, d_state=16, chunk_size=8)
    x = torch.randn(2, 19, 32, requires_grad=True)
    y = block(x)
    assert y.shape == x.shape
    y.square().mean().backward()
    assert block.A_log.grad.abs().sum() > 0 and block.dt_bias.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="n_heads"):
        Mamba2Block(30, 7)


def test_head_dim_sets_the_number_of_heads():
    """With head_dim the block has expand * d_model / head_dim heads of head_dim, whatever
    n_heads says (mamba_ssm's Mamba2 has no n_heads); the registry's option layer_head_dim
    passes it on."""
    block = Mamba2Block(32, 1, d_state=8, head_dim=16)
    assert (block.n_heads, block.head_dim) == (4, 16)
    assert block.A_log.shape == block.D.shape == (4,)
    layer = get("mamba2-ssd").layer(32, 1, layer_head_dim=8, d_state=8)
    assert (layer.n_heads, layer.head_dim) == (8, 8)
    assert get("mamba2-ssd").layer(32, 2, d_state=8).head_dim == 32
    for bad in (0, 24):
        with pytest.raises(ValueError, match="head_dim"):
            Mamba2Block(32, 1, head_dim=bad)


def test_block_is_causal():
    torch.manual_seed(0)
    block = Mamba2Block(16, 2, d_state=8, chunk_size=4).double()
    x = torch.randn(1, 12, 16, dtype=torch.float64)
    changed = x.clone()
    changed[:, 7:] += 1
    torch.testing.assert_close(block(x)[:, :7], block(changed)[:, :7])


@pytest.fixture
def fake_mamba_ssm(tmp_path, monkeypatch):
    """A mamba_ssm whose __init__ fails (like one without its CUDA extension)."""
    root = tmp_path / "mamba_ssm"
    (root / "ops" / "triton").mkdir(parents=True)
    (root / "__init__.py").write_text("raise ImportError('selective_scan_cuda missing')\n")
    (root / "ops" / "__init__.py").write_text("raise ImportError('ops init must not run')\n")
    (root / "ops" / "triton" / "__init__.py").write_text("")
    (root / "ops" / "triton" / "ssd_combined.py").write_text(
        "def mamba_chunk_scan_combined(*args, **kwargs):\n    return 'kernel'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]:
        del sys.modules[name]


def test_triton_loader_skips_the_package_init(fake_mamba_ssm):
    with pytest.raises(ImportError, match="selective_scan_cuda"):
        __import__("mamba_ssm")
    sys.modules.pop("mamba_ssm", None)
    assert load_chunk_scan()() == "kernel"


def test_triton_loader_reports_a_missing_package(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    for name in [n for n in sys.modules if n == "mamba_ssm" or n.startswith("mamba_ssm.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match="mamba-ssm is not installed"):
        load_chunk_scan()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("mamba_ssm") is None,
                    reason="needs CUDA and mamba-ssm")
def test_triton_matches_chunk_on_cuda():
    x, dt, A, B, C = (t.cuda().float() for t in ssd_inputs(T=200, P=64, N=64, h=4))
    h0 = torch.randn(2, 4, 64, 64, device="cuda")
    y, state = ssd(x, dt, A, B, C, impl="triton", initial_state=h0)
    y_ref, state_ref = ssd(x, dt, A, B, C, impl="chunk", initial_state=h0)
    torch.testing.assert_close(y, y_ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(state, state_ref, rtol=1e-3, atol=1e-3)


def test_recall_state_bytes_count_the_blocks_ssd_state():
    """A Mamba-2 block holds heads x d_state x head dim floats whatever its head split:
    d_state 64 x expand 2 x d_model 64 = 8,192 a layer, 32 KiB a layer in float32."""
    from hla_bench.recall.plan import state_bytes

    for options in ({}, {"layer_head_dim": 64}, {"layer_head_dim": 16}):
        assert state_bytes("mamba2-ssd", options, d_model=64, n_heads=1, n_layers=2,
                           seq_len=64) == 2 * 64 * 128 * 4
    assert state_bytes("mamba2-ssd", {"d_state": 4}, 128, 8, 4, 64) == 4 * 4 * 256 * 4
