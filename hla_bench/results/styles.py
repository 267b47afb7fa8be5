"""How every figure of the harness draws a mixer: a colour by family, the same for a mixer in
every figure, and a line style and marker for its variant.

Families: the HLA operators in blues and purples, fla's linear-attention family (and the
harness's own linear attention and Based) in greens, softmax attention in grey and black,
Mamba in oranges; any other mixer in browns and pinks. A mixer's colour depends on its name
alone, never on which other mixers a figure holds: the known mixers have a fixed colour,
an unknown one a colour of its family chosen from its name. Variants of one mixer (a label
such as `hla2-chunk` for mixer `hla2` with `impl=chunk`) share its colour and differ by
line style and marker.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterable

# family -> (what it covers, {mixer: colour}, colours for mixers not listed)
FAMILIES: dict[str, tuple[str, dict[str, str], tuple[str, ...]]] = {
    "hla": ("HLA operators",
            {"hla2": "#1f4fbf", "ahla2": "#6a3d9a", "hla3": "#2fa4e7", "hla2-unmasked": "#b39ddb"},
            ("#3949ab", "#8e24aa", "#0277bd", "#7986cb")),
    "linear": ("linear attention (fla and its kin)",
               {"fla-linear-attn": "#1b7837", "linear-attn": "#66bd63", "fla-gla": "#00897b",
                "fla-simple-gla": "#80cdc1", "fla-delta-rule": "#9e9d24",
                "fla-gated-delta-rule": "#c0ca33", "based": "#004d40"},
               ("#33691e", "#26a69a", "#558b2f", "#aed581")),
    "softmax": ("softmax attention",
                {"sdpa": "#000000", "flash-attn": "#808080"},
                ("#404040", "#a6a6a6")),
    "mamba": ("Mamba", {"mamba2-ssd": "#e65100", "mamba2": "#e65100"},
              ("#ff9800", "#bf360c", "#ffb74d")),
    "other": ("other mixers", {}, ("#8d6e63", "#d81b60", "#5d4037", "#f06292", "#a1887f")),
}
FAMILY_ORDER = tuple(FAMILIES)

# a variant's suffix -> (line style, marker); the plain mixer: solid with circles
VARIANTS = {"": ("-", "o"), "triton": ("-", "o"), "cudnn": ("-", "o"),
            "chunk": ("--", "s"), "flash": ("--", "s"), "parallel": (":", "^"),
            "recurrent": ("-.", "D"), "efficient": ("-.", "D"), "math": (":", "^")}
OTHER_VARIANTS = (("-.", "v"), ((0, (5, 1, 1, 1)), "P"), ((0, (1, 1)), "X"), ((0, (6, 2)), "*"))


def _pick(name: str, choices: tuple) -> object:
    """A choice that depends on `name` alone (not on Python's per-process string hash)."""
    return choices[int(hashlib.sha1(name.encode()).hexdigest(), 16) % len(choices)]


def family(name: str) -> str:
    """The family of mixer `name` (a registry name: `hla2`, `fla-gla`, `sdpa`)."""
    for key, (_, known, _) in FAMILIES.items():
        if name in known:
            return key
    if name.startswith(("hla", "ahla")):
        return "hla"
    if name.startswith("sdpa") or name.endswith("attention") or name in ("attention", "attn"):
        return "softmax"
    if name.startswith(("fla-", "linear-attn", "based", "gla", "delta")):
        return "linear"
    if name.startswith("mamba"):
        return "mamba"
    return "other"


def family_title(key: str) -> str:
    return FAMILIES[key][0]


def base_name(label: str, name: str | None = None) -> str:
    """The mixer a label names: `name` when known, else the longest known mixer name that
    the label starts with (`hla2-chunk` -> `hla2`), else the label itself."""
    if name:
        return name
    known = [mixer for _, mixers, _ in FAMILIES.values() for mixer in mixers]
    prefixes = [mixer for mixer in known if label == mixer or label.startswith(mixer + "-")]
    return max(prefixes, key=len) if prefixes else label


def color(name: str) -> str:
    """The colour of mixer `name` (variants share it)."""
    _, known, spare = FAMILIES[family(name)]
    return known.get(name) or str(_pick(name, spare))


@dataclass(frozen=True)
class Style:
    color: str
    linestyle: object
    marker: str
    family: str

    def line(self) -> dict:
        """Keyword arguments of `Axes.plot` for this style."""
        return {"color": self.color, "linestyle": self.linestyle, "marker": self.marker}


def style(label: str, name: str | None = None) -> Style:
    """How to draw the series `label` of mixer `name` (see `base_name`): the mixer's colour,
    the variant's line style and marker."""
    base = base_name(label, name)
    suffix = label[len(base) + 1:] if label.startswith(base + "-") else ("" if label == base else label)
    linestyle, marker = VARIANTS.get(suffix) or _pick(suffix, OTHER_VARIANTS)
    return Style(color(base), linestyle, marker, family(base))


def mixer_colors(names: Iterable[str]) -> dict[str, str]:
    """{label: colour} for mixer labels (their mixer found by `base_name`)."""
    return {name: color(base_name(name)) for name in names}


def ordered(labels: Iterable[str], names: dict[str, str] | None = None) -> list[str]:
    """`labels` grouped by family (FAMILY_ORDER), within a family by mixer (the family's
    table, then unknown mixers), variants of a mixer in their given order."""
    labels = list(dict.fromkeys(labels))
    names = names or {}

    def key(label: str) -> tuple[int, int]:
        base = base_name(label, names.get(label))
        known = list(FAMILIES[family(base)][1])
        return FAMILY_ORDER.index(family(base)), known.index(base) if base in known else len(known)

    return sorted(labels, key=key)


MAX_SERIES = 8  # series a panel holds by default


def split_views(labels: list[str], names: dict[str, str], rank: dict[str, float],
                anchor: str | None = None, limit: int = MAX_SERIES) -> list[tuple[str, list[str]]]:
    """The views of a figure with more than `limit` series: [(suffix, labels)], an overview
    (suffix "") and one view per family ("-hla", "-linear", ...; "-hla-2" and on when a
    family alone has more). `rank` orders labels, best first (lower is better); `anchor`
    (the baseline a ratio is taken against) is in every view. The overview holds the anchor,
    the best label of each family, then the best variant of each other mixer, family by
    family, up to `limit`. With at most `limit` labels: [("", labels)]."""
    labels = ordered(labels, names)
    if len(labels) <= limit:
        return [("", labels)]
    best = sorted(labels, key=lambda label: rank.get(label, float("inf")))
    fam = {label: family(base_name(label, names.get(label))) for label in labels}
    base = {label: base_name(label, names.get(label)) for label in labels}
    chosen = [anchor] if anchor in labels else []
    for key in FAMILY_ORDER:
        top = next((label for label in best if fam[label] == key), None)
        if top is not None and top not in chosen:
            chosen.append(top)
    for key in FAMILY_ORDER:
        for label in best:
            if len(chosen) >= limit:
                break
            if fam[label] == key and base[label] not in {base[c] for c in chosen}:
                chosen.append(label)
    views = [("", ordered(chosen[:limit], names))]
    room = limit - (1 if anchor in labels else 0)
    for key in FAMILY_ORDER:
        members = [label for label in labels if fam[label] == key and label != anchor]
        if not members:
            continue
        parts = [members[start:start + room] for start in range(0, len(members), room)]
        for index, part in enumerate(parts):
            suffix = f"-{key}" + (f"-{index + 1}" if len(parts) > 1 else "")
            extra = [anchor] if anchor in labels else []
            if not set(part) <= set(views[0][1]):  # a view adding nothing is left out
                views.append((suffix, ordered(extra + part, names)))
    return views
