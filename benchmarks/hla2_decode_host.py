"""Host time of one eager hla2 decode step, piece by piece (a decode step launched from Python
is host-bound: its GPU work is a few microseconds).

    python benchmarks/hla2_decode_host.py out.yaml [--steps 1000] [--runs 7] [--batch 16 --heads 16]
    TRITON_INTERPRET=1 python benchmarks/hla2_decode_host.py out.yaml --steps 3 --runs 2 \
        --batch 1 --heads 1                                                      # CPU smoke

Microseconds per step over `runs` runs of `steps` steps each (synchronized at the end of each
run) for: the public step (hla2_step, impl="triton"), the Triton step without hla2_step's checks,
the kernel launch alone through Triton's JIT dispatcher and through the compiled kernel's handle
(an internal Triton API: recorded as an error where it differs), one output allocation and the
support check; then cProfile's top entries for the public step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch
import yaml

from hla_bench.results.bench_files import git_commit
from mixers.hla.hla2 import hla2_step
from mixers.hla.hla2.triton import _step_unchecked, decode, triton_unsupported_reason

D = 64


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("output", help="YAML file for the results")
    parser.add_argument("--steps", type=int, default=1000, help="steps per timed run")
    parser.add_argument("--runs", type=int, default=7, help="timed runs per case")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args()
    B, H = args.batch, args.heads
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("needs a CUDA device, or TRITON_INTERPRET=1 for a CPU smoke run")
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    q, k, v = (torch.randn(B, H, D, device=device, dtype=dtype) for _ in range(3))
    _, state = hla2_step(q, k, v, None, impl="triton")
    s, a = state["S"], state["A"]
    o = torch.empty(B, H, D, device=device, dtype=dtype)
    launch = dict(H=H, D=D, DV=D, BR=16, HAS_DECAY=False, NORMALIZE=False, SHARED_KV=False,
                  num_warps=4)
    kernel = decode.decode_step_kernel
    compiled = kernel[(B * H,)](q, k, v, s, a, a, a, o, 1e-6, **launch)
    cases = {
        "hla2_step impl=triton": lambda: hla2_step(q, k, v, state, impl="triton"),
        "step without hla2_step's checks": lambda: _step_unchecked(
            q, k, v, state, normalize=False, eps=1e-6, decay=None, decay_form="masked"),
        "jit launch only": lambda: kernel[(B * H,)](q, k, v, s, a, a, a, o, 1e-6, **launch),
        "compiled-handle launch only": lambda: compiled[(B * H, 1, 1)](
            q, k, v, s, a, a, a, o, 1e-6, H, D, D, 16, False, False, False),
        "one output allocation": lambda: q.new_empty(B, H, D),
        "support check": lambda: triton_unsupported_reason(
            q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), masked=True, ridge=0.0,
            decay_form="masked", decay=None),
    }
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "git_commit": git_commit(), "batch": B, "heads": H, "head_dim": D,
               "steps_per_run": args.steps, "us_per_step": {}, "errors": {}}
    for name, fn in cases.items():
        try:
            for _ in range(min(200, args.steps)):
                fn()
            runs = []
            for _ in range(args.runs):
                if device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(args.steps):
                    fn()
                if device == "cuda":
                    torch.cuda.synchronize()
                runs.append(round((time.perf_counter() - start) / args.steps * 1e6, 2))
            results["us_per_step"][name] = runs
            print(f"{name:34s} us per step: {runs}")
        except Exception as exc:  # noqa: BLE001 - an internal API may differ: record it
            results["errors"][name] = repr(exc)[:300]
            print(f"{name}: FAILED {exc!r}"[:300])
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        hla2_step(q, k, v, state, impl="triton")
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(20)
    results["cprofile_top"] = text.getvalue()
    with open(args.output, "w") as f:
        yaml.safe_dump(results, f, sort_keys=False)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
