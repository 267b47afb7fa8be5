"""Where a timed call's time goes: GPU work, and the GPU waiting for the host (CUDA only).

    python benchmarks/call_overhead.py out.yaml [--mixers hla2-triton,fla-linear-attn]
                                       [--shapes 64:2k,128:32k] [--modes fwd,fwdbwd]

Each mixer is built through the registry and called exactly as `hla-bench run` calls it
(bf16, H = 16, 65,536 tokens per batch, D = 64 and 128, T = 2k and 32k, fwd and fwd+bwd):
  synced_ms     the harness's figure: CUDA events around one call, synchronised after it
                (hla_bench.speed.timing.time_calls), median of 30;
  pipelined_ms  CUDA events around 30 calls back to back, per call: the GPU's time once the
                host runs ahead of it;
  host_ms       wall time until the call returns (median of 30, after a synchronise): the
                host's cost of the call (launches are asynchronous).
synced - pipelined is the time the GPU waits for the host within one synchronised call:
mostly the host's path up to the first kernel launch. --host-profile adds the top functions
of a cProfile of 200 calls (by own time) to each row.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch
import yaml

from hla_bench.results.bench_files import git_commit
from hla_bench.options import MixerSpec
from hla_bench.speed.sweeps import SweepConfig, parse_seq_len
from hla_bench.speed.runner import Point, build_call, prepare
from hla_bench.speed.timing import percentile, time_calls

MIXERS = {"hla2-triton": "hla2:impl=triton:label=hla2-triton",
          "fla-linear-attn": "fla-linear-attn"}
SHAPES = "64:2k,64:32k,128:2k,128:32k"  # head dim:T
CALLS = 30


def pipelined_ms(call, calls=CALLS):
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def host_ms(call, calls=CALLS):
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        call()
        times.append((time.perf_counter() - begin) * 1e3)
    torch.cuda.synchronize()
    return percentile(times, 50)


def host_profile(call, calls=200, top=25):
    """The top functions of a cProfile of `calls` calls, by own time (a synchronise after
    each call, outside the profile)."""
    profiler = cProfile.Profile()
    for _ in range(calls):
        torch.cuda.synchronize()
        profiler.enable()
        call()
        profiler.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("output")
    parser.add_argument("--mixers", default=",".join(MIXERS),
                        help="labels of MIXERS or mixer specs")
    parser.add_argument("--shapes", default=SHAPES, help="head dim:T pairs")
    parser.add_argument("--modes", default="fwd,fwdbwd")
    parser.add_argument("--host-profile", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("call_overhead.py needs a CUDA device")
    shapes = [(int(d), parse_seq_len(t)) for d, t in
              (pair.split(":") for pair in args.shapes.split(","))]
    rows = {}
    out = {"kind": "notes", "what": __doc__.strip(), "git_commit": git_commit(),
           "command": " ".join(sys.argv[1:]), "gpu": torch.cuda.get_device_name(),
           "torch": str(torch.__version__), "rows": rows}
    for label in args.mixers.split(","):
        spec = MixerSpec.parse(MIXERS.get(label, label))
        for D, T in shapes:
            sweep = SweepConfig(mixers=[spec], seq_lens=[T], modes=args.modes.split(","), heads=16,
                                head_dim=D, tokens_per_batch=65536, dtype="bf16",
                                device="cuda", warmup=3, repeats=CALLS)
            for mode in sweep.modes:
                key = f"{spec.label} D={D} T={T} {mode}"
                try:
                    point = Point(sweep, spec, mode, T, sweep.graph_timed(mode))
                    record, prepared = prepare(point, None)
                    if prepared is None:
                        rows[key] = {"status": record["status"], "reason": record["reason"]}
                        continue
                    call, _, _ = build_call(point, *prepared, record)
                    synced = percentile(time_calls(call, warmup=0, repeats=CALLS,
                                                   device="cuda"), 50)
                    row = {"synced_ms": round(synced, 4),
                           "pipelined_ms": round(pipelined_ms(call), 4),
                           "host_ms": round(host_ms(call), 4)}
                    row["gpu_waits_ms"] = round(row["synced_ms"] - row["pipelined_ms"], 4)
                    if args.host_profile:
                        row["host_profile"] = host_profile(call)
                except Exception as error:  # noqa: BLE001 - report and go on
                    row = {"error": f"{type(error).__name__}: {error}"[:300]}
                rows[key] = row
                print(key, {k: v for k, v in row.items() if k != "host_profile"}, flush=True)
                with open(args.output, "w") as f:  # after every row: a crash keeps the rest
                    yaml.safe_dump(out, f, sort_keys=False, width=100)
                torch.cuda.empty_cache()
    print("wrote", args.output)


if __name__ == "__main__":
    main()
