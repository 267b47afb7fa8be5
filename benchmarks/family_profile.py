"""Where the HLA family's Triton ops spend GPU time: per kernel, for one forward + backward.

    python benchmarks/family_profile.py --batch 4 --seq-len 16384 --yaml profile.yaml

For each op (hla2, ahla2, causal hla3; impl="triton") and head dim (64, 128): bf16 q, k, v
`[B, T, 16, D]`, three untimed forward + backward calls (compilation, autotuning), then five
under torch.profiler; reports each op's GPU time per forward + backward (the sum of its
kernels' self time) and its ten costliest kernels with their launches per call. A profile,
not a benchmark: use `hla-bench run h200-family` for timings to compare.
"""

from __future__ import annotations

import argparse
import sys

import torch
import yaml

CALLS = 5
HEADS = 16


def ops():
    from mixers.hla.ahla2 import ahla2
    from mixers.hla.hla2 import hla2
    from mixers.hla.hla3 import hla3

    return {"hla2": (hla2, {}), "ahla2": (ahla2, {}), "hla3": (hla3, {"variant": "causal"})}


def profile_case(op, options: dict, batch: int, seq_len: int, head_dim: int, rows: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    q, k, v = (torch.randn(batch, seq_len, HEADS, head_dim, device="cuda", dtype=torch.bfloat16)
               .div_(head_dim ** 0.5).requires_grad_() for _ in range(3))

    def call():
        o, _ = op(q, k, v, impl="triton", **options)
        o.sum().backward()

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            call()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) / 1000 / CALLS
    return {"gpu_ms_per_fwd_bwd": round(total, 3),
            "kernels": [{"gpu_ms": round(e.self_device_time_total / 1000 / CALLS, 3),
                         "launches": round(e.count / CALLS), "name": e.key}
                        for e in events[:rows]]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=16384)
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--ops", default="hla2,ahla2,hla3")
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
    for head_dim in (int(d) for d in args.head_dims.split(",")):
        for name in names:
            op, options = available[name]
            case = {"op": name, "head_dim": head_dim, "batch": args.batch, "seq_len": args.seq_len}
            try:
                case.update(profile_case(op, options, args.batch, args.seq_len, head_dim, args.rows))
            except Exception as error:  # noqa: BLE001 - one case's failure is recorded
                case["error"] = f"{type(error).__name__}: {error}"[:300]
            report["cases"].append(case)
            print(f"== {name} D={head_dim}: {case.get('gpu_ms_per_fwd_bwd', case.get('error'))}",
                  flush=True)
            for kernel in case.get("kernels", []):
                print(f"   {kernel['gpu_ms']:8.3f} ms  x{kernel['launches']}  {kernel['name'][:90]}")
            if args.yaml:
                with open(args.yaml, "w") as fh:
                    yaml.safe_dump(report, fh, sort_keys=False, width=200)
    return 0


if __name__ == "__main__":
    sys.exit(main())
