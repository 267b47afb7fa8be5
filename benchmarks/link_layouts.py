"""One link of the HLA chain (mixers/chain) in its two forward layouts, side by side with
fla's chunked linear attention: what ChainPlan.layout "fla" (tiled.py: a state walk per
[BK, BV] tile, an output program per value block and chunk looping over key blocks) gains
over the default chunk layout (increments of every chunk, a scan, an output program per
chunk and value block).

    python benchmarks/link_layouts.py --yaml results/<gpu>-<date>/link-layouts.yaml
        [--head-dims 64,128] [--seq-lens 2048,8192,32768,65536] [--layouts NAME,...]
        [--modes fwd,fwdbwd] [--no-kernels]

e.g. on one H100 or H200, from the repository root, with fla installed:

    PYTHONPATH=. python benchmarks/link_layouts.py --yaml results/h100-<date>/link-layouts.yaml

bf16 q, k, v `[65536 // T, T, 16, D]` (65,536 tokens a call), no decay, no start state,
float32 states, outputs stored in bf16 (as linear_attn's link and fla store them); each
link forward alone (`fwd`: launch.forward, the final state kept) and with the backward
from its chunk start states (`fwdbwd`). Layouts: `chunks` (plan_chain's default), `chunks
bf16` (its products on bfloat16 operands), `fla` (layout "fla" at the plan's TF32 on float32
operands, 16-bit products of the raw tiles), `fla bf16` (layout "fla", every product's
operands in bfloat16: the rounding of fla's own kernels), `fla bf16 narrow` (that, with the
chunk start states stored in bfloat16 as fla stores its states), `fla bf16 narrow
walked-backward` (that, with the backward's state gradients walked, walk.py, as fla's
chunk_bwd_kernel_dh walks them, in place of increments and a scan), at D above 64 also `fla
bf16 narrow 128-blocks 8-warps` (blocks of 128 key and value columns, 8 warps, 3 stages,
forward and backward); `fla chunk_linear_attn` (normalize off) where fla imports. Each is
timed with the harness's method (hla_bench.speed.timing.time_calls: a quarter second of
samples, the L2 cache flushed between them), one after another per shape: median ms, spread
(IQR / median) and the ratio to fla. Unless --no-kernels, one forward of each is then
profiled (torch.profiler, five calls after three untimed ones): the GPU time of each kernel
per call, the link's state and output kernels beside fla's chunk_fwd_kernel_h and
chunk_fwd_kernel_o. Before the timings of a shape, each layout's float32 outputs and final
state are compared with the chunk layout's and its outputs with fla's (`agreement`: max
relative errors; the interpreter tests cannot reach the 16-bit products of the compiled
kernels). The YAML is rewritten after every shape, so a run cut short keeps its rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch
import yaml

from chain_plans import fla_calls, link_calls, measure
from hla_bench.results.bench_files import git_commit
from mixers.chain import forward, plan_chain

TOKENS, HEADS = 65536, 16
PROFILED_CALLS = 5


def layouts(D: int) -> dict:
    base = plan_chain(D, D, torch.bfloat16)
    fla_bf16 = dataclasses.replace(base, layout="fla", precision="bf16")
    table = {"chunks": base,
             "chunks bf16": dataclasses.replace(base, precision="bf16"),
             "fla": dataclasses.replace(base, layout="fla"),
             "fla bf16": fla_bf16,
             "fla bf16 narrow": dataclasses.replace(fla_bf16, narrow_starts=True),
             "fla bf16 narrow walked-backward": dataclasses.replace(
                 fla_bf16, narrow_starts=True, walk_from=1)}
    if D > 64:  # one program's tile covers a head dim of 128, as fla's widest output config
        table["fla bf16 narrow 128-blocks 8-warps"] = dataclasses.replace(
            fla_bf16, narrow_starts=True, block_k=128, block_v=128, warps=8, stages=3)
    return table


def agreement(q, k, v, plans: dict) -> list[dict]:
    """Each plan's float32 outputs and final state against the default chunk layout's (the
    kernels `hla-bench verify` checks), and its outputs against fla's where it imports:
    max relative errors (largest difference over the reference's largest magnitude)."""
    from mixers.errors import relative_error

    want_out, want_S1, _ = forward(q, k, v, None, None, False, plan_chain(
        q.shape[-1], v.shape[-1], torch.bfloat16), torch.float32)
    try:
        from fla.ops.linear_attn import chunk_linear_attn
        fla_out = chunk_linear_attn(q, k, v, scale=1.0, normalize=False)[0].float()
    except ImportError:
        fla_out = None
    rows = []
    for name, plan in plans.items():
        out, S1, _ = forward(q, k, v, None, None, False, plan, torch.float32)
        row = {"layout": name, "out_to_chunks": relative_error(out, want_out),
               "final_state_to_chunks": relative_error(S1, want_S1)}
        if fla_out is not None:
            row["out_to_fla"] = relative_error(out, fla_out)
        rows.append({key: float(f"{value:.3g}") if isinstance(value, float) else value
                     for key, value in row.items()})
    return rows


def kernel_times(fn) -> list[dict]:
    """GPU ms per call of each kernel fn launches (the costliest first)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED_CALLS):
            fn()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
    return [{"name": e.key[:120], "gpu_ms": round(e.self_device_time_total / 1000
                                                   / PROFILED_CALLS, 4),
             "launches": round(e.count / PROFILED_CALLS)}
            for e in events if e.self_device_time_total > 0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--seq-lens", default="2048,8192,32768,65536")
    parser.add_argument("--layouts", help="only these (names as listed, comma-separated)")
    parser.add_argument("--modes", default="fwd,fwdbwd")
    parser.add_argument("--no-kernels", action="store_true", help="skip the profiles")
    parser.add_argument("--yaml", help="also write the rows to this file")
    args = parser.parse_args()
    known = list(layouts(128))
    chosen = args.layouts.split(",") if args.layouts else known
    unknown = set(chosen) - set(known)
    if unknown:
        parser.error(f"unknown layouts {sorted(unknown)}; known: {', '.join(known)}")
    modes = args.modes.split(",")
    if set(modes) - {"fwd", "fwdbwd"}:
        parser.error("--modes takes fwd and fwdbwd")
    if not torch.cuda.is_available():
        print("link_layouts.py needs a CUDA device", file=sys.stderr)
        return 2
    report = {"gpu": torch.cuda.get_device_name(), "torch": str(torch.__version__),
              "commit": git_commit(), "dtype": "bfloat16", "heads": HEADS, "tokens": TOKENS,
              "rows": [], "agreement": [], "kernels": []}
    for D in (int(d) for d in args.head_dims.split(",")):
        for T in (int(t) for t in args.seq_lens.split(",")):
            first = len(report["rows"])
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(TOKENS // T, T, HEADS, D, device="cuda", generator=gen,
                                   dtype=torch.bfloat16).div_(D ** 0.5) for _ in range(3))
            calls = {name: dict(zip(("fwd", "fwdbwd"), link_calls(q, k, v, plan, q.dtype)))
                     for name, plan in layouts(D).items() if name in chosen}
            fla = fla_calls(q, k, v)
            if fla is not None:
                calls = {"fla chunk_linear_attn": dict(zip(("fwd", "fwdbwd"), fla)), **calls}
            for mode in modes:
                reference = None
                for name, fns in calls.items():
                    row = {"layout": name, "D": D, "T": T, "batch": TOKENS // T, "mode": mode}
                    try:
                        row.update(measure(fns[mode]))
                    except Exception as error:  # noqa: BLE001 - one case's failure is recorded
                        row["error"] = f"{type(error).__name__}: {error}"[:300]
                    if name.startswith("fla chunk") and "median_ms" in row:
                        reference = row["median_ms"]
                    elif reference and "median_ms" in row:
                        row["ratio_to_fla"] = round(row["median_ms"] / reference, 3)
                    report["rows"].append(row)
            chosen_plans = {name: plan for name, plan in layouts(D).items() if name in chosen}
            for row in agreement(q, k, v, chosen_plans):
                report["agreement"].append({"D": D, "T": T, **row})
                print(f"   D={D:3d} T={T:6d} {row['layout']:22s} agreement {row}", flush=True)
            if not args.no_kernels:
                for name, fns in calls.items():
                    entry = {"layout": name, "D": D, "T": T, "mode": "fwd"}
                    try:
                        entry["kernels"] = kernel_times(fns["fwd"])
                    except Exception as error:  # noqa: BLE001
                        entry["error"] = f"{type(error).__name__}: {error}"[:300]
                    report["kernels"].append(entry)
                    for kernel in entry.get("kernels", [])[:4]:
                        print(f"   D={D:3d} T={T:6d} {name:22s} {kernel['gpu_ms']:8.4f} ms "
                              f"x{kernel['launches']}  {kernel['name'][:60]}", flush=True)
            for row in report["rows"][first:]:
                print(f"D={D:3d} T={T:6d} {row['mode']:6s} {row['layout']:22s} "
                      f"{row.get('median_ms', float('nan')):8.3f} ms  "
                      f"spread {row.get('spread') or 0:.1%}  x fla {row.get('ratio_to_fla', '-')}"
                      + (f"  {row['error']}" if "error" in row else ""), flush=True)
            if args.yaml:
                with open(args.yaml, "w") as f:
                    yaml.safe_dump(report, f, sort_keys=False, width=200)
    return 0


if __name__ == "__main__":
    sys.exit(main())
