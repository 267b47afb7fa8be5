"""What both wings read from the command line and from config files alike: a `key=value`
value (`parse_value`, and `parse_params` for a command's `--param KEY=VALUE` items) and a
mixer spec (`MixerSpec`: a registered mixer's name, its option overrides and its label).

It imports neither torch nor the mixers, so a command checks its input before the heavy
imports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import click
import yaml


def parse_value(text: str, where: str) -> Any:
    """A `key=value` value from the command line, read as YAML (`0.9`, `true`, `[0.9, 0.8]`),
    where YAML 1.1's strings that are numbers (`1e6`) become numbers; a value that is not
    YAML is a ValueError naming `where`."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as error:
        problem = str(error).splitlines()[0]
        raise ValueError(f"{where}: {text!r} is not a YAML value ({problem})") from None
    if isinstance(value, str):
        try:
            return float(value) if _FLOAT.match(value) else value
        except ValueError:
            return value
    return value


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


@dataclass(frozen=True)
class MixerSpec:
    """A registered mixer with option overrides, shown under `label`."""

    name: str
    label: str
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> "MixerSpec":
        """`NAME[:key=value...]`; values go through yaml.safe_load; `label=` names the variant."""
        name, *pairs = text.strip().split(":")
        if not name:
            raise ValueError(f"bad mixer spec {text!r}: missing mixer name")
        options: dict[str, Any] = {}
        label = None
        for pair in pairs:
            key, sep, value = pair.partition("=")
            key = key.strip()
            if not sep or not key:
                raise ValueError(f"bad mixer spec {text!r}: {pair!r} is not key=value")
            if key in options or (key == "label" and label is not None):
                raise ValueError(f"bad mixer spec {text!r}: {key} is given twice")
            if key == "label":
                label = value.strip()
                if not label:
                    raise ValueError(f"bad mixer spec {text!r}: label= is empty")
            else:
                options[key] = (parse_value(value, f"bad mixer spec {text!r}")
                                if value.strip() else "")
        return cls(name.strip(), label or name.strip(), options)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | str) -> "MixerSpec":
        """A YAML entry: a spec string or {name, label, options}."""
        if isinstance(data, str):
            return cls.parse(data)
        if not isinstance(data, Mapping) or "name" not in data:
            raise ValueError(f"bad mixer entry {data!r}: expected a mapping with a 'name'")
        unknown = sorted(set(data) - {"name", "label", "options"})
        if unknown:
            raise ValueError(f"bad mixer entry {data!r}: unknown key {unknown[0]!r}")
        options = data.get("options") or {}
        if not isinstance(options, Mapping):
            raise ValueError(f"mixer {data['name']!r}: options must be a mapping")
        return cls(str(data["name"]), str(data.get("label") or data["name"]), dict(options))

    def to_dict(self) -> dict[str, Any]:
        """The YAML entry `from_dict` reads back."""
        return {"name": self.name, "label": self.label, "options": dict(self.options)}

    def text(self) -> str:
        """The spec as written on the command line, without its label: `hla2:impl=chunk`."""
        return ":".join([self.name, *(f"{key}={value}" for key, value in self.options.items())])


def parse_params(ctx, param, values) -> dict:
    """`--param KEY=VALUE` items as task parameters (VALUE read as YAML, dashes in KEY as
    underscores)."""
    params = {}
    for item in values or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {item!r}")
        key = key.replace("-", "_")
        if key in params:
            raise click.BadParameter(f"{key} is given twice")
        try:
            params[key] = parse_value(value, key)
        except ValueError as error:
            raise click.BadParameter(str(error)) from None
    return params
