"""Baseline ops against float64 references; every layer and decoder through the registry."""

import math
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import PROJECT_MIXERS
from hla_bench.registry import get
from mixers.attention import KVCache, sdpa_attention
from mixers.linear_attn import FEATURE_MAPS, linear_attn


def qkv(B=2, T=19, H=3, D=8, Dv=6, seed=0, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, H, d, generator=generator, dtype=dtype) for d in (D, D, Dv)]


# --- softmax -----------------------------------------------------------------------------

def explicit_causal_softmax(q, k, v, scale):
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    T = q.shape[1]
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    return torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v)


@pytest.mark.parametrize("scale", [None, 0.3])
def test_sdpa_math_matches_explicit_softmax(scale):
    q, k, v = qkv()
    o, state = get("sdpa").op(backend="math", scale=scale)(q, k, v)
    expected = explicit_causal_softmax(q, k, v, scale or q.shape[-1] ** -0.5)
    torch.testing.assert_close(o, expected, rtol=1e-10, atol=1e-10)
    assert state is None


def test_sdpa_continues_from_a_kv_cache():
    q, k, v = qkv(T=23)
    full, _ = sdpa_attention(q, k, v)
    head, cache = sdpa_attention(q[:, :15], k[:, :15], v[:, :15], output_final_state=True)
    tail, cache = sdpa_attention(q[:, 15:], k[:, 15:], v[:, 15:], initial_state=cache,
                                 output_final_state=True)
    torch.testing.assert_close(torch.cat([head, tail], 1), full)
    assert cache.length == 23
    torch.testing.assert_close(cache.keys(), k.transpose(1, 2))


def test_kv_cache_grows_when_full_and_counts_filled_bytes():
    cache = KVCache.from_tensors(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 5))
    cache.append(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 5))
    assert cache.length == 4 and cache.keys()[:, :, -1].eq(1).all()
    assert cache.nbytes == 1 * 2 * 4 * (4 + 5) * 4


def test_flash_attn_op_refuses_state():
    from mixers.attention import flash_attn_attention

    with pytest.raises(ValueError, match="keeps no state"):
        flash_attn_attention(*qkv(), output_final_state=True)


# --- linear attention --------------------------------------------------------------------

def explicit_linear_attn(q, k, v, feature_map, normalize, eps=1e-6):
    phi = FEATURE_MAPS[feature_map]
    q, k = phi(q), phi(k)
    weights = torch.einsum("bthd,bshd->bhts", q, k).tril()
    o = torch.einsum("bhts,bshd->bthd", weights, v)
    if normalize:
        o = o / (weights.sum(-1).transpose(1, 2).unsqueeze(-1) + eps)
    return o


@pytest.mark.parametrize("impl", ["chunk", "parallel"])
@pytest.mark.parametrize("feature_map,normalize", [("identity", False), ("elu1", False),
                                                   ("relu", False), ("taylor", False),
                                                   ("elu1", True), ("relu", True),
                                                   ("taylor", True)])
def test_linear_attn_matches_explicit_sum(feature_map, normalize, impl):
    q, k, v = qkv(T=37)
    op = get("linear-attn").op(feature_map=feature_map, normalize=normalize, chunk_size=16,
                               impl=impl)
    o, _ = op(q, k, v)
    torch.testing.assert_close(o, explicit_linear_attn(q, k, v, feature_map, normalize),
                               rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("impl", ["chunk", "parallel"])
@pytest.mark.parametrize("normalize", [False, True])
def test_linear_attn_state_continues(normalize, impl):
    q, k, v = qkv(T=30)
    options = {"feature_map": "elu1", "normalize": normalize, "chunk_size": 8, "impl": impl}
    full, full_state = linear_attn(q, k, v, output_final_state=True, **options)
    head, state = linear_attn(q[:, :13], k[:, :13], v[:, :13], output_final_state=True,
                              **options)
    tail, state = linear_attn(q[:, 13:], k[:, 13:], v[:, 13:], initial_state=state,
                              output_final_state=True, **options)
    torch.testing.assert_close(torch.cat([head, tail], 1), full)
    assert set(state) == ({"S", "z"} if normalize else {"S"})
    for key in state:
        torch.testing.assert_close(state[key], full_state[key])


def test_linear_attn_rejects_bad_arguments():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="feature_map"):
        linear_attn(q, k, v, feature_map="softmax")
    with pytest.raises(ValueError, match=r"initial_state\['S'\]"):
        linear_attn(q, k, v, initial_state={"S": torch.zeros(1, 1, 1, 1)})


@pytest.mark.parametrize("name,operator,bound", [
    ("hla2", "hla2", {"masked": True, "decay": 0.9}),
    ("hla2-unmasked", "hla2", {"masked": False}),
    ("ahla2", "ahla2", {"normalize": True}),
    ("hla3", "hla3", {"variant": "paper"}),
])
def test_hla_entries_bind_their_options(name, operator, bound):
    import mixers.hla

    q, k, v = qkv(T=12)
    options = {key: value for key, value in bound.items() if key != "masked"}
    o, _ = get(name).op(**options)(q, k, v)
    expected, _ = getattr(mixers.hla, operator)(q, k, v, **bound)
    torch.testing.assert_close(o, expected)


# --- every registered mixer ----------------------------------------------------------------

AVAILABLE = [name for name in PROJECT_MIXERS if get(name).available]


@pytest.mark.parametrize("name", AVAILABLE)
def test_layer_maps_shape_and_backprops(name):
    torch.manual_seed(0)
    layer = get(name).layer(32, 4)
    x = torch.randn(2, 20, 32, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.square().mean().backward()
    assert x.grad.abs().sum() > 0
    assert all(p.grad is not None for p in layer.parameters())


@pytest.mark.parametrize("output_norm", [True, False])
def test_output_norm_makes_the_layer_blind_to_the_ops_scale(output_norm):
    """HLA outputs grow with the context; the per-head output norm removes that scale."""
    from mixers.layer import MixerLayer

    x = torch.randn(2, 9, 16)
    outputs = []
    for scale in (1.0, 1000.0):
        torch.manual_seed(0)
        layer = MixerLayer(16, 2, lambda q, k, v, s=scale: (v * s, None), output_norm=output_norm)
        outputs.append(layer(x))
    assert torch.allclose(outputs[0], outputs[1], rtol=1e-4, atol=1e-5) == output_norm


@pytest.mark.parametrize("name,options,positive", [
    ("linear-attn", {"feature_map": "elu1"}, True),
    ("based", {"output_norm": True}, True),
    ("linear-attn", {}, False),
    ("hla2", {}, False),
    ("ahla2", {}, False),
    ("hla3", {}, False),
])
def test_output_norm_leaves_normalize_only_the_sign_of_the_denominator(name, options, positive):
    """RMSNorm cancels the op's division by its denominator except for the sign: normalize
    under output_norm is a no-op for positive kernels and a per-token, per-head sign flip
    where the denominator is negative for signed weights."""
    x = torch.randn(2, 40, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    outputs = []
    for normalize in (False, True):
        torch.manual_seed(0)
        layer = get(name).layer(32, 2, normalize=normalize, **options).double()
        assert layer.out_norm is not None
        op = layer.op
        seen = {}
        layer.op = lambda q, k, v, **kw: seen.setdefault("o", op(q, k, v, **kw))
        layer(x)
        outputs.append(layer.out_norm(seen["o"][0]))               # [B, T, H, Dv]
    plain, normalized = outputs
    same = (plain - normalized).abs().amax(-1) < 1e-6
    flipped = (plain + normalized).abs().amax(-1) < 1e-6
    assert bool((same | flipped).all())
    assert bool(same.all()) == positive


@pytest.mark.parametrize("name", AVAILABLE)
def test_layer_runs_under_bf16_autocast(name, monkeypatch):
    """Training uses bf16 autocast, which on CUDA runs F.normalize in fp32: the layer must
    still hand its op inputs of one dtype (emulated here, since CPU autocast keeps bf16)."""
    normalize = F.normalize
    monkeypatch.setattr(F, "normalize", lambda x, **kw: normalize(x.float(), **kw))
    layer = get(name).layer(32, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(torch.randn(2, 16, 32))
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()


def key_width(name, mixer_options=None):
    """Width of q and k for a mixer's op and decoder: its feature_dim where it fixes one
    (based's layer projects q, k to 16 per head), else 8."""
    return get(name).resolve_options(mixer_options or {}).get("feature_dim") or 8


STREAMING = [name for name in AVAILABLE if get(name).family != "softmax"]
OPTION_CASES = [("linear-attn", {"feature_map": "elu1", "normalize": True}),
                ("linear-attn", {"feature_map": "taylor", "normalize": True}),
                ("linear-attn", {"feature_map": "taylor", "feature_dim": 4}),
                ("based", {"feature_dim": 6, "chunk_size": 8}),
                ("hla2", {"normalize": True, "decay": 0.9}),
                ("hla2", {"decay": 0.9, "decay_form": "paper"}),
                ("hla2-unmasked", {"normalize": True}),
                ("ahla2", {"normalize": True, "decay": 0.95}),
                ("hla3", {"variant": "paper"}),
                ("mamba2-ssd", {"d_skip": True, "chunk_size": 8}),
                ("hla2", {"impl": "chunk"}), ("ahla2", {"impl": "serial"}),
                ("hla3", {"impl": "scan"})]


@pytest.mark.parametrize("name,mixer_options",
                         [(name, {}) for name in STREAMING] + OPTION_CASES)
def test_decoder_step_continues_the_op_after_a_prefill(name, mixer_options):
    mixer = get(name)
    q, k, v = qkv(T=21, D=key_width(name, mixer_options), dtype=torch.float64)
    op = mixer.op(**mixer_options)
    full, _ = op(q, k, v)
    _, state = op(q[:, :-1], k[:, :-1], v[:, :-1], output_final_state=True)
    o_t, _ = mixer.decoder(**mixer_options).step(q[:, -1], k[:, -1], v[:, -1], state)
    torch.testing.assert_close(o_t, full[:, -1], rtol=1e-8, atol=1e-8)


WITH_REFERENCE = [name for name in AVAILABLE if get(name).build_reference is not None]


def test_the_operator_families_with_a_naive_form_have_a_reference():
    assert {get(name).family for name in WITH_REFERENCE} == {"hla", "linear", "ssm"}
    with pytest.raises(ValueError, match="'sdpa' has no float64 reference"):
        get("sdpa").reference()


@pytest.mark.parametrize("name,mixer_options",
                         [(name, {}) for name in WITH_REFERENCE] + OPTION_CASES)
def test_op_matches_its_float64_reference(name, mixer_options):
    """The reference binds the same options as the op (an unbound option would show)."""
    mixer = get(name)
    q, k, v = qkv(T=13, D=key_width(name, mixer_options), dtype=torch.float32)
    o, _ = mixer.op(**mixer_options)(q.double(), k.double(), v.double())
    reference = mixer.reference(**mixer_options)(q, k, v)
    assert reference.dtype == torch.float64
    torch.testing.assert_close(o, reference, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", STREAMING)
def test_decoder_state_size_is_independent_of_context(name):
    decoder = get(name).decoder()
    D = key_width(name)
    sizes = [decoder.state_bytes(decoder.init_state(2, 3, D, 6, n, "cpu", torch.float32))
             for n in (16, 4096)]
    state = decoder.init_state(2, 3, D, 6, 16, "cpu", torch.float32)
    o, _ = decoder.step(*(torch.randn(2, 3, d) for d in (D, D, 6)), state)
    assert sizes[0] == sizes[1] > 0
    assert o.shape == (2, 3, 6)


def test_sdpa_decoder_step_equals_last_row_of_full_attention():
    q, k, v = qkv(T=17)
    full, _ = sdpa_attention(q, k, v)
    _, cache = sdpa_attention(q[:, :-1], k[:, :-1], v[:, :-1], output_final_state=True)
    decoder = get("sdpa").decoder()
    o_t, cache = decoder.step(q[:, -1], k[:, -1], v[:, -1], cache)
    torch.testing.assert_close(o_t, full[:, -1])
    assert decoder.state_bytes(cache) == 2 * 3 * 17 * (8 + 6) * 8


def test_sdpa_decoder_state_grows_with_context():
    decoder = get("sdpa").decoder(cache_reserve=4)
    small, large = (decoder.init_state(1, 2, 8, 8, n, "cpu", torch.float32) for n in (10, 100))
    assert decoder.state_bytes(large) == 10 * decoder.state_bytes(small)
    for _ in range(6):  # past the reserve: the cache reallocates
        o, small = decoder.step(*(torch.randn(1, 2, 8) for _ in range(3)), small)
    assert small.length == 16 and o.shape == (1, 2, 8)


# --- fla adapters, against a stand-in fla with fla's keyword signatures ------------------

def reference_gated_delta(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                          output_final_state=False):
    """Serial decayed linear attention / delta rule on [B, T, H, *] (fla's layout)."""
    B, T, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state
    outputs = []
    for t in range(T):
        if g is not None:
            S = S * g[:, t].exp()[..., None, None]
        update = v[:, t]
        if beta is not None:
            update = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
        S = S + k[:, t, :, :, None] * update[:, :, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
    return torch.stack(outputs, 1), (S if output_final_state else None)


@pytest.fixture
def stand_in_fla(monkeypatch):
    import types

    def simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                   output_final_state=False, cu_seqlens=None):
        assert g.shape == q.shape[:3]
        return reference_gated_delta(q, k, v, g.to(q.dtype), None, scale, initial_state,
                                     output_final_state)

    def delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                   cu_seqlens=None):
        torch.testing.assert_close(k.norm(dim=-1), torch.ones_like(k[..., 0]))
        return reference_gated_delta(q, k, v, None, beta, scale, initial_state,
                                     output_final_state)

    modules = {"fla": {}, "fla.ops": {},
               "fla.ops.simple_gla": {"chunk_simple_gla": simple_gla,
                                      "fused_recurrent_simple_gla": simple_gla},
               "fla.ops.delta_rule": {"chunk_delta_rule": delta_rule,
                                      "fused_recurrent_delta_rule": delta_rule}}
    for name, functions in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(functions)
        monkeypatch.setitem(sys.modules, name, module)


def test_fla_delta_rule_refuses_key_head_dims_its_kernels_do_not_take(stand_in_fla):
    """fla's delta-rule chunk kernels take key head dims up to 256 (an assert deep in their
    forward): the adapter refuses more up front with NotImplementedError, which sweeps
    record as unsupported, for a layer and for the op; 256 itself builds and runs."""
    mixer = get("fla-delta-rule")
    options = mixer.resolve_options({})
    with pytest.raises(NotImplementedError, match="up to 256, not 512"):
        mixer.build_layer(512, 1, **options)
    assert mixer.build_layer(512, 2, **options).head_dim == 256
    op = mixer.build_op(**options)
    q, k, v = qkv(T=3, D=257)
    with pytest.raises(NotImplementedError, match="up to 256, not 257"):
        op(q, k, v)
    q, k, v = qkv(T=3, D=256)
    assert op(q, k, v)[0].shape == v.shape
    gated = get("fla-gated-delta-rule")
    with pytest.raises(NotImplementedError, match="up to 256, not 512"):
        gated.build_layer(512, 1, **gated.resolve_options({}))


@pytest.mark.parametrize("name", ["fla-simple-gla", "fla-delta-rule"])
def test_fla_adapter_op_and_decoder_agree(stand_in_fla, name):
    from mixers.fla import head_log_decay

    mixer = get(name)
    options = mixer.resolve_options({})
    op, decoder = mixer.build_op(**options), mixer.build_decoder(**options)
    q, k, v = qkv(T=9)
    full, _ = op(q, k, v)
    _, state = op(q[:, :-1], k[:, :-1], v[:, :-1], output_final_state=True)
    o_t, new_state = decoder.step(q[:, -1], k[:, -1], v[:, -1], state)
    torch.testing.assert_close(o_t, full[:, -1])
    assert set(new_state) == {"S"} and new_state["S"].shape == (2, 3, 8, 6)
    if name == "fla-simple-gla":
        g = head_log_decay(3, q.device).to(q.dtype).expand(2, 9, 3)
        torch.testing.assert_close(full, reference_gated_delta(q, k, v, g)[0])
