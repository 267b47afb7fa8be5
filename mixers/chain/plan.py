"""How a link of a chain launches (mixers/chain): a frozen plan per call."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mixers.tiles import interpreted

MAX_HEAD_DIM = 512  # key and value dims the ops take (blocks of 64, looped or spread; a
# normalized value width adds its column of ones: 513)


def device_reason(x: torch.Tensor) -> str | None:
    """Why the kernels cannot run on x's device (CUDA, or the CPU under TRITON_INTERPRET=1),
    or None."""
    if x.device.type != "cuda" and not interpreted():
        return "the tensors are not on a CUDA device"
    return None


def block(size: int, cap: int = 64) -> int:
    """The smallest power of two >= size, at least 16 (tl.dot's smallest) and at most cap."""
    return min(cap, max(16, 1 << (size - 1).bit_length()))


LAYOUTS = ("chunks", "fla")


@dataclass(frozen=True)
class ChainPlan:
    """Tokens per chunk, the key and value columns a program holds (larger head dims loop
    over blocks or spread over programs), warps per program, the software pipeline's stages
    (loads issued that many loop steps ahead), the products' precision (tiles.mm: tl.dot's
    input_precision, or "bf16": operands rounded to bfloat16), the chunk
    scan's launch (entries and warps per program), when the states are walked instead
    (walk.py: when a link has at most `walk_chunks` chunks, or when a walk's programs, key
    blocks x value blocks x batch x heads, number at least `walk_from`; None: never), and
    whether one output program covers
    every value block of its chunk (output.py: Q K^T formed once, not once per value
    block), and whether the backward's dq, dk and dv come from one launch (grad_fused.py:
    Q K^T and dO V^T formed once a chunk) instead of two, and the forward's layout
    ("chunks": increments of every chunk at once, a scan and an output program per (chunk,
    value block), or walk.py's walk for short links; "fla": tiled.py, the two launches of
    fla's chunked kernels, a state walk per [BK, BV] tile and an output program per (value
    block, chunk) looping over key blocks; the backward is the same for both), and whether
    the "fla" layout stores the chunk start states in bfloat16 (`narrow_starts`, as fla
    stores its states: half the bytes written and read; only with precision "bf16", whose
    products round them to bfloat16 anyway, so outputs and gradients are those of float32
    start states; the final state stays in the link's dtype). Precision:
    tf32 for 16-bit inputs (it holds their values exactly; the float32 links between
    chained calls round to it), exact for float32 and float64."""

    chunk: int
    block_k: int
    block_v: int
    warps: int
    stages: int
    precision: str
    scan_block: int = 256   # state entries per program of the chunk scan (scan.py)
    scan_warps: int = 2
    walk_chunks: int = 4    # a walk of this few steps does the increments' work, no more
    walk_from: int | None = None
    scores_once: bool = False
    fused_backward: bool = False
    layout: str = "chunks"  # or "fla" (tiled.py)
    narrow_starts: bool = False

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r}: one of {', '.join(LAYOUTS)}")
        if self.narrow_starts and (self.layout != "fla" or self.precision != "bf16"):
            raise ValueError("narrow_starts takes the layout \"fla\" and precision \"bf16\"")

    def walks(self, chunks: int, programs: int) -> bool:
        """Whether a link of `chunks` chunks whose walk would launch `programs` programs
        walks its states."""
        return chunks <= self.walk_chunks or (self.walk_from is not None
                                              and programs >= self.walk_from)


def plan_chain(key_dim: int, value_width: int, dtype: torch.dtype,
               chunk_size: int = 64, layout: str = "chunks") -> ChainPlan:
    """Chunks of 64 tokens (16 in float64, whose tiles take twice the registers; a smaller
    power of two when the caller asks for one), blocks of up to 64 key and value columns,
    4 warps and 2 pipeline stages: the plan `benchmarks/chain_plans.py` found fastest
    (docs/kernels.md, "Launch plan and resources", gives its measurements and the other
    changes it tried). `layout` picks the forward's kernels (ChainPlan.layout)."""
    chunk = 16 if dtype == torch.float64 else 64
    if chunk_size in (16, 32) and chunk_size < chunk:
        chunk = chunk_size
    precision = "tf32" if dtype in (torch.float16, torch.bfloat16) else "ieee"
    return ChainPlan(chunk=chunk, block_k=block(key_dim), block_v=block(value_width), warps=4,
                     stages=2, precision=precision, layout=layout)
