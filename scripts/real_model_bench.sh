#!/usr/bin/env bash
# The demo model (SmolLM2-135M-Instruct) against transformers and llama.cpp, engines alternated
# within each round; then n-gram speculative decoding on summarisation prompts.
#
#   scripts/real_model_bench.sh OUT_DIR LLAMACPP_WORKDIR [ROUNDS]
#
# LLAMACPP_WORKDIR: built by ../shared/tools/llamacpp-anchor.sh build (skipped if absent).
# One OpenMP thread per engine (llama.cpp -t 1): the benchmark machine is shared.
set -u
cd "$(dirname "$0")/.."
out=${1:?OUT_DIR}; bin=${2:?LLAMACPP_WORKDIR}/build/bin; rounds=${3:-2}
mkdir -p "$out"
export OMP_NUM_THREADS=1
M=.demo-model/SmolLM2-135M-Instruct
G=.demo-model/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
P=.venv/bin/pagedllm
COMMON="--dtype float32 --max-model-len 2048 --kv-cache-memory 1073741824"
make -s demo-model
for round in $(seq "$rounds"); do
  echo "=== round $round $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
  # batch-1 decode: 32 in, 64 out
  $P bench latency --model $M $COMMON --batch-size 1 --input-len 32 --output-len 64 \
      --num-iters-warmup 1 --num-iters 3 --output-json "$out/lat-pagedllm-$round.json" \
      > "$out/lat-pagedllm-$round.log" 2>&1
  $P bench throughput --model $M $COMMON --backend hf --hf-max-batch-size 1 --dataset-name random \
      --input-len 32 --output-len 64 --random-range-ratio 0 --num-prompts 2 \
      --output-json "$out/lat-hf-$round.json" > "$out/lat-hf-$round.log" 2>&1
  if [ -x "$bin/llama-bench" ]; then
    "$bin/llama-bench" -m $G -t 1 -p 0 -n 64 -r 2 -o json > "$out/lat-llamacpp-$round.json" 2>/dev/null
  fi
  # 16 sequences, 128 in / 64 out
  $P bench throughput --model $M $COMMON --dataset-name random --input-len 128 --output-len 64 \
      --random-range-ratio 0 --num-prompts 16 --output-json "$out/tp-pagedllm-$round.json" \
      > "$out/tp-pagedllm-$round.log" 2>&1
  $P bench throughput --model $M $COMMON --backend hf --hf-max-batch-size 16 --dataset-name random \
      --input-len 128 --output-len 64 --random-range-ratio 0 --num-prompts 16 \
      --output-json "$out/tp-hf-$round.json" > "$out/tp-hf-$round.log" 2>&1
  if [ -x "$bin/llama-batched-bench" ]; then
    "$bin/llama-batched-bench" -m $G -t 1 -c 4096 -npp 128 -ntg 64 -npl 16 --output-format jsonl \
        > "$out/tp-llamacpp-$round.jsonl" 2>/dev/null
  fi
  grep -h "Throughput\|^Avg latency" "$out"/*-"$round".log
done
echo "=== spec $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
.venv/bin/python -m pagedllm.spec_decode.bench --model $M --prompts summarize --batch-sizes 1 8 \
    --methods none ngram none ngram --max-tokens 96 --prompt-tokens 96 --runs 2 --dtype float32 \
    --output-json "$out/spec.json" 2>&1 | grep "^batch"
echo "=== done $(date -u +%T) load: $(cut -d' ' -f1-3 /proc/loadavg)"
