#!/usr/bin/env bash
# The recall training step of this checkout beside an earlier one's, on one GPU in one call:
# recall_throughput.py's stacked mode (every group of a cell at once, under CUDA MPS) for each
# code, compiled as zoology-fig2 runs it, this checkout's also with the embedding's sorted
# backward; with PROFILE=1, then where this checkout's compiled step goes (profile mode, each
# group alone), both embedding backwards.
#
#   bash benchmarks/recall_speed_compare.sh OUT BASELINE [CELLS [MIXERS]]
#
# BASELINE is a checkout of the earlier code (`git worktree add BASELINE COMMIT`); CELLS as
# recall_throughput.py's --cells (default 256:128: Zoology's 256/16 setting at d_model 128);
# MIXERS a comma-separated list (default every mixer of zoology-fig2).
# Writes OUT/baseline-compiled.yaml (the earlier code), OUT/stacked-compiled.yaml and
# OUT/stacked-compiled-sorted.yaml (this code, `--embedding-backward` dense and sorted) and,
# with PROFILE=1, OUT/profile-compiled.yaml and OUT/profile-compiled-sorted.yaml. Optional
# packages come as wheels in .whl/ (benchmarks/offline_wheels.sh).
set -uo pipefail
out=${1:?usage: recall_speed_compare.sh OUT BASELINE [CELLS]}
baseline=$(cd "${2:?usage: recall_speed_compare.sh OUT BASELINE [CELLS]}" && pwd)
cells=${3:-256:128}
mixers=${4:-sdpa,based,linear-attn,hla2,ahla2,hla3,mamba2-ssd,fla-gla,fla-delta-rule}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 NCCL_NVLS_ENABLE=0
site=""
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    site=":/tmp/site"
fi
nvidia-cuda-mps-control -d 2> /dev/null || true
bench() {  # bench CODE_DIR OUTFILE ARGS...
    local code=$1 file=$2
    shift 2
    (cd "$code" && PYTHONPATH="$code$site" python3 benchmarks/recall_throughput.py \
        --config zoology-fig2 --cells "$cells" --mixers "$mixers" --steps 150 --out "$file" "$@") \
        2>&1 | grep -v -i warning | tail -4 | cut -c1-400
}
# the earlier code names its own commit, whatever HLA_BENCH_GIT_COMMIT says of this one
baseline_commit=$(git -C "$baseline" rev-parse --short HEAD 2> /dev/null || echo unknown)
(cd "$baseline" && HLA_BENCH_GIT_COMMIT=$baseline_commit PYTHONPATH="$baseline$site" \
    python3 benchmarks/recall_throughput.py \
    --config zoology-fig2 --cells "$cells" --mixers "$mixers" --modes stacked --compile \
    --steps 150 --out "$out/baseline-compiled.yaml") 2>&1 | grep -v -i warning | tail -4 | cut -c1-400
bench "$PWD" "$out/stacked-compiled.yaml" --modes stacked --compile --embedding-backward dense
bench "$PWD" "$out/stacked-compiled-sorted.yaml" --modes stacked --compile \
    --embedding-backward sorted
echo quit | nvidia-cuda-mps-control 2> /dev/null || true
if [[ -n ${PROFILE:-} ]]; then
    bench "$PWD" "$out/profile-compiled.yaml" --modes profile --compile \
        --embedding-backward dense
    bench "$PWD" "$out/profile-compiled-sorted.yaml" --modes profile --compile \
        --embedding-backward sorted
fi
PYTHONPATH="$PWD$site" python3 - "$out" <<'EOF'
import sys, yaml
from pathlib import Path
out = Path(sys.argv[1])
for name in ("baseline-compiled", "stacked-compiled", "stacked-compiled-sorted"):
    path = out / f"{name}.yaml"
    if not path.exists():
        print(name, "missing"); continue
    for cell in yaml.safe_load(path.read_text())["cells"]:
        rate = (cell.get("stacked") or {}).get("steps_per_s")
        groups = {g["mixer"]: g.get("steps_per_s") for g in cell.get("groups_stacked", [])}
        print(name, cell["seq_len"], cell["d_model"], "model-steps/s", rate, groups,
              cell.get("error", "")[:200])
for path in (out / "profile-compiled.yaml", out / "profile-compiled-sorted.yaml"):
    if not path.exists():
        continue
    print(path.name)
    for cell in yaml.safe_load(path.read_text())["cells"]:
        for p in cell.get("profiles", []):
            print(p["mixer"], "graph ms", p["graph_ms_per_step"], "matmul ms",
                  p["matmul_ms_at_gemm_rate"], "kernels", p["kernels_per_step"])
            for k in p["kernels"][:6]:
                print("    ", k["gpu_ms_per_step"], k["calls_per_step"], k["name"][:90])
EOF
