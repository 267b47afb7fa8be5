"""What an op's dispatcher chose, told to whoever is listening (the harness records it).

A dispatcher that picks among implementations calls `note(impl=..., ...)` with what it chose
and, where it fell back, why (`fallback=`). Outside a `noting()` block a note costs one
context-variable lookup and is dropped; inside, the facts of every note in the block are
merged into the block's mapping (a later note of the same key replaces the earlier one, or
with `keep="first"` leaves it).
Values are plain data (str, int, float, bool), so they can be written to a results file.
While torch.compile traces, nobody listens: a traced dispatch runs as a graph without its
host-side notes (a context variable would break the graph).
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Callable, Iterator

import torch

_NOTES: ContextVar[dict[str, Any] | None] = ContextVar("dispatch_notes", default=None)


def note(**facts: Any) -> None:
    """Record `facts` about the implementation that runs, when someone is listening."""
    if torch.compiler.is_compiling():
        return
    notes = _NOTES.get()
    if notes is not None:
        notes.update(facts)


def listening() -> bool:
    """Whether a note would be kept (to skip working out facts nobody asked for)."""
    return not torch.compiler.is_compiling() and _NOTES.get() is not None


class _FirstNotes(dict):
    """Notes where the first fact of a key stays."""

    def update(self, facts: dict[str, Any]) -> None:  # type: ignore[override]
        for key, value in facts.items():
            self.setdefault(key, value)


@contextlib.contextmanager
def noting(keep: str = "last") -> Iterator[dict[str, Any]]:
    """A mapping that collects the notes of every dispatch inside the block; of notes of one
    key it keeps the `keep` ("last" or "first") one."""
    if keep not in ("last", "first"):
        raise ValueError(f"keep must be 'last' or 'first', got {keep!r}")
    notes: dict[str, Any] = {} if keep == "last" else _FirstNotes()
    token = _NOTES.set(notes)
    try:
        yield notes
    finally:
        _NOTES.reset(token)


@torch.compiler.disable
def opaque(function: Callable, *args, **kwargs):
    """`function(*args, **kwargs)`, never traced by torch.compile (eager as ever otherwise):
    the way around the compiler for kernels it cannot trace (Triton launchers with their own
    autotuners, fla and mamba ops), at the cost of a graph break."""
    return function(*args, **kwargs)
