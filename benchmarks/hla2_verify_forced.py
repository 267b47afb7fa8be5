"""hla-bench verify with the chunk-128 paths of the hla2 Triton forward forced at small shapes.

    CUDA_LAUNCH_BLOCKING=1 python benchmarks/hla2_verify_forced.py --from-chunk 16 \\
        --dtype bfloat16 [--yaml out.yaml]

The increments in token halves, the output's late state loads and the out-of-place state scan
run only at chunks of 128 with D = Dv = 128 (mixers.hla.hla2.triton._chunk_128_paths). This
runs `hla-bench verify --device cuda` with them taken from --from-chunk tokens per chunk at
every head dim instead (verify's chunk of 12 runs 16; the halves need 32): on the H200 the
bf16 run faults in the output kernel (results/2026-12-03-h200-triton-tests-v7.yaml), which is
why they stay at head dim 128.
"""

from __future__ import annotations

import argparse
import runpy
import sys

from mixers.hla.hla2 import triton as hla2_triton_module


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--from-chunk", type=int, default=16)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--yaml", help="verify's YAML output")
    args = parser.parse_args()
    hla2_triton_module._chunk_128_paths = lambda C, D, DV: C >= args.from_chunk
    sys.argv = ["hla_bench", "verify", "--device", "cuda", "--dtype", args.dtype,
                *(["--yaml", args.yaml] if args.yaml else [])]
    runpy.run_module("hla_bench", run_name="__main__")


if __name__ == "__main__":
    main()
