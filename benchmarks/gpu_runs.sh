#!/usr/bin/env bash
# The GPU measurements that results/<gpu>-<date>/ hold, in stages that each end within about ten
# minutes and write into OUT as they go, on a host that has torch, Triton, click, rich,
# pyyaml, einops and matplotlib but no package index (the optional packages come as wheels
# from benchmarks/offline_wheels.sh in .whl/).
#
#   bash benchmarks/gpu_runs.sh STAGE[,STAGE...] OUT [PREVIOUS]
#
# The stages run in the order given, within one TIME_LIMIT; with TESTS="PYTEST ARGS" the
# tests they name run first (their log: OUT/tests.log), so no test shares the GPU with a
# measurement. STAGE:
#   kernels       hla-bench verify in bf16, the chain's launch plans (chain_plans.py) at
#                 D 64/128 and, at T 256, D 256/512, hla2's fused kernels against its chain
#                 (family_profile.py), ahla2's and hla3's normalized bf16 precision
#                 (family_native_check.py --normalize-precision), and one link in each
#                 layout beside fla's chunk_linear_attn (link_layouts.py)
#   layers        where a layer's time goes (layer_parts.py): the registry's layers of fla's
#                 linear attention and the HLA ops with each part switched off in turn,
#                 their operators, and the short convolution two ways
#   step-auto     the recall training step's time, each group alone (recall_throughput.py
#                 --modes profile, compiled, under CUDA MPS) at the Zoology cells 256/16 x
#                 d_model 128 and 512, every mixer through impl=auto (the Triton kernels)
#   step-parallel the same with Based, linear attention and the HLA ops through their
#                 parallel forms (impl=parallel)
#   step-mad      the MAD suite's step (recall_throughput.py --config mad, under CUDA MPS) at
#                 in-context recall's baseline and memorization at vocab 8192: every mixer's
#                 groups stacked all at once (aggregate rate), then each alone (profile);
#                 then Based, linear attention and the HLA ops again through their parallel
#                 forms (MAD's config keeps impl=auto: its sequences run up to 1024 tokens)
#   step-mamba    the recall step of the Mamba-2 block, each group alone (profile, compiled,
#                 under CUDA MPS) at the Zoology cells 64/4, 128/8 and 256/16 x d_model 512:
#                 first through mamba_ssm's Triton scan (impl=auto), then through the
#                 PyTorch chunked SSD (impl=chunk, 64-token chunks), which at these lengths
#                 is a few batched matmuls that torch.compile can fuse around
#   bench-a       configs/gpu-mixers.yaml into OUT/mixers-a.yaml; bench-b the same into mixers-b.yaml
#                 (the pair whose `report --compare` is the method's noise floor), and so on
#                 to bench-z
#   step-compare  the recall step of this checkout beside an earlier one's at 256/16, d_model
#                 128 (recall_speed_compare.sh; BASELINE=DIR names the earlier checkout,
#                 MIXERS=a,b the mixers, default the seven that need no fla)
#   recall        configs/zoology-fig2.yaml into OUT/zoology-fig2.yaml, under CUDA MPS
#   frontier      configs/zoology-frontier.yaml into OUT/zoology-frontier.yaml, likewise
#   mad           configs/mad.yaml into OUT/mad.yaml, under CUDA MPS (ONLY_TASKS=a,b: the
#                 settings of those tasks only, recall --only-tasks)
#   mad-budget    configs/mad-budget.yaml into OUT/mad-budget.yaml, likewise
#                 the four sweeps with LARGEST_FIRST=1: the costliest groups first
#                 (recall --largest-first), for parts chained on one machine
# The sweeps (bench-*, recall, mad) resume: with PREVIOUS, a folder holding the file an
# earlier cut-short call left, they continue it (`--resume`) instead of starting over, and
# stop themselves before TIME_LIMIT seconds (default 540, counted from the script's start,
# the install of the wheels included) so the file comes back whole.
# bench-* write their results file in OUT (rewritten whole after every shape, so a command
# killed from outside still leaves every finished shape there). recall and mad run in a
# scratch folder, their results file copied into OUT every 30 s and when they stop: a
# recall sweep's group checkpoints (gigabytes at d_model 512) stay behind, so a group cut
# short starts over in the next call, while every finished run is kept.
# Compiled code outlives the machine: torch.compile's caches (inductor's FX graphs and
# AOTAutograd's, TORCHINDUCTOR_CACHE_DIR) and Triton's kernels and autotuning choices
# (TRITON_CACHE_DIR) live in one folder, unpacked at the start from COMPILE_CACHE (default
# .compile-cache.tar, carried in; PREVIOUS/compile-cache.tar where that is missing) and
# packed into OUT/compile-cache.tar when the stages end, unless it grew past
# COMPILE_CACHE_MB (default 48) megabytes. A later call that carries it back compiles only
# what no earlier call did (a cache entry is keyed by the code, shapes, GPU and versions, so
# a stale one is never used).
set -uo pipefail
usage="usage: gpu_runs.sh STAGE[,STAGE...] OUT [PREVIOUS]"
stages=${1:?$usage}
out=${2:?$usage}
previous=${3:-}
limit=${TIME_LIMIT:-540}
for stage in ${stages//,/ }; do
    case "$stage" in
    kernels|layers|step-auto|step-parallel|step-mad|step-mamba|step-compare|bench-[a-z]) ;;
    recall|frontier|mad|mad-budget) ;;
    *)
        echo "unknown stage $stage (kernels, layers, step-auto, step-parallel, step-mad," \
            "step-mamba, step-compare, bench-a ... bench-z, recall, frontier, mad," \
            "mad-budget)" >&2
        exit 2
        ;;
    esac
done
cd "$(dirname "$0")/.."
mkdir -p "$out"
# Triton's cache keeps compiled kernels and, with TRITON_CACHE_AUTOTUNING, the autotuners'
# choices: a later stage on this machine (bench-b after bench-a) skips both and times the
# same kernel configurations.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TRITON_CACHE_AUTOTUNING=1
compile_cache=$(mktemp -d /tmp/gpu-runs-compile-cache.XXXXXX)
export TORCHINDUCTOR_CACHE_DIR="$compile_cache/inductor" TRITON_CACHE_DIR="$compile_cache/triton"
mkdir -p "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR"
packed=${COMPILE_CACHE:-.compile-cache.tar}
[[ -f "$packed" || -z "$previous" ]] || packed="$previous/compile-cache.tar"
if [[ -f "$packed" ]]; then
    tar -xf "$packed" -C "$compile_cache" &&
        echo "compile cache: $(du -sh "$compile_cache" | cut -f1) from $packed"
fi
pack_compile_cache() {
    local size
    size=$(du -sm "$compile_cache" | cut -f1)
    if ((size <= ${COMPILE_CACHE_MB:-48})); then
        tar -cf "$out/compile-cache.tar" -C "$compile_cache" . &&
            echo "compile cache: ${size} MB into $out/compile-cache.tar"
    else
        echo "compile cache: ${size} MB, over COMPILE_CACHE_MB=${COMPILE_CACHE_MB:-48}: not packed"
    fi
    rm -rf "$compile_cache"
}
trap pack_compile_cache EXIT
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="$PWD:/tmp/site"
else
    export PYTHONPATH="$PWD"
fi
hla() { python3 -m hla_bench "$@"; }
mps() { nvidia-cuda-mps-control -d 2> /dev/null || true; }
if [[ -n ${TESTS:-} ]]; then
    # shellcheck disable=SC2086  # TESTS is a list of pytest arguments
    python3 -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tee "$out/tests.log"
fi

scratch=/tmp/gpu-runs
mkdir -p "$scratch"
resumed() {  # resumed NAME DIR: --resume when PREVIOUS holds NAME (copied into DIR first)
    if [[ -n "$previous" && -f "$previous/$1" ]]; then
        [[ "$previous/$1" -ef "$2/$1" ]] || cp "$previous/$1" "$2/$1"
        echo --resume
    fi
}

for stage in ${stages//,/ }; do
    log="$out/$stage.log"
    case "$stage" in
    kernels)
        {
            hla verify --device cuda --dtype bfloat16 --yaml "$out/verify-bf16.yaml"
            python3 benchmarks/chain_plans.py --head-dims 64,128 --seq-lens 256,2048,8192,65536 \
                --yaml "$out/chain-plans.yaml"
            python3 benchmarks/chain_plans.py --head-dims 256,512 --seq-lens 256 \
                --yaml "$out/chain-plans-wide.yaml"
            python3 benchmarks/family_profile.py --ops hla2,hla2-chain --head-dims 64,128 \
                --batch 32 --seq-len 2048 --yaml "$out/hla2-chain-profile.yaml"
            python3 benchmarks/family_native_check.py --normalize-precision \
                --yaml "$out/family-normalize-bf16.yaml"
            python3 benchmarks/link_layouts.py --yaml "$out/link-layouts.yaml"
        } 2>&1 | tee "$log"
        ;;
    layers)
        python3 benchmarks/layer_parts.py --seq-lens 2048,65536 --yaml "$out/layer-parts.yaml" \
            2>&1 | tee "$log"
        ;;
    step-auto|step-parallel)
        mps
        mixers=based,linear-attn,hla2,ahla2,hla3
        options=()
        if [[ $stage == step-parallel ]]; then
            for mixer in ${mixers//,/ }; do options+=(--option "$mixer.impl=parallel"); done
        else
            mixers=sdpa,$mixers
        fi
        python3 benchmarks/recall_throughput.py --config zoology-fig2 --cells 256:128,256:512 \
            --mixers "$mixers" --modes profile --compile "${options[@]}" \
            --out "$out/recall-$stage.yaml" 2>&1 | tee "$log"
        ;;
    step-mad)
        mps
        cells="in_context_recall:128,memorization vocab_size=8192:128"
        python3 benchmarks/recall_throughput.py --config mad --num-train 12800 --cells "$cells" \
            --mixers sdpa,based,linear-attn,hla2,ahla2,hla3,mamba2-ssd,fla-gla,fla-delta-rule \
            --modes stacked,profile --out "$out/recall-step-mad-auto.yaml" 2>&1 | tee "$log"
        options=()
        for mixer in based linear-attn hla2 ahla2 hla3; do options+=(--option "$mixer.impl=parallel"); done
        python3 benchmarks/recall_throughput.py --config mad --num-train 12800 --cells "$cells" \
            --mixers based,linear-attn,hla2,ahla2,hla3 "${options[@]}" \
            --modes stacked,profile --out "$out/recall-step-mad-parallel.yaml" 2>&1 | tee -a "$log"
        ;;
    step-mamba)
        mps
        for impl in auto chunk; do
            python3 benchmarks/recall_throughput.py --config zoology-fig2 --cells 64:512,128:512,256:512 \
                --mixers mamba2-ssd --modes profile --compile --option "mamba2-ssd.impl=$impl" \
                --out "$out/recall-step-mamba-$impl.yaml" 2>&1 | tee -a "$log"
        done
        ;;
    step-compare)
        if [[ -z ${BASELINE:-} || ! -d $BASELINE ]]; then
            echo "step-compare skipped: BASELINE names no checkout" | tee "$log"
            continue
        fi
        bash benchmarks/recall_speed_compare.sh "$out/compare" "$BASELINE" 256:128 \
            "${MIXERS:-sdpa,based,linear-attn,hla2,ahla2,hla3,mamba2-ssd}" 2>&1 | tee "$log"
        ;;
    bench-[a-z])
        name="mixers-${stage#bench-}.yaml"
        timeout "$((limit - SECONDS))" python3 -m hla_bench run gpu-mixers --out "$out/$name" \
            $(resumed "$name" "$out") 2>&1 | tee "$log"
        ;;
    recall|frontier|mad|mad-budget)
        # the sweep kills workers 45 s after its limit (training.STOP_GRACE_S), then writes
        left=$((limit - SECONDS - 60))
        if ((left < 60)); then
            echo "$stage skipped: ${left} s left of TIME_LIMIT after the stages before it" |
                tee "$log"
            continue
        fi
        mps
        case "$stage" in
        recall) config=zoology-fig2 ;;
        frontier) config=zoology-frontier ;;
        mad) config=mad ;;
        mad-budget) config=mad-budget ;;
        esac
        name="$config.yaml"
        args=(--config "$config" --out "$scratch/$name" --time-limit "$left"
              $(resumed "$name" "$scratch"))
        [[ -n ${ONLY_TASKS:-} ]] && args+=(--only-tasks "$ONLY_TASKS")
        [[ -n ${LARGEST_FIRST:-} ]] && args+=(--largest-first)
        (while sleep 30; do [[ -f "$scratch/$name" ]] && cp "$scratch/$name" "$out/$name.part" &&
            mv "$out/$name.part" "$out/$name"; done) &
        copier=$!
        hla recall "${args[@]}" 2>&1 | tee "$log"
        kill "$copier" 2> /dev/null
        cp "$scratch/$name" "$out/"
        ;;
    esac
done
