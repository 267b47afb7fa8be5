"""The configs shipped with hla-bench, found as package data (importlib.resources), so that
an installed package runs them as a checkout does.

A CONFIG given to `hla-bench run` or `hla-bench recall --config` is a path to a YAML file,
or the name of a shipped config (`h200-kernels` or `h200-kernels.yaml`); a file at that
path comes first. `reference/` holds published scores the report compares against, not
configs.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

DEFAULT = "cpu-smoke"


def folder() -> Path:
    """The folder of the shipped configs (a plain folder: wheels install as files)."""
    return Path(str(resources.files(__name__)))


def names() -> list[str]:
    """The shipped configs, by name (file name without .yaml)."""
    return sorted(path.stem for path in folder().glob("*.yaml"))


def shipped(name: str) -> Path:
    """The path of the shipped config `name` (with or without .yaml); ValueError naming the
    shipped configs when there is none."""
    stem = name.removesuffix(".yaml")
    path = folder() / f"{stem}.yaml"
    if "/" in stem or not path.is_file():
        raise ValueError(f"no shipped config named {name!r} (shipped: {', '.join(names())})")
    return path


def find(text: str) -> Path:
    """A CONFIG argument: the file at `text` when there is one, else the shipped config of
    that name; ValueError when neither exists."""
    path = Path(text)
    if path.is_file():
        return path
    if path.exists():
        raise ValueError(f"{text}: not a file")
    try:
        return shipped(text)
    except ValueError:
        raise ValueError(f"{text}: no such file, and no shipped config of that name "
                         f"(shipped: {', '.join(names())})") from None


def reference(name: str) -> Path:
    """A file of `reference/` (published scores)."""
    return folder() / "reference" / name
