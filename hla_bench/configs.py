"""The configs shipped with hla-bench: the repository's `configs/` folder, which a wheel
carries as package data (`hla_bench/shipped_configs/`, pyproject's package-dir), so an
installed package runs them as a checkout does.

A CONFIG given to `hla-bench run` or `hla-bench recall --config` is a path to a YAML file,
or the name of a shipped config (`gpu-kernels` or `gpu-kernels.yaml`); a file at that
path comes first. `published/` holds published scores the report compares against, not
configs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

DEFAULT = "cpu-smoke"
# Where a wheel installs the configs, beside this module; in a checkout (an editable
# install, or the repository on the path) they are the repository's configs/ folder.
INSTALLED = Path(__file__).with_name("shipped_configs")
CHECKOUT = Path(__file__).resolve().parents[1] / "configs"


def folder() -> Path:
    """The folder of the shipped configs: the installed copy, else the checkout's."""
    return INSTALLED if INSTALLED.is_dir() else CHECKOUT


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


def published(name: str) -> Path:
    """A file of `published/`: scores other projects published, read from their figures."""
    return folder() / "published" / name


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key written twice in one mapping (YAML keeps the
    last silently); keys brought in by a merge (`<<: *anchor`) may be overridden."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the mapping's own construction refuses it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | Path) -> Any:
    """A config file's YAML (UTF-8), with every key of a mapping given once; yaml.YAMLError
    or UnicodeDecodeError otherwise."""
    return yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)


class UnreadableConfigError(ValueError):
    """A config file that is not YAML text; the message names the file and the problem."""


class EmptyConfigError(UnreadableConfigError):
    """A config file with no text but white space: not a mapping of keys to values."""


def read_config(text: str) -> tuple[Path, Any]:
    """A CONFIG argument read in one call: the file `find` gives and its YAML
    (`read_yaml`). ValueError when there is no such config; UnreadableConfigError (or
    EmptyConfigError, for a file of white space only) naming the file when it is not
    UTF-8 text or not valid YAML."""
    path = find(text)
    if not path.read_text(encoding="utf-8", errors="replace").strip():
        raise EmptyConfigError(f"{path} is empty")
    try:
        return path, read_yaml(path)
    except yaml.YAMLError as error:
        raise UnreadableConfigError(f"{path}: not valid YAML: {yaml_problem(error)}") from None
    except UnicodeDecodeError as error:
        raise UnreadableConfigError(f"{path}: not UTF-8 text ({error.reason} at byte "
                                    f"{error.start})") from None


def yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML error in one line: what is wrong and where (line and column)."""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        what = " ".join(part for part in (error.context, error.problem) if part)
        return f"{what} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(error).split())
