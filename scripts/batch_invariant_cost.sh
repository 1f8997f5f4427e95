#!/usr/bin/env bash
# What batch-invariant mode costs offline: `pagedllm bench throughput` with and without
# --batch-invariant, alternated REPEATS times on one model; prints each run's tokens/s and
# the medians. Usage: scripts/batch_invariant_cost.sh MODEL_DIR [REPEATS] [extra bench flags]
set -euo pipefail
model=$1; repeats=${2:-3}; shift $(( $# >= 2 ? 2 : 1 ))
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for i in $(seq "$repeats"); do
  for mode in default invariant; do
    flag=$([ "$mode" = invariant ] && echo --batch-invariant || echo --no-batch-invariant)
    pagedllm bench throughput --model "$model" "$flag" --output-json "$out/$mode-$i.json" \
      "$@" > /dev/null 2>&1
  done
done
python3 - "$out" "$repeats" <<'PY'
import json, statistics, sys
out, n = sys.argv[1], int(sys.argv[2])
med = {}
for mode in ("default", "invariant"):
    runs = [json.load(open(f"{out}/{mode}-{i}.json"))["tokens_per_second"] for i in range(1, n + 1)]
    med[mode] = statistics.median(runs)
    print(f"{mode:10s} tokens/s: " + ", ".join(f"{r:.1f}" for r in runs) + f"  median {med[mode]:.1f}")
print(f"invariant / default: {med['invariant'] / med['default']:.3f}")
PY
