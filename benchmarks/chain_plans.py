"""One link of the HLA chain (mixers/chain) under several launch plans, beside fla's
chunked linear attention: which plan the family's ops should take on this GPU.

    python benchmarks/chain_plans.py [--head-dims 64,128] [--seq-lens 256,2048,8192,65536]
                                     [--plans NAME,...] [--yaml out.yaml]

bf16, 16 heads, 65,536 tokens a call (batch = 65536 // T), no decay, no start state. For
each plan (the default of plan_chain, then one change at a time: value blocks of 32, 8
warps, 3 pipeline stages, every product's operands in bfloat16 instead of TF32, chunks of
32, scan programs of 64 entries, the states walked instead of increments + scan, Q K^T
formed once for all value blocks, the backward's dq, dk and dv in one launch, the last two
at 4 and 8 warps) the forward (`forward`) and the forward with its backward (`forward` keeping the chunk states, then `backward`) are timed with the
harness's method (hla_bench.speed.timing.time_calls: a quarter second of samples, the L2
cache flushed between them); fla's `chunk_linear_attn` (normalize off) where it imports.
Prints median ms with the spread (IQR / median) and the ratio to fla.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import yaml

from hla_bench.speed.timing import percentile, spread, time_calls
from mixers.chain import backward, forward, plan_chain

TOKENS, HEADS = 65536, 16


def variants(D: int) -> dict:
    base = plan_chain(D, D, torch.bfloat16)
    return {"default": base,
            "block_v 32": dataclasses.replace(base, block_v=32),
            "8 warps": dataclasses.replace(base, warps=8),
            "3 stages": dataclasses.replace(base, stages=3),
            "bf16 operands": dataclasses.replace(base, precision="bf16"),
            "chunk 32": dataclasses.replace(base, chunk=32),
            "scan blocks of 64": dataclasses.replace(base, scan_block=64),
            "states walked": dataclasses.replace(base, walk_from=1),
            "scores once": dataclasses.replace(base, scores_once=True),
            "scores once at 8 warps": dataclasses.replace(base, scores_once=True, warps=8),
            "fused backward": dataclasses.replace(base, fused_backward=True),
            "fused backward at 8 warps": dataclasses.replace(base, fused_backward=True,
                                                             warps=8)}


def link_calls(q, k, v, plan, out_dtype=None):
    """(forward, forward + backward) of one link, as calls without arguments (outputs in
    `out_dtype`, float32 by default)."""
    B, T, H, D = q.shape
    grad_out = torch.randn(B, T, H, D, device=q.device, dtype=torch.float32)

    def fwd():
        forward(q, k, v, None, None, False, plan, torch.float32, out_dtype=out_dtype)

    def fwdbwd():
        _, _, starts = forward(q, k, v, None, None, False, plan, torch.float32,
                               keep_starts=True, out_dtype=out_dtype)
        dq, dk = (torch.zeros(B, T, H, D, device=q.device) for _ in range(2))
        dv = torch.zeros_like(dq)
        backward(q, k, v, None, False, starts, grad_out, None, dq, dk, dv, plan,
                 want_dS0=False)

    return fwd, fwdbwd


def fla_calls(q, k, v):
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except ImportError:
        return None
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]

    def fwd():
        chunk_linear_attn(*leaves, normalize=False)

    def fwdbwd():
        o, _ = chunk_linear_attn(*leaves, normalize=False)
        o.sum().backward()

    return fwd, fwdbwd


def measure(fn) -> dict:
    times = time_calls(fn, warmup=3, repeats=5, device="cuda", min_time_s=0.25,
                       flush_cache=True)
    return {"median_ms": round(percentile(times, 50), 4), "spread": spread(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seq-lens", default="256,2048,8192,65536")
    parser.add_argument("--plans", help="only these plans (names as printed, comma-separated)")
    parser.add_argument("--yaml", help="also write the rows to this file")
    args = parser.parse_args()
    unknown = set(args.plans.split(",")) - set(variants(64)) if args.plans else set()
    if unknown:
        parser.error(f"unknown plans {sorted(unknown)}; known: {', '.join(variants(64))}")
    if not torch.cuda.is_available():
        sys.exit("chain_plans.py needs a CUDA device")
    rows = []
    for D in (int(d) for d in args.head_dims.split(",")):
        for T in (int(t) for t in args.seq_lens.split(",")):
            first = len(rows)
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(TOKENS // T, T, HEADS, D, device="cuda", generator=gen,
                                   dtype=torch.bfloat16).div_(D ** 0.5) for _ in range(3))
            fla = fla_calls(q, k, v)
            reference = {}
            if fla is not None:
                for mode, fn in zip(("fwd", "fwdbwd"), fla):
                    try:
                        reference[mode] = measure(fn)
                    except Exception as error:  # noqa: BLE001 - e.g. a head dim fla refuses
                        print(f"D={D:3d} T={T:6d} {mode:6s} fla: {type(error).__name__}: "
                              f"{str(error)[:200]}", flush=True)
                        continue
                    rows.append({"plan": "fla chunk_linear_attn", "D": D, "T": T, "mode": mode,
                                 **reference[mode]})
            for name, plan in variants(D).items():
                if args.plans and name not in args.plans.split(","):
                    continue
                for mode, fn in zip(("fwd", "fwdbwd"), link_calls(q, k, v, plan)):
                    row = {"plan": name, "D": D, "T": T, "mode": mode, **measure(fn)}
                    if mode in reference:
                        row["ratio_to_fla"] = round(row["median_ms"]
                                                    / reference[mode]["median_ms"], 3)
                    rows.append(row)
            for row in rows[first:]:
                print(f"D={D:3d} T={T:6d} {row['mode']:6s} {row['plan']:22s} "
                      f"{row['median_ms']:8.3f} ms  spread {row['spread'] or 0:.1%}  "
                      f"x fla {row.get('ratio_to_fla', '-')}", flush=True)
            if args.yaml:  # rewritten after every shape: a run cut short keeps its rows
                with open(args.yaml, "w") as f:
                    yaml.safe_dump({"gpu": torch.cuda.get_device_name(),
                                    "torch": str(torch.__version__), "rows": rows}, f,
                                   sort_keys=False)


if __name__ == "__main__":
    main()
