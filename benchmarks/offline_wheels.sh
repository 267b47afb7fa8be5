#!/usr/bin/env bash
# Wheels of hla-bench's optional packages for a GPU host that cannot reach a package index:
# flash-linear-attention (fla-core and flash-linear-attention), mamba-ssm built as pure Python
# (its Triton SSD kernel, no CUDA extension), dask[distributed] with its dependencies, and
# pytest with its own (the CUDA tests run only there: gpu_runs.sh's TESTS).
#
#   bash benchmarks/offline_wheels.sh [DEST] [PYTHON_VERSION]      # defaults: .whl 3.12
#
# Run it where pip reaches an index and torch, setuptools and wheel are installed (mamba-ssm's
# build runs without isolation and imports all three).
# On the host, install them beside its own torch and Triton:
#
#   python3 -m pip install --no-index --no-deps --target /tmp/site DEST/*.whl
#   export PYTHONPATH=/tmp/site
#
# The host's own torch and Triton are never replaced: fla and mamba-ssm come without their
# dependencies (torch, triton, einops, transformers are expected there), dask and pytest
# with all of theirs.
set -euo pipefail
for module in torch setuptools wheel; do
    python3 -c "import $module" 2> /dev/null || {
        echo "offline_wheels.sh: mamba-ssm's build needs $module in this python3" \
            "(pip install $module)" >&2
        exit 2
    }
done
dest=${1:-.whl}
python_version=${2:-3.12}
mkdir -p "$dest"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)
download() {
    python3 -m pip download -q --only-binary=:all: --python-version "$python_version" \
        --implementation cp "${platforms[@]}" -d "$dest" "$@"
}
download --no-deps fla-core flash-linear-attention
download "dask[distributed]>=2024.1"
download "pytest>=8"
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
    python3 -m pip wheel -q --no-deps --no-build-isolation -w "$dest" mamba-ssm
ls "$dest"
