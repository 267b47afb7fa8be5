"""fla's own layers with learned gates as mixers (mixers/fla_layers.py): registration and
options (no fla needed), state bytes against hand counts, the layer around fla's module
(fla needed, any device), and on CUDA the adapter's output against fla's layer built alike,
gradients, and a recall run recorded as ok or, where fla refuses the backward, unsupported."""

import importlib.util
import re

import pytest
import torch
import torch.nn as nn

from hla_bench import registry
from hla_bench.registry import MixerUnavailableError
from mixers import fla_layers

NAMES = ("fla-gla-learned", "fla-deltanet-learned", "fla-gated-deltanet")
HAS_FLA = importlib.util.find_spec("fla") is not None
needs_fla = pytest.mark.skipif(not HAS_FLA, reason="needs flash-linear-attention")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not HAS_FLA,
                                reason="needs CUDA and flash-linear-attention")


def build(name, d_model=64, n_heads=2, **options):
    """The entry's layer, built past the availability check (fla's modules build anywhere)."""
    entry = registry.get(name)
    return entry.build_layer(d_model, n_heads, **entry.resolve_options(options))


# --- registration and options (no fla needed) -----------------------------------------------

def test_the_learned_gate_entries_are_registered_as_fla_layers():
    for name in NAMES:
        entry = registry.get(name)
        assert entry.family == "fla" and entry.forms == ("layer",), name
        assert entry.requires == ("fla", "cuda") and entry.build_layer is not None
        assert entry.build_decoder is None and entry.state_size is not None
    for fixed in ("fla-gla", "fla-delta-rule", "fla-gated-delta-rule", "fla-simple-gla"):
        assert "fixed-gate" in registry.get(fixed).description, fixed


def test_defaults_are_zoologys_settings():
    """zoology/experiments/models_repo.py: GLA without a short convolution; DeltaNet with
    beta, no output gate, short convolution 4; Gated DeltaNet no output gate, short
    convolution 4, head dim d_model / heads (values 2x, its layer's default)."""
    gla = registry.get("fla-gla-learned").options
    assert gla["use_short_conv"] is False and gla["expand_k"] == 0.5 and gla["expand_v"] == 1.0
    assert gla["use_output_gate"] is True and gla["gate_low_rank_dim"] == 16
    delta = registry.get("fla-deltanet-learned").options
    assert delta["use_beta"] is True and delta["use_gate"] is False
    assert delta["use_short_conv"] is True and delta["conv_size"] == 4
    gated = registry.get("fla-gated-deltanet").options
    assert gated["use_gate"] is False and gated["use_short_conv"] is True
    assert gated["conv_size"] == 4 and gated["head_dim"] is None and gated["expand_v"] == 2.0


def test_the_op_form_is_refused_as_unsupported():
    for name in NAMES:
        with pytest.raises(NotImplementedError, match="layer only"):
            registry.get(name).build_op()


def test_an_unknown_option_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="'qk_norm'.*accepted: .*use_output_gate"):
        registry.get("fla-gla-learned").resolve_options({"qk_norm": "l2"})


BAD_OPTIONS = [
    ("fla-gla-learned", 64, 2, {"expand_k": 0.3}, "not a whole width"),
    ("fla-gla-learned", 64, 3, {}, "not divisible by 3 heads"),
    ("fla-gla-learned", 64, 2, {"use_short_conv": "yes"}, "use_short_conv must be true"),
    ("fla-gla-learned", 64, 2, {"mode": "fused_chunk"}, "mode must be one of"),
    ("fla-gla-learned", 64, 2, {"gate_low_rank_dim": 0}, "gate_low_rank_dim must be"),
    ("fla-gla-learned", 64, 2, {"clamp_min": "low"}, "clamp_min must be a number"),
    ("fla-deltanet-learned", 64, 2, {"conv_size": 0}, "conv_size must be a positive int"),
    ("fla-deltanet-learned", 64, 2, {"qk_norm": "l1"}, "qk_norm must be one of"),
    ("fla-deltanet-learned", 64, 2, {"expand_v": -1.0}, "expand_v must be a positive"),
    ("fla-deltanet-learned", 64, 0, {}, "n_heads must be a positive int"),
    ("fla-gated-deltanet", 64, 3, {}, "divisible by n_heads"),
    ("fla-gated-deltanet", 64, 2, {"head_dim": 0}, "head_dim must be a positive int"),
    ("fla-gated-deltanet", 64, 2, {"head_dim": 20, "expand_v": 0.33}, "not a whole width"),
    ("fla-gated-deltanet", 64, 2, {"num_v_heads": 3}, "multiple of n_heads"),
]


@pytest.mark.parametrize("name,d_model,heads,options,message", BAD_OPTIONS)
def test_bad_option_values_are_value_errors_before_fla_is_imported(monkeypatch, name, d_model,
                                                                   heads, options, message):
    imported = []
    monkeypatch.setattr(fla_layers.importlib, "import_module",
                        lambda module: imported.append(module) or pytest.fail(module))
    with pytest.raises(ValueError, match=message):
        build(name, d_model, heads, **options)
    assert not imported


def test_a_key_head_dim_over_the_delta_kernels_limit_is_unsupported(monkeypatch):
    monkeypatch.setattr(fla_layers.importlib, "import_module", lambda module: pytest.fail(module))
    for name in ("fla-deltanet-learned", "fla-gated-deltanet"):
        with pytest.raises(NotImplementedError, match="key head dims up to 256, not 512"):
            build(name, 512, 1)


def test_missing_fla_gives_the_lazy_import_message(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "fla" else real_find_spec(name, *a))
    for name in NAMES:
        entry = registry.get(name)
        assert "flash-linear-attention not installed" in entry.unavailable_reason()
        with pytest.raises(MixerUnavailableError, match="flash-linear-attention not installed"):
            entry.layer(64, 2)


def test_the_frontier_config_runs_the_learned_gate_layers_with_valid_options():
    """zoology-frontier: each learned-gate layer in 2 heads at d_model 64 and 128, next to
    the fixed-gate entries; every planned (d_model, heads, options) passes the layer's own
    checks (without fla: the checks run before fla is imported)."""
    from hla_bench import configs
    from hla_bench.recall.plan import load_config, plan_runs

    specs = plan_runs(load_config(str(configs.find("zoology-frontier")), {}), "cuda")
    mixers = {spec["mixer"] for spec in specs}
    assert {"fla-gla", "fla-delta-rule", *NAMES} <= mixers
    learned = [spec for spec in specs if spec["mixer"] in NAMES]
    assert len(learned) == 3 * 2 * 4
    assert {(spec["mixer"], spec["d_model"], spec["n_heads"]) for spec in learned} == {
        (name, d_model, 2) for name in NAMES for d_model in (64, 128)}
    for spec in learned:
        kind = fla_layers.KINDS[spec["mixer"]][0]
        options = registry.get(spec["mixer"]).resolve_options(spec["mixer_options"])
        kind.kwargs(spec["d_model"], spec["n_heads"], options)
    gla = [spec for spec in learned if spec["mixer"] == "fla-gla-learned"]
    assert all(spec["mixer_options"] == {"use_short_conv": True} for spec in gla)


# --- state bytes ----------------------------------------------------------------------------

# Hand counts in float32 elements at (d_model 64, 1 head, 64 tokens) and (d_model 128, 2 heads,
# 256 tokens): a key x value matrix per head, whatever the length.
HAND_COUNTS = {
    "fla-gla-learned": (32 * 64, 2 * 32 * 64),           # keys d_model / 2, values d_model
    "fla-deltanet-learned": (64 * 64, 2 * 64 * 64),      # keys and values d_model
    "fla-gated-deltanet": (64 * 128, 2 * 64 * 128),      # head dim d_model / H, values 2x
}


@pytest.mark.parametrize("name", NAMES)
def test_state_bytes_equal_a_hand_count_for_two_shapes(name):
    from hla_bench.recall.plan import layer_state_bytes

    entry = registry.get(name)
    for (d_model, heads, length), elements in zip(((64, 1, 64), (128, 2, 256)),
                                                  HAND_COUNTS[name]):
        assert entry.state_bytes(d_model, heads, length) == 4 * elements, (d_model, heads)
        assert layer_state_bytes(name, {}, d_model, heads, length) == 4 * elements


@pytest.mark.parametrize("name,options,elements", [
    ("fla-gla-learned", {"expand_k": 1.0}, 64 * 64),
    ("fla-gla-learned", {"expand_v": 2.0}, 32 * 128),
    ("fla-deltanet-learned", {"expand_v": 2.0}, 64 * 128),
    ("fla-gated-deltanet", {"expand_v": 1.0}, 64 * 64),
    ("fla-gated-deltanet", {"head_dim": 32}, 32 * 64),
    ("fla-gated-deltanet", {"num_v_heads": 2}, 2 * 64 * 128),   # a state per value head
])
def test_state_knobs_change_the_state_as_counted_by_hand(name, options, elements):
    assert registry.get(name).state_bytes(64, 1, 64, **options) == 4 * elements


# --- the layer around fla's module (fla needed, any device) ---------------------------------

FLA_KWARGS = {  # what each entry's defaults hand fla's layer at d_model 64 in 2 heads
    "fla-gla-learned": ("GatedLinearAttention", dict(
        hidden_size=64, num_heads=2, expand_k=0.5, expand_v=1.0, use_short_conv=False,
        use_output_gate=True, gate_low_rank_dim=16, gate_logit_normalizer=16)),
    "fla-deltanet-learned": ("DeltaNet", dict(
        hidden_size=64, num_heads=2, expand_k=1.0, expand_v=1.0, use_beta=True,
        use_gate=False, use_short_conv=True, conv_size=4, qk_activation="silu",
        qk_norm="l2")),
    "fla-gated-deltanet": ("GatedDeltaNet", dict(
        hidden_size=64, num_heads=2, head_dim=32, expand_v=2.0, use_gate=False,
        use_short_conv=True, conv_size=4)),
}


def fla_layer(name, **changes):
    import fla.layers

    cls, kwargs = FLA_KWARGS[name]
    return getattr(fla.layers, cls)(**{**kwargs, **changes})


@needs_fla
@pytest.mark.parametrize("name", NAMES)
def test_the_adapter_holds_fla_layer_with_the_options_passed_through(name):
    layer = build(name)
    assert isinstance(layer, fla_layers.FlaLayer)
    reference = fla_layer(name)
    assert type(layer.layer) is type(reference)
    ours = {key: tuple(value.shape) for key, value in layer.layer.state_dict().items()}
    assert ours == {key: tuple(value.shape) for key, value in reference.state_dict().items()}
    for attribute in ("num_heads", "head_k_dim", "head_v_dim", "use_short_conv"):
        assert getattr(layer.layer, attribute) == getattr(reference, attribute), attribute
    assert layer.out_proj is layer.layer.o_proj


@needs_fla
def test_options_reach_fla_layer():
    gla = build("fla-gla-learned", use_short_conv=True, conv_size=3, expand_k=1.0,
                gate_logit_normalizer=8, use_output_gate=False)
    assert gla.layer.use_short_conv and gla.layer.conv_size == 3 and gla.layer.head_k_dim == 32
    assert gla.layer.gate_logit_normalizer == 8 and not gla.layer.use_output_gate
    delta = build("fla-deltanet-learned", use_beta=False, qk_norm="sum", allow_neg_eigval=True)
    assert not delta.layer.use_beta and delta.layer.qk_norm == "sum"
    assert delta.layer.allow_neg_eigval
    gated = build("fla-gated-deltanet", d_model=128, n_heads=4, expand_v=1.0, num_v_heads=8)
    assert gated.layer.head_k_dim == 32 and gated.layer.head_v_dim == 32
    assert gated.layer.num_v_heads == 8


@needs_fla
def test_fla_layers_train_one_run_at_a_time_with_the_stacked_trainers_reason():
    from hla_bench.recall.model import TinyLM, output_projection
    from hla_bench.recall.stacked import stack_unsupported_reason

    for name in NAMES:
        model = TinyLM(128, 64, lambda: build(name), n_layers=2, state_mixer="identity",
                       init="zoology")
        mixer = model.blocks[0].mixer
        assert not hasattr(mixer, "forward_stacked")
        assert "FlaLayer" in stack_unsupported_reason(model, 2)
        assert stack_unsupported_reason(model, 1) is None
        # the zoology init scales the output projection (GPT-2's residual scaling)
        assert output_projection(mixer) is mixer.layer.o_proj
        assert mixer.layer.o_proj.weight.std() < 0.015


@needs_fla
def test_inputs_off_cuda_are_unsupported():
    layer = build("fla-gla-learned")
    with pytest.raises(NotImplementedError, match="CUDA tensors only, not cpu"):
        layer(torch.randn(1, 8, 64))


class _RefusedBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs: refused here")


class _Refusing(nn.Module):
    """A stand-in for an fla layer whose backward fla refuses (fla's layers return a tuple)."""

    def __init__(self, width=4):
        super().__init__()
        self.o_proj = nn.Linear(width, width)

    def forward(self, x):
        return self.o_proj(_RefusedBackward.apply(x)), None, None


def test_a_refused_backward_is_unsupported_with_flas_message_and_leaves_no_gradients(
        monkeypatch):
    monkeypatch.setattr(fla_layers, "_may_refuse_here", lambda: True)
    monkeypatch.setattr(fla_layers, "kernels_run_on", lambda x: True)
    monkeypatch.setattr(fla_layers, "_REFUSALS", {})
    layer = fla_layers.FlaLayer(_Refusing(), "Refusing", probe_backward=True)
    x = torch.randn(2, 5, 4)
    with torch.no_grad():                       # no gradients asked for: it runs
        assert layer(x).shape == x.shape
    with pytest.raises(NotImplementedError, match="fla refuses Refusing's backward here: "
                                                  "Triton >= 3.4.0 and < 3.7.1 on Hopper"):
        layer(x)
    assert all(p.grad is None for p in layer.parameters())
    assert list(fla_layers._REFUSALS.values()) == [
        "Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs: refused here"]


class _Faulting(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_cuda_fault_in_the_probe_is_no_refusal(monkeypatch):
    """The harness handles faults and out of memory itself: they pass through unchanged."""
    monkeypatch.setattr(fla_layers, "_may_refuse_here", lambda: True)
    monkeypatch.setattr(fla_layers, "_REFUSALS", {})
    faulting = _Refusing()
    faulting.forward = lambda x: (faulting.o_proj(_Faulting.apply(x)), None, None)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        fla_layers.refused_backward(faulting, torch.randn(2, 5, 4))
    assert fla_layers._REFUSALS == {}


def test_no_probe_where_fla_flags_do_not_name_the_refused_case(monkeypatch):
    monkeypatch.setattr(fla_layers, "_may_refuse_here", lambda: False)
    monkeypatch.setattr(fla_layers, "kernels_run_on", lambda x: True)
    layer = fla_layers.FlaLayer(_Refusing(), "Refusing", probe_backward=True)
    assert layer(torch.randn(2, 5, 4)).shape == (2, 5, 4)      # its backward would raise


def test_a_refused_backward_is_recorded_as_unsupported_by_the_recall_runner(monkeypatch):
    """The harness's group runner, in process, on a registered stand-in: the run's first
    step raises fla's refusal, recorded as unsupported with fla's message."""
    from hla_bench.recall.pool import run_group
    from hla_bench.recall.train import RunSpec

    monkeypatch.setattr(fla_layers, "_may_refuse_here", lambda: True)
    monkeypatch.setattr(fla_layers, "kernels_run_on", lambda x: True)
    monkeypatch.setattr(fla_layers, "_REFUSALS", {})
    registry.all_mixers()  # the built-ins first, so the stand-in stays a test entry
    entry = registry.Mixer(
        name="test-fla-refusing", family="test", description="a refused backward",
        build_op=lambda **_: None, state_size=lambda d_model, n_heads, seq_len, **_: 0,
        build_layer=lambda d_model, n_heads, **_: fla_layers.FlaLayer(
            _Refusing(d_model), "Refusing", probe_backward=True))
    monkeypatch.setitem(registry._REGISTRY, entry.name, entry)
    spec = RunSpec(task="mqar", params=dict(vocab_size=64, seq_len=16, num_kv_pairs=2),
                   mixer=entry.name, d_model=16, lr=1e-3, epochs=1, num_train=32, num_val=8,
                   num_test=8, batch_size=16, stop_accuracy=1.1).as_dict()
    (result,) = run_group([spec], lambda event: None, graphs=False)
    assert result["status"] == "unsupported"
    assert result["error"] == ("fla refuses Refusing's backward here: Triton >= 3.4.0 and "
                               "< 3.7.1 on Hopper GPUs: refused here")


class _Counting(nn.Module):
    """A stand-in for an fla layer whose backward runs; it counts the rows of each call."""

    def __init__(self):
        super().__init__()
        self.o_proj, self.calls = nn.Linear(4, 4), []

    def forward(self, x):
        self.calls.append(x.shape[0])
        return self.o_proj(x), None, None


def test_a_backend_that_takes_the_backward_is_probed_once(monkeypatch):
    monkeypatch.setattr(fla_layers, "_may_refuse_here", lambda: True)
    monkeypatch.setattr(fla_layers, "kernels_run_on", lambda x: True)
    monkeypatch.setattr(fla_layers, "_REFUSALS", {})
    inner, plain = _Counting(), _Counting()
    plain.load_state_dict(inner.state_dict())
    layer = fla_layers.FlaLayer(inner, "Counting", probe_backward=True)
    x = torch.randn(3, 5, 4)
    for _ in range(3):
        layer(x).sum().backward()
        plain(x)[0].sum().backward()
    assert inner.calls == [1, 3, 3, 3]            # one probe of one sequence, then the steps
    assert list(fla_layers._REFUSALS.values()) == [None]
    # the probe's backward added nothing to the weights' gradients
    torch.testing.assert_close(inner.o_proj.weight.grad, plain.o_proj.weight.grad)


class _Mixing(nn.Module):
    """A stand-in for an fla layer with PyTorch ops only (a causal running sum)."""

    def __init__(self, width):
        super().__init__()
        self.q_proj, self.o_proj = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return self.o_proj(torch.tanh(self.q_proj(x)).cumsum(1)), None, None


@pytest.mark.slow
def test_under_torch_compile_the_layer_runs_eagerly_inside_the_single_model_step(monkeypatch):
    """The stacked trainer's single-model path (functional_call) under torch.compile, as
    `compile: true` configs run it: the same loss and gradients as eagerly; a refused
    backward is still NotImplementedError."""
    from hla_bench.recall.model import TinyLM
    from hla_bench.recall.stacked import StackedLM

    monkeypatch.setattr(fla_layers, "_may_refuse_here", lambda: True)
    monkeypatch.setattr(fla_layers, "kernels_run_on", lambda x: True)
    monkeypatch.setattr(fla_layers, "_REFUSALS", {})
    tokens = torch.randint(0, 32, (1, 4, 12), generator=torch.Generator().manual_seed(0))
    for inner, refused in ((_Mixing, False), (_Refusing, True)):
        torch.manual_seed(0)
        model = TinyLM(32, 16, lambda: fla_layers.FlaLayer(inner(16), inner.__name__,
                                                           probe_backward=True),
                       n_layers=2, state_mixer="identity", init="zoology")
        stacked = StackedLM([model])
        compiled = torch.compile(stacked.losses)
        if refused:
            with pytest.raises(NotImplementedError, match="refused here"):
                compiled(tokens, tokens.clone(), 48)
            continue
        stacked.losses(tokens, tokens.clone(), 48).sum().backward()
        eager = stacked.grad.clone()
        stacked.zero_grad()
        compiled(tokens, tokens.clone(), 48).sum().backward()
        torch.testing.assert_close(stacked.grad, eager, rtol=1e-5, atol=1e-6)


# --- CUDA: fla's kernels --------------------------------------------------------------------

def _same_weights(name, adapter, **changes):
    reference = fla_layer(name, **changes).cuda()
    reference.load_state_dict(adapter.layer.state_dict())
    return reference


def assert_near(ours, theirs, rel, what=""):
    """Equal up to `rel` of the reference's norm: the same kernels on the same inputs agree
    but for the order of any atomic accumulation in bf16."""
    assert ours.shape == theirs.shape, what
    error = (ours.float() - theirs.float()).norm()
    assert error <= rel * theirs.float().norm() + 1e-6, (what, float(error))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seq_len", [48, 160])   # fla's short (recurrent) and chunk forms
def test_adapter_output_equals_fla_layers_for_the_same_weights(name, seq_len):
    torch.manual_seed(0)
    adapter = registry.get(name).layer(64, 2).cuda().eval()
    reference = _same_weights(name, adapter).eval()
    x = torch.randn(3, seq_len, 64, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        ours, theirs = adapter(x), reference(x)[0]
    assert ours.shape == x.shape and torch.isfinite(ours.float()).all()
    assert_near(ours, theirs, 1e-3)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", NAMES)
def test_gradients_flow_to_every_weight_or_fla_refusal_is_unsupported(name):
    """bf16 autocast, as recall training runs: every weight and the input get finite,
    non-zero gradients, the same as fla's layer gives; or, where fla refuses the backward
    here, the forward raises NotImplementedError with fla's message first."""
    torch.manual_seed(0)
    adapter = registry.get(name).layer(64, 2).cuda().train()
    reference = _same_weights(name, adapter).train()
    x = torch.randn(2, 160, 64, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        try:
            y = adapter(x)
        except NotImplementedError as error:
            assert name == "fla-gated-deltanet", error
            assert "fla refuses GatedDeltaNet's backward here" in str(error)
            fla_reason = str(error).split("backward here: ", 1)[1]
            with pytest.raises(RuntimeError, match=re.escape(fla_reason[:40])):
                reference(x)[0].float().sum().backward()
            pytest.skip(f"fla refuses the backward here: {error}")
        y_ref = reference(x)[0]
    y.float().square().mean().backward()
    grad_x = x.grad.clone()
    x.grad = None
    y_ref.float().square().mean().backward()
    assert_near(grad_x, x.grad, 1e-2, "input")
    assert grad_x.abs().sum() > 0
    for (key, ours), theirs in zip(adapter.layer.named_parameters(), reference.parameters()):
        assert ours.grad is not None and torch.isfinite(ours.grad).all(), key
        assert ours.grad.abs().sum() > 0, key
        assert_near(ours.grad, theirs.grad, 1e-2, key)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("name", NAMES)
def test_a_recall_run_is_ok_or_unsupported_with_flas_reason(name):
    """One tiny MQAR run through the harness's group runner as zoology-frontier runs it
    (captured steps, torch.compile): trained (one run a group), or where fla refuses the
    backward recorded as unsupported with fla's reason."""
    from hla_bench.recall.plan import plan_groups, resolve_shapes
    from hla_bench.recall.pool import run_group
    from hla_bench.recall.train import RunSpec

    runs = [RunSpec(task="mqar", params=dict(vocab_size=256, seq_len=64, num_kv_pairs=4),
                    mixer=name, d_model=64, n_heads=2, lr=lr, seed=0, run_id=i, epochs=1,
                    num_train=256, num_val=64, num_test=64, batch_size=64, stop_accuracy=1.1,
                    state_mixer="identity", positions="none", device="cuda").as_dict()
            for i, lr in enumerate((1e-3, 3e-3))]
    assert [len(group) for group in plan_groups(runs, 4)] == [1, 1]
    shapes = resolve_shapes(runs)
    results = run_group(runs[:1], lambda event: None, graphs=True, compile=True,
                        state_bytes={0: shapes[0].state()})
    (result,) = results
    if result["status"] == "unsupported":
        assert name == "fla-gated-deltanet", result["error"]
        assert "fla refuses GatedDeltaNet's backward here" in result["error"]
    else:
        assert result["status"] == "ok", result.get("error")
        assert result["state_bytes_per_layer"] == registry.get(name).state_bytes(64, 2, 64)
        assert result["mixer_path"]["layer"].startswith("fla.layers.")
