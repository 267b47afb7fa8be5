"""What the stacked-training kernels share: Triton (a Linux-only dependency, so optional
here), the choice between the Triton and PyTorch paths, and argument checks."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # without Triton only the PyTorch paths run
    triton = tl = None

IMPLS = ("auto", "triton", "torch")
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def jit(fn):
    """triton.jit, or the plain function where Triton is missing (never launched then:
    `use_triton` refuses the Triton path). The kernels' annotations stay strings
    (`from __future__ import annotations`), so defining them needs no Triton."""
    return triton.jit(fn) if triton is not None else fn


def interpreted() -> bool:
    """Whether Triton kernels run under its interpreter (TRITON_INTERPRET=1: on the CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


INTERPRETED = tl.constexpr(interpreted()) if tl is not None else interpreted()


@jit
def rounded(x, dtype: tl.constexpr):
    """x (float32 or float64) in `dtype`, rounded to nearest even as PyTorch rounds. Triton's
    interpreter casts to bfloat16 by dropping the low bits (toward zero), so under it the
    rounding to bfloat16 is done on the bits of the float32 value (of x in float32)."""
    if INTERPRETED:
        if dtype == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dtype)
    else:
        return x.to(dtype)


def use_triton(impl: str, device: torch.device, dtype: torch.dtype,
               unsupported: str | None = None) -> bool:
    """Whether `impl` runs the Triton kernels on tensors of `device` and `dtype`. "auto": on
    CUDA, for 16-bit and float32 tensors (float64 takes the PyTorch path); "triton": always,
    on CUDA or under the interpreter (a ValueError where it cannot run); "torch": never.
    `unsupported` names what the kernels do not take about the arguments (None: nothing)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "torch":
        return False
    if impl == "auto":
        return (triton is not None and device.type == "cuda" and dtype != torch.float64
                and unsupported is None)
    if triton is None:
        unsupported = "Triton is not installed"
    elif device.type != "cuda" and not interpreted():
        unsupported = "the tensors are not on a CUDA device and TRITON_INTERPRET is not 1"
    if unsupported is not None:
        raise ValueError(f"impl='triton' cannot run here: {unsupported}")
    return True


def check_tensor(name: str, x, shape: tuple[int, ...], *, floating: bool = True) -> None:
    """A ValueError naming `name` unless x is a tensor of `shape` (floating-point, or of an
    integer dtype when not `floating`)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
    if floating and x.dtype not in FLOATS:
        raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if not floating and (x.is_floating_point() or x.is_complex() or x.dtype == torch.bool):
        raise ValueError(f"{name} must have an integer dtype, got {x.dtype}")


def check_device(reference: torch.Tensor, **tensors) -> None:
    """A ValueError naming the first of `tensors` (None skipped) not on reference's device."""
    for name, x in tensors.items():
        if x is not None and x.device != reference.device:
            raise ValueError(f"{name} is on {x.device}, the other inputs on {reference.device}")


def accumulator(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics and sums run in for inputs of `dtype`: float32, or float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@jit
def div_rn(a, b, CT: tl.constexpr):
    """a / b rounded to nearest in CT (Triton's float32 `/` is approximate)."""
    if CT == tl.float64:
        return a / b
    else:
        return tl.div_rn(a, b)
