"""Where the HLA family's Triton ops spend their time: per kernel, for one call.

    python benchmarks/family_profile.py --batch 4 --seq-len 16384 --yaml profile.yaml

For each op (hla2, ahla2, causal hla3 with impl="triton"; `hla2-chain`, hla2 as the chain of
two linear attentions that impl="triton" takes where its fused kernels do not; `link`, one
link of their chain: linear_attn with impl="triton"; `fla`, fla's chunk_linear_attn where it
imports) and head
dim (64, 128), in each mode (fwd, fwdbwd): bf16 q, k, v `[B, T, 16, D]`, three untimed calls
(compilation, autotuning), then five under torch.profiler. Reports per call the GPU time
(the sum of its kernels' self time), the host's wall time (synchronised), and its ten
costliest kernels with their launches per call. A wall time well above the GPU time means
the host, not the kernels, sets the pace. A profile, not a benchmark: use
`hla-bench run gpu-family` for timings to compare.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import yaml

CALLS = 5
HEADS = 16


def ops():
    from mixers.hla.ahla2 import ahla2
    from mixers.hla.hla2 import hla2
    from mixers.hla.hla3 import hla3
    from mixers.linear_attn import linear_attn

    from mixers.hla.hla2.triton import hla2_chain_unchecked

    def hla2_chain(q, k, v):
        return hla2_chain_unchecked(q, k, v, normalize=False, eps=1e-6, decay=None,
                                    chunk_size=64, initial_state=None, output_final_state=False)

    table = {"hla2": (hla2, {"impl": "triton"}), "hla2-chain": (hla2_chain, {}),
             "ahla2": (ahla2, {"impl": "triton"}),
             "hla3": (hla3, {"variant": "causal", "impl": "triton"}),
             "link": (linear_attn, {"impl": "triton"})}
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except ImportError:
        return table
    table["fla"] = (chunk_linear_attn, {"normalize": False})
    return table


def profile_case(op, options: dict, batch: int, seq_len: int, head_dim: int, rows: int,
                 mode: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    q, k, v = (torch.randn(batch, seq_len, HEADS, head_dim, device="cuda", dtype=torch.bfloat16)
               .div_(head_dim ** 0.5).requires_grad_(mode == "fwdbwd") for _ in range(3))

    def call():
        o, _ = op(q, k, v, **options)
        if mode == "fwdbwd":
            o.sum().backward()

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(CALLS):
        call()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - started) * 1e3 / CALLS
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            call()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) / 1000 / CALLS
    return {"gpu_ms_per_call": round(total, 3), "wall_ms_per_call": round(wall, 3),
            "kernels": [{"gpu_ms": round(e.self_device_time_total / 1000 / CALLS, 3),
                         "launches": round(e.count / CALLS), "name": e.key}
                        for e in events[:rows]]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--ops", default="fla,link,hla2,ahla2,hla3")
    parser.add_argument("--modes", default="fwd,fwdbwd")
    parser.add_argument("--rows", type=int, default=10, help="kernels listed per case")
    parser.add_argument("--yaml", help="also write the profile to this YAML file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    available = ops()
    names = args.ops.split(",")
    if set(names) - set(available):
        parser.error(f"--ops takes {', '.join(available)}, got {args.ops!r}")
    report = {"gpu": torch.cuda.get_device_name(), "torch": str(torch.__version__),
              "dtype": "bfloat16", "heads": HEADS, "cases": []}
    cases = [(d, m, n) for d in (int(d) for d in args.head_dims.split(","))
             for m in args.modes.split(",") for n in names]
    for head_dim, mode, name in cases:
        op, options = available[name]
        case = {"op": name, "mode": mode, "head_dim": head_dim, "batch": args.batch,
                "seq_len": args.seq_len}
        try:
            case.update(profile_case(op, options, args.batch, args.seq_len, head_dim,
                                     args.rows, mode))
        except Exception as error:  # noqa: BLE001 - one case's failure is recorded
            case["error"] = f"{type(error).__name__}: {error}"[:300]
        report["cases"].append(case)
        print(f"== {name} {mode} D={head_dim}: gpu {case.get('gpu_ms_per_call')} ms, wall "
              f"{case.get('wall_ms_per_call', case.get('error'))} ms", flush=True)
        for kernel in case.get("kernels", []):
            print(f"   {kernel['gpu_ms']:8.3f} ms  x{kernel['launches']}  {kernel['name'][:90]}")
        if args.yaml:
            with open(args.yaml, "w") as fh:
                yaml.safe_dump(report, fh, sort_keys=False, width=200)
    return 0


if __name__ == "__main__":
    sys.exit(main())
