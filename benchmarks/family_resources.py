"""Registers, spills and shared memory of the ahla2 and hla3 Triton kernels on Hopper,
without a GPU (the method of hla2_resources.py, whose compile and read-out it uses).

    python benchmarks/family_resources.py [--head-dims 64,128,256,512] [--walked] [--scores-once]
                                          [--yaml out.yaml]

Each kernel launch of one bf16 forward (T = 4096, normalized) with its backward and one
decode step per head dim, with D = Dv, is captured instead of run and compiled for sm_90a
(`--walked`: with the links' states walked, mixers/hla/chain/walk.py; `--scores-once`: the
output kernels forming Q K^T once for all value blocks);
an H100 / H200 SM has 65,536 registers and 228 KiB of shared memory
(227 KiB for one program).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import yaml

from hla2_resources import compile_launch, resource_usage
from mixers.hla.ahla2 import ahla2, ahla2_step
from mixers.hla.ahla2.triton import decode as ahla2_decode
from mixers.hla.chain import launch as chain_launch
from mixers.hla.chain.plan import ChainPlan
from mixers.hla.hla3 import hla3, hla3_step
from mixers.hla.hla3.triton import decode as hla3_decode

# (module, kernel name): every kernel of the family
KERNELS = [(chain_launch, "chain_states_kernel"), (chain_launch, "chain_scan_kernel"),
           (chain_launch, "chain_output_kernel"),
           (chain_launch, "chain_grad_states_kernel"), (chain_launch, "chain_grad_keys_kernel"),
           (chain_launch, "chain_grad_values_kernel"),
           (chain_launch, "chain_walk_kernel"), (chain_launch, "chain_grad_walk_kernel"),
           (ahla2_decode, "ahla2_step_kernel"), (hla3_decode, "hla3_step_kernel")]


def capture(D: int, T: int = 4096, H: int = 2, walked: bool = False) -> list[tuple]:
    """[(kernel name, JITFunction, args, kwargs)] of a forward and a step of both ops (with
    the states walked: every plan's `walks` answers yes)."""
    launches = []

    class Recorder:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, self.fn, args, kwargs))

    saved = [(module, name, getattr(module, name)) for module, name in KERNELS]
    for module, name, fn in saved:
        setattr(module, name, Recorder(name, fn))
    os.environ["TRITON_INTERPRET"] = "1"  # the dispatchers' device check; nothing runs
    walks = ChainPlan.walks
    if walked:
        ChainPlan.walks = lambda self, chunks, programs: True
    try:
        q, k, v = (torch.randn(1, T, H, D, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        for op in (ahla2, hla3):
            op(q, k, v, impl="triton", normalize=True)[0].sum().backward()
        q, k, v = (x.detach() for x in (q, k, v))
        for step in (ahla2_step, hla3_step):
            step(q[:, 0], k[:, 0], v[:, 0], None, impl="triton", normalize=True)
    finally:
        del os.environ["TRITON_INTERPRET"]
        ChainPlan.walks = walks
        for module, name, fn in saved:
            setattr(module, name, fn)
    return launches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", default="64,128,256,512")
    parser.add_argument("--walked", action="store_true",
                        help="the links' states walked instead of increments + scan")
    parser.add_argument("--scores-once", action="store_true",
                        help="the output kernels form Q K^T once for all value blocks")
    parser.add_argument("--yaml", help="also write the rows to this file")
    args = parser.parse_args()
    rows = []
    for D in (int(d) for d in args.head_dims.split(",")):
        for name, fn, call_args, kwargs in capture(D, walked=args.walked):
            if args.scores_once and name == "chain_output_kernel":
                kwargs = {**kwargs, "SCORES_ONCE": True}
            warps = kwargs.get("num_warps", 4)
            try:
                registers, stack, shared = resource_usage(
                    compile_launch(fn, call_args, kwargs, warps))
            except Exception as error:  # noqa: BLE001 - a kernel that does not compile
                rows.append({"kernel": name, "D": D, "error": f"{type(error).__name__}: "
                                                              f"{str(error)[:300]}"})
                print(f"{name:22s} D={D:3d}: {rows[-1]['error']}")
                continue
            shown = {key: kwargs[key] for key in ("C", "BD", "BR", "BK", "BV") if key in kwargs}
            rows.append({"kernel": name, "D": D, "warps": warps, **shown,
                         "registers": registers, "spill_stack_bytes": stack,
                         "shared_bytes": shared})
            print(f"{name:22s} D={D:3d} warps {warps}  registers {registers:3d}  "
                  f"stack {stack:5d} B  shared {shared / 1024:6.1f} KiB  {shown}")
    if args.yaml:
        with open(args.yaml, "w") as f:
            yaml.safe_dump({"command": " ".join(sys.argv[1:]), "target": "sm_90a",
                            "triton": triton.__version__, "rows": rows}, f, sort_keys=False)


if __name__ == "__main__":
    main()
