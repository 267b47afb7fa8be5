"""Registers, spills and shared memory of the hla2 Triton kernels on Hopper, without a GPU.

    python benchmarks/hla2_resources.py [--head-dim 128] [--value-dim D] [--seq-len 4096]
                                        [--batch 1]
                                        [--heads 2] [--backward] [--normalize] [--decay]
                                        [--yaml out.yaml]

Runs hla2_triton on CPU tensors with every kernel launch captured instead of run
(TRITON_INTERPRET=1 around the call lets the dispatcher through; nothing executes), then
compiles each captured launch for sm_90a (an H100 / H200) with its compile-time arguments,
argument dtypes and each warp count it can be launched with (its autotune list, or its
fixed num_warps), and reads the cubin's resource usage with the cuobjdump bundled with
Triton: registers per thread (255 is the cap), stack bytes (register spills), shared
memory. An SM has 65,536 registers and 228 KiB of shared memory: at 8 warps a program
above 128 registers per thread, or above about 113 KiB, runs alone on its SM. Pointers and
integer arguments divisible by 16 are compiled as such, as the JIT's specialisation does
with real tensors.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
import yaml
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from mixers.hla.hla2.triton import backward, hla2_triton, increments, output, scans

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "cuobjdump")
# warp counts each autotuned kernel may launch with (the stage modules' tuning lists)
TUNED_WARPS = {"chunk_increments_kernel": increments.INCREMENTS_WARPS,
               "chunk_grad_terms_kernel": increments.INCREMENTS_WARPS,
               "chunk_output_kernel": output.OUTPUT_WARPS,
               "chunk_grads_kernel": backward.GRADS_WARPS}
# kernel -> the stage module its launcher finds it in
KERNELS = {"chunk_increments_kernel": increments, "state_scan_kernel": scans,
           "chunk_output_kernel": output, "chunk_grad_terms_kernel": backward,
           "grad_scan_kernel": scans, "chunk_grads_kernel": backward}
POINTER_TYPES = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


def capture_launches(B, T, H, D, backward, normalize, decay, DV=None):
    """[(kernel name, JITFunction, args, kwargs)] of one hla2_triton call (and its backward)
    on [B, T, H, D] bf16 CPU tensors (v [B, T, H, DV], DV = D by default), with the kernels
    replaced by recorders."""
    launches = []

    class Recorder:
        def __init__(self, name):
            kernel = getattr(KERNELS[name], name)  # a JITFunction, or an Autotuner around one
            self.name, self.fn = name, kernel if isinstance(kernel, JITFunction) else kernel.fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, self.fn, args, kwargs))

    saved = {name: getattr(module, name) for name, module in KERNELS.items()}
    for name, module in KERNELS.items():
        setattr(module, name, Recorder(name))
    os.environ["TRITON_INTERPRET"] = "1"  # the dispatcher's device check; nothing runs
    try:
        q, k, v = (torch.randn(B, T, H, dim, dtype=torch.bfloat16, requires_grad=backward)
                   for dim in (D, D, DV or D))
        g = torch.full((H,), 0.99) if decay else None
        o, _ = hla2_triton(q, k, v, normalize=normalize, decay=g)
        if backward:
            torch.autograd.grad(o, (q, k, v), torch.randn_like(o))
    finally:
        del os.environ["TRITON_INTERPRET"]
        for name, kernel in saved.items():
            setattr(KERNELS[name], name, kernel)
    return launches


def compile_launch(fn, args, kwargs, num_warps):
    """The sm_90a compile of fn with these arguments' types and compile-time values."""
    constexprs = {name: value for name, value in kwargs.items()
                  if name not in ("num_warps", "num_stages")}
    signature, attrs = {}, {}
    for index, (name, value) in enumerate(zip(fn.arg_names, args)):
        if isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[value.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32"
            if value % 16 == 0 and name not in fn.do_not_specialize:
                attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    for name in constexprs:
        signature[name] = "constexpr"
    src = ASTSource(fn, signature, constexprs, attrs)
    options = {"num_warps": num_warps}
    if "num_stages" in kwargs:
        options["num_stages"] = kwargs["num_stages"]
    return triton.compile(src, target=TARGET, options=options)


def resource_usage(compiled):
    """(registers, stack bytes, shared bytes) of a compiled kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", cubin.name],
                             capture_output=True, text=True, check=True).stdout
    usage = dict(re.findall(r"(REG|STACK):(\d+)", out))
    return int(usage["REG"]), int(usage["STACK"]), compiled.metadata.shared


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dim", type=int, default=128,
                        help="any of 1 to 256 (not a power of two: padded inside the kernels)")
    parser.add_argument("--value-dim", type=int, help="Dv (default: the head dim)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2,
                        help="batch x heads and the length pick the scans' row blocks and "
                             "levels, as on a 132-SM GPU")
    parser.add_argument("--backward", action="store_true", help="also the backward's kernels")
    parser.add_argument("--normalize", action="store_true")
    parser.add_argument("--decay", action="store_true")
    parser.add_argument("--yaml", help="also write the rows to this file")
    args = parser.parse_args()
    launches = capture_launches(args.batch, args.seq_len, args.heads, args.head_dim,
                                args.backward, args.normalize, args.decay, args.value_dim)
    rows, seen = [], set()
    for name, fn, call_args, kwargs in launches:
        shown = {k: v for k, v in kwargs.items() if k in ("D", "DV", "PD", "PDV", "C", "BR",
                                                          "BT", "BV", "BD", "BC",
                                                          "SEG", "CL", "WANT_Q", "WANT_K",
                                                          "WANT_V", "SUMMARY")}
        for warps in TUNED_WARPS.get(name, (kwargs.get("num_warps", 4),)):
            key = (name, tuple(sorted(kwargs.items())), warps)
            if key in seen:
                continue
            seen.add(key)
            registers, stack, shared = resource_usage(compile_launch(fn, call_args, kwargs, warps))
            rows.append({"kernel": name, "warps": warps, **shown, "registers": registers,
                         "spill_stack_bytes": stack, "shared_bytes": shared})
            print(f"{name:24s} warps {warps}  registers {registers:3d}  stack {stack:5d} B  "
                  f"shared {shared / 1024:6.1f} KiB  {shown}")
    if args.yaml:
        with open(args.yaml, "w") as f:
            yaml.safe_dump({"command": " ".join(sys.argv[1:]), "target": "sm_90a",
                            "triton": triton.__version__, "rows": rows}, f, sort_keys=False)


if __name__ == "__main__":
    main()
