"""Registers, spills and shared memory of the ahla2 and hla3 Triton kernels on Hopper,
without a GPU (the method of hla2_resources.py, whose compile and read-out it uses).

    python benchmarks/family_resources.py [--head-dims 64,128,256,512] [--plan FIELD=VALUE ...]
                                          [--yaml out.yaml]

Each kernel launch of one bf16 forward (T = 4096, normalized) with its backward and one
decode step per head dim, with D = Dv, is captured instead of run and compiled for sm_90a
(`--plan` sets fields of every link's ChainPlan, e.g. `--plan walk_from=1 --plan
scores_once=true --plan fused_backward=true --plan warps=8`);
an H100 / H200 SM has 65,536 registers and 228 KiB of shared memory
(227 KiB for one program).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import triton
import yaml

from hla2_resources import compile_launch, resource_usage
from mixers.hla.ahla2 import ahla2, ahla2_step
from mixers.hla.ahla2.triton import decode as ahla2_decode
from mixers.chain import launch as chain_launch
from mixers import chain
from mixers.hla.hla3 import hla3, hla3_step
from mixers.hla.hla3.triton import decode as hla3_decode

# (module, kernel name): every kernel of the family
KERNELS = [(chain_launch, "chain_states_kernel"), (chain_launch, "chain_scan_kernel"),
           (chain_launch, "chain_output_kernel"),
           (chain_launch, "chain_grad_states_kernel"), (chain_launch, "chain_grad_keys_kernel"),
           (chain_launch, "chain_grad_values_kernel"),
           (chain_launch, "chain_walk_kernel"), (chain_launch, "chain_grad_walk_kernel"),
           (chain_launch, "chain_grad_fused_kernel"),
           (chain_launch, "chain_tiled_states_kernel"), (chain_launch, "chain_tiled_output_kernel"),
           (ahla2_decode, "ahla2_step_kernel"), (hla3_decode, "hla3_step_kernel")]


def capture(D: int, T: int = 4096, H: int = 2, plan: dict | None = None) -> list[tuple]:
    """[(kernel name, JITFunction, args, kwargs)] of a forward and a step of both ops, the
    links' plans with the fields of `plan` set."""
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
    planned = chain.plan_chain
    chain.plan_chain = lambda *args: dataclasses.replace(planned(*args), **(plan or {}))
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
        chain.plan_chain = planned
        for module, name, fn in saved:
            setattr(module, name, fn)
    return launches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", default="64,128,256,512")
    parser.add_argument("--plan", action="append", default=[], metavar="FIELD=VALUE",
                        help="a ChainPlan field for every link (repeatable)")
    parser.add_argument("--yaml", help="also write the rows to this file")
    args = parser.parse_args()
    fields = {field.name: field for field in dataclasses.fields(chain.ChainPlan)}
    plan = {}
    for item in args.plan:
        name, _, value = item.partition("=")
        if name not in fields or not value:
            parser.error(f"--plan {item!r}: FIELD=VALUE with FIELD one of {', '.join(fields)}")
        plan[name] = yaml.safe_load(value)
    rows = []
    for D in (int(d) for d in args.head_dims.split(",")):
        for name, fn, call_args, kwargs in capture(D, plan=plan):
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
                            "triton": triton.__version__, "plan": plan, "rows": rows}, f,
                           sort_keys=False)


if __name__ == "__main__":
    main()
