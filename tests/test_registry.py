"""The mixer registry: listing, lookup errors, options, availability, entry-point plugins."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hla_bench import registry
from hla_bench.registry import (Mixer, MixerUnavailableError, UnknownMixerError, all_mixers,
                                get, register, state_nbytes)

BUILTINS = {
    "hla2": "hla", "hla2-unmasked": "hla", "ahla2": "hla", "hla3": "hla",
    "sdpa": "softmax", "flash-attn": "softmax", "linear-attn": "linear", "based": "linear",
    "mamba2-ssd": "ssm", "fla-linear-attn": "fla", "fla-simple-gla": "fla",
    "fla-gla": "fla", "fla-delta-rule": "fla", "fla-gated-delta-rule": "fla",
}


def test_builtins_are_listed_with_their_families():
    listed = {m.name: m.family for m in all_mixers()}
    assert {name: listed.get(name) for name in BUILTINS} == BUILTINS
    keys = [(m.family, m.name) for m in all_mixers()]
    assert keys == sorted(keys)


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_every_builtin_is_described(name):
    mixer = get(name)
    assert mixer.description and mixer.forms
    assert mixer.build_layer is not None


def test_unknown_name_lists_registered_names():
    with pytest.raises(UnknownMixerError, match="registered: .*hla2.*sdpa"):
        get("no-such-mixer")


def test_unknown_option_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="'stride'.*accepted: .*backend"):
        get("sdpa").op(stride=3)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_option_is_a_value_error_naming_it(value):
    with pytest.raises(ValueError, match="option scale must be finite"):
        get("sdpa").resolve_options({"scale": value})


def test_options_override_defaults():
    assert get("linear-attn").resolve_options({"normalize": True})["normalize"] is True
    assert get("linear-attn").resolve_options({})["feature_map"] == "identity"


def test_missing_package_makes_a_mixer_unavailable_with_the_reason(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flash_attn" else real_find_spec(name, *a))
    mixer = get("flash-attn")
    assert "flash-attn not installed" in mixer.unavailable_reason()
    assert not mixer.available
    with pytest.raises(MixerUnavailableError, match="flash-attn not installed"):
        mixer.op()


def test_option_requirements_are_checked_at_build_time(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    sdpa = get("sdpa")
    assert sdpa.unavailable_reason() is None
    assert sdpa.unavailable_reason({"backend": "cudnn"}) == "needs a CUDA device"
    with pytest.raises(MixerUnavailableError, match="needs a CUDA device"):
        sdpa.op(backend="efficient")
    assert "needs a CUDA device" in get("mamba2-ssd").unavailable_reason({"impl": "triton"})
    assert get("hla2").unavailable_reason({"impl": "triton"})


def test_duplicate_registration_needs_replace(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    with pytest.raises(ValueError, match="already registered"):
        register(get("sdpa"))
    register(get("sdpa"), replace=True)


def test_softmax_flops_formula():
    sdpa = get("sdpa")
    fwd = sdpa.model_flops(2, 1024, 4, 64, 64, "fwd")
    assert fwd == 4 * 2 * 1024 ** 2 * 4 * 64 / 2
    assert sdpa.model_flops(2, 1024, 4, 64, 64, "fwdbwd") == 3.5 * fwd
    assert sdpa.model_flops(1, 1000, 1, 64, 64, "decode") == 2 * 1000 * 128
    with pytest.raises(ValueError, match="mode"):
        sdpa.model_flops(1, 8, 1, 8, 8, "train")


@pytest.mark.parametrize("name", ["linear-attn", "based", "mamba2-ssd", "fla-linear-attn"])
def test_linear_time_flops_grow_linearly(name):
    mixer = get(name)
    short, long = (mixer.model_flops(1, n, 2, 64, 64, "fwd") for n in (1024, 4096))
    assert long == pytest.approx(4 * short) and short > 0
    assert mixer.model_flops(1, 1024, 2, 64, 64, "fwdbwd") > short
    assert mixer.model_flops(1, 10, 2, 64, 64, "decode") == mixer.model_flops(
        1, 10_000, 2, 64, 64, "decode")


def test_state_nbytes_counts_nested_tensors():
    state = {"S": torch.zeros(2, 3), "more": [torch.zeros(4, dtype=torch.float64)], "n": 5}
    assert state_nbytes(state) == 2 * 3 * 4 + 4 * 8


def test_entry_point_plugin_is_listed_and_runs(tmp_path, monkeypatch):
    source = tmp_path / "src"
    shutil.copytree(Path(__file__).parent / "example_plugin", source)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                    "--no-index", "--quiet", "--target", str(target), str(source)],
                   check=True, capture_output=True)
    monkeypatch.syspath_prepend(str(target))
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_loaded", False)

    assert "example-running-mean" in [m.name for m in all_mixers()]
    mixer = get("example-running-mean")
    assert isinstance(mixer, Mixer) and mixer.family == "example"
    v = torch.randn(1, 5, 2, 3)
    o, _ = mixer.op()(v, v, v)
    torch.testing.assert_close(o[:, 2], v[:, :3].mean(1))


@pytest.mark.parametrize("name", ["hla2", "hla2-unmasked", "ahla2", "hla3"])
def test_hla_flops_come_from_the_operator_modules(name):
    mixer = get(name)
    short = mixer.model_flops(1, 1024, 2, 64, 64, "fwd")
    if short is None:
        pytest.skip(f"{name}: no *_flops function yet")
    assert short > 0
    assert mixer.model_flops(1, 4096, 2, 64, 64, "fwd") == pytest.approx(4 * short, rel=0.05)
    assert mixer.model_flops(1, 1024, 2, 64, 64, "fwdbwd") > short


def test_a_plugin_giving_a_non_mixer_is_an_error(monkeypatch):
    class FakeEntryPoint:
        name, value = "junk", "junk_module:mixers"

        def load(self):
            return lambda: ["not a mixer"]

    monkeypatch.setattr(registry, "entry_points", lambda group: [FakeEntryPoint()])
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_loaded", False)
    with pytest.raises(TypeError, match="plugin 'junk'.*gave str, expected Mixer"):
        all_mixers()
