"""What both wings read from the command line and from config files alike.

One configuration mechanism: a config is a dataclass whose fields are its keys, each made
by `config_field` with its default (written once, here), its help and whether the command
line takes it. A config file accepts exactly these keys; a command derives its options
from the same fields (`with_field_options`: `--NAME-WITH-DASHES` per field, the help the
field's), so neither the keys nor the defaults are repeated by hand. Bench's sweep settings
(`hla_bench.speed.sweeps.SweepConfig`) and recall's config (`hla_bench.recall.schema`) are
such dataclasses; each wing adds its own metadata (bench: a setting's kind; recall: a
value's check and its option's type).

Also here: a `key=value` value (`parse_value`, `parse_params` for a command's
`--param KEY=VALUE` items, `comma_list` for a comma-separated option) and a mixer spec
(`MixerSpec`: a registered mixer's name, its option overrides and its label).

It imports neither torch nor the mixers, so a command checks its input before the heavy
imports.
"""

from __future__ import annotations

import copy
import re
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Callable, Iterable, Mapping

import click
import yaml


# ---------------------------------------------------------------- config fields


def config_field(default: Any = MISSING, *, help: str, cli: bool = True, **metadata: Any) -> Any:
    """A config dataclass field: `default` (MISSING: required; a list or mapping is copied
    per config), the `help` the command line shows, whether the command line takes it
    (`cli`), and the wing's own `metadata`."""
    meta = {"help": help, "cli": cli, **metadata}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return field(default=default, metadata=meta)


def is_required(each: Field) -> bool:
    """A field without a default: a config must give it."""
    return each.default is MISSING and each.default_factory is MISSING


def field_default(each: Field) -> Any:
    """A field's default (a fresh copy of a list or mapping); MISSING for a required one."""
    return each.default_factory() if each.default_factory is not MISSING else each.default


def defaults(config_class: type) -> dict[str, Any]:
    """Every field of a config dataclass with its default (a required one left out)."""
    return {each.name: field_default(each) for each in fields(config_class)
            if not is_required(each)}


def option_flag(each: Field) -> str:
    """The command-line option of a field: `--` and its name, dashes for underscores."""
    return "--" + each.name.replace("_", "-")


def with_field_options(config_fields: Iterable[Field],
                       option: Callable[[Field], Callable]) -> Callable[[Callable], Callable]:
    """A decorator adding `option(field)` for every field the command line takes (`cli`),
    in declaration order: the command's keyword argument of each is the field's name."""
    chosen = [each for each in config_fields if each.metadata["cli"]]

    def decorate(command: Callable) -> Callable:
        for each in reversed(chosen):
            command = option(each)(command)
        return command
    return decorate


def comma_list(kind: Callable[[str], Any]) -> Callable:
    """A click callback reading a comma-separated option as a list of `kind` (None when the
    option is not given); an empty item or one `kind` refuses is a usage error."""
    def parse(ctx, param, value):
        if value is None:
            return None
        items = [item.strip() for item in value.split(",")]
        if any(not item for item in items):
            raise click.BadParameter(f"empty item in {value!r}")
        try:
            return [kind(item) for item in items]
        except ValueError:
            raise click.BadParameter(f"expected a comma-separated list of {kind.__name__}, "
                                     f"got {value!r}") from None
    return parse


# ---------------------------------------------------------------- values and mixer specs


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
