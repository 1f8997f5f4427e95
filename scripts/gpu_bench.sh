#!/usr/bin/env bash
# The GPU checks and benchmarks of pagedllm (BENCHMARKS.md, "GPU"), run as is by a session
# that is lent a GPU machine. Three steps:
#
#   scripts/gpu_bench.sh wheels        # where pip reaches PyPI: the wheels the GPU machine
#                                      # lacks (python 3.12) into .whl/ (git-ignored)
#   scripts/gpu_bench.sh tests  [OUT]  # on the GPU machine: pytest -m gpu
#   scripts/gpu_bench.sh bench  [OUT]  # on the GPU machine: the CPU figures' workloads on a
#                                      # random ~1B Llama, pagedllm (CUDA graphs, eager, and
#                                      # torch.compile) and vLLM when it is importable
#
# On the GPU machine pagedllm runs from this checkout (PYTHONPATH) on the machine's own torch
# and triton; nothing is installed but the carried wheels. Results (logs, JSON) go to OUT
# (default $OUT, else ./gpu-bench-out). `bench` alternates the engines, RUNS (3) times each;
# WORKLOADS (mixed 64x128 batch1) and ENGINES (pagedllm pagedllm-eager pagedllm-compiled
# vllm) pick a part, to fit a call's time limit.
set -euo pipefail
cd "$(dirname "$0")/.."
step="${1:-}"
out="${2:-${OUT:-gpu-bench-out}}"
model="${MODEL_DIR:-/tmp/bench/llama-1b}"
runs="${RUNS:-3}"

if [[ "$step" == wheels ]]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl msgspec pyzmq
    exit 0
fi

mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
else
    export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
pagedllm() { python3 -m pagedllm.entrypoints.cli.main "$@"; }

case "$step" in
tests)
    nvidia-smi > "$out/nvidia-smi.txt" || true
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    # Only the folders holding gpu-marked tests: the others import server-only packages.
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/attention tests/ops tests/worker \
        2>&1 | tee "$out/pytest-gpu.log"
    ;;
bench)
    [[ -f "$model/config.json" ]] ||
        pagedllm make-demo-model "$model" --preset llama-1b --dtype bfloat16
    engines=(pagedllm pagedllm-eager pagedllm-compiled)
    python3 -c "import vllm" 2>/dev/null && engines+=(vllm) ||
        echo "vllm is not importable here: no vLLM figures" | tee "$out/vllm-missing.txt"
    bench() {  # bench ENGINE KIND NAME ARGS...
        local engine=$1 kind=$2 name=$3
        shift 3
        local json="$out/$name-$engine-$run.json" extra=()
        case "$engine" in
        pagedllm-eager) extra=(--enforce-eager) ;;
        pagedllm-compiled) extra=(--compilation-config '{"level": 3}') ;;
        esac
        local cmd=(pagedllm bench "$kind")
        [[ "$engine" == vllm ]] && cmd=(python3 -m vllm.entrypoints.cli.main bench "$kind")
        if "${cmd[@]}" --model "$model" "$@" "${extra[@]}" --output-json "$json" \
            > "$out/$name-$engine-$run.log" 2>&1; then
            echo "$name $engine run $run: $(tr -d '\n' < "$json" | tail -c 300)"
        else
            echo "$name $engine run $run FAILED: see $name-$engine-$run.log"
        fi
    }
    for run in $(seq 1 "$runs"); do
        for workload in ${WORKLOADS:-mixed 64x128 batch1}; do
            for engine in ${ENGINES:-${engines[*]}}; do
                case "$workload" in
                mixed)  # offline throughput: 256 prompts, 32-512 in, 16-256 out
                    bench "$engine" throughput mixed --dataset-name random --input-len 272 \
                        --output-len 136 --random-range-ratio 0.8823529411764706 \
                        --num-prompts 256 ;;
                64x128)  # 64 sequences of 128 in / 128 out
                    bench "$engine" throughput 64x128 --dataset-name random --input-len 128 \
                        --output-len 128 --random-range-ratio 0 --num-prompts 64 ;;
                batch1)  # batch-1 decode: time per output token
                    bench "$engine" latency batch1 --batch-size 1 --input-len 32 \
                        --output-len 128 --num-iters-warmup 2 --num-iters 5 ;;
                esac
            done
        done
    done 2>&1 | tee -a "$out/bench.log"
    ;;
*)
    echo "usage: $0 wheels | tests [OUT] | bench [OUT]" >&2
    exit 2
    ;;
esac
