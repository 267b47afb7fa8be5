"""The mixer registry: the only way the harness and the recall tasks reach a mixer.

Entries are `Mixer`s (defined beside the operators in `mixers.entry` and re-exported here for
plugin authors, with `Decoder`, `MixerUnavailableError` and `state_nbytes`). The registry
holds the built-ins, `mixers.builtin.builtin_mixers()`, and what third-party packages add
through the entry-point group `hla_bench.mixers` (each entry point is a callable that takes
no argument and calls `register`, or a `Mixer`, or a list of them). Both are loaded on first
use, so importing the registry does not import the operators.
"""

from __future__ import annotations

import importlib.metadata
from importlib.metadata import entry_points
from typing import Any

from mixers.entry import (FLOP_MODES, PACKAGE_NAMES, Decoder, Mixer, MixerUnavailableError,
                          requirement_missing, state_nbytes)

__all__ = ["ENTRY_POINT_GROUP", "FLOP_MODES", "PACKAGE_NAMES", "Decoder", "Mixer",
           "MixerUnavailableError", "UnknownMixerError", "all_mixers", "get", "register",
           "requirement_missing", "state_nbytes", "what_ran"]

ENTRY_POINT_GROUP = "hla_bench.mixers"


class UnknownMixerError(ValueError):
    """Raised for a mixer name that is not registered."""


_REGISTRY: dict[str, Mixer] = {}
_loaded = False


def register(mixer: Mixer, *, replace: bool = False) -> Mixer:
    """Add `mixer` to the registry; a second entry with the same name needs `replace=True`."""
    if mixer.name in _REGISTRY and not replace:
        raise ValueError(f"mixer {mixer.name!r} is already registered")
    _REGISTRY[mixer.name] = mixer
    return mixer


def _load() -> None:
    """Register the built-ins, then the entry-point plugins, once. A plugin replaces a
    built-in of the same name; a name registered before the first use keeps its entry."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    from mixers.builtin import builtin_mixers  # here: importing the registry stays light

    for mixer in builtin_mixers():
        _REGISTRY.setdefault(mixer.name, mixer)
    for entry_point in entry_points(group=ENTRY_POINT_GROUP):
        where = f"{ENTRY_POINT_GROUP} plugin {entry_point.name!r} ({entry_point.value})"
        try:
            loaded = entry_point.load()
        except Exception as error:
            raise ImportError(f"{where} failed to load: {error}") from error
        items = loaded() if callable(loaded) and not isinstance(loaded, Mixer) else loaded
        for item in items if isinstance(items, (list, tuple)) else [items]:
            if isinstance(item, Mixer):
                register(item, replace=True)
            elif item is not None:
                raise TypeError(f"{where} gave {type(item).__name__}, expected Mixer")


def get(name: str) -> Mixer:
    """The mixer called `name`; UnknownMixerError lists the registered names otherwise."""
    _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise UnknownMixerError(f"unknown mixer {name!r}; registered: {known}") from None


def all_mixers() -> list[Mixer]:
    """Every registered mixer, sorted by family then name."""
    _load()
    return sorted(_REGISTRY.values(), key=lambda m: (m.family, m.name))


def what_ran(mixer: Mixer, notes: dict[str, Any]) -> dict[str, Any]:
    """What ran: the notes of the mixer's dispatch (`mixers.dispatch`), and the installed
    versions of torch and of the packages whose kernels the mixer needs or its dispatch
    named (None: not installed)."""
    names = ["torch", *(name for name in mixer.requires if name != "cuda")]
    if notes.get("impl") == "triton":
        names.append("triton")
    if notes.get("kernel"):
        names.append(notes["kernel"])
    packages = {}
    for name in dict.fromkeys(names):
        try:
            packages[name] = importlib.metadata.version(PACKAGE_NAMES.get(name, name))
        except importlib.metadata.PackageNotFoundError:
            packages[name] = None
    return {**notes, "packages": packages}
