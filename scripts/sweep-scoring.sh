#!/usr/bin/env bash
# Sweep kvroute's scoring tunables in fleet-sim over the benchmark workloads and print one line
# per (config, workload): the figures kvroute's defaults were chosen from (see README).
# Usage: scripts/sweep-scoring.sh [fleet-sim binary] > sweep.txt
set -euo pipefail
cd "$(dirname "$0")/.."
SIM=${1:-target/release/fleet-sim}
OUT=target/sweep
mkdir -p "$OUT"
TRACE=${KVROUTE_TRACE:-tests/fleet-sim/traces/mooncake_synthetic_trace.jsonl}
workloads=(
  "shared-prefix:rps=12"
  "shared-prefix:rps=20"
  "multi-turn:conversations=200,turns=6,rps=4|--kv-capacity-tokens 60000"
  "$TRACE|--limit 1500"
)
configs=(
  "{scoring: {prefill_weight: 1.0, decode_weight: 0.0}}"
  "{scoring: {prefill_weight: 2.0, decode_weight: 0.0}}"
  "{scoring: {prefill_weight: 3.0, decode_weight: 0.0}}"
  "{scoring: {prefill_weight: 2.0, decode_weight: 0.25}}"
  "{scoring: {prefill_weight: 2.0, decode_weight: 0.5}}"
  "{scoring: {prefill_weight: 2.0, decode_weight: 1.0}}"
  "{scoring: {prefill_weight: 3.0, decode_weight: 0.5}}"
  "{scoring: {prefill_weight: 2.0, decode_weight: 0.5, guard_abs: 16, guard_rel: 2.0}}"
)
printf '%-72s %-40s %9s %9s %9s %9s %8s\n' config workload ttft_p50 ttft_p99 e2e_p50 tok/s hit
for w in "${workloads[@]}"; do
  spec=${w%%|*}; extra=""; [[ $w == *"|"* ]] && extra=${w#*|}
  for c in "${configs[@]}"; do
    # shellcheck disable=SC2086
    "$SIM" compare --workload "$spec" --replicas 8 --policies kvroute $extra \
      --router-config "$c" --json "$OUT/one.json" >/dev/null 2>&1
    python3 - "$c" "$spec" "$OUT/one.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[3]))["results"][0]
print(f"{sys.argv[1]:<72} {sys.argv[2][-40:]:<40} {r['ttft_ms']['p50']:9.0f} {r['ttft_ms']['p99']:9.0f} "
      f"{r['e2e_ms']['p50']:9.0f} {r['output_tokens_per_s']:9.0f} {r['prefix_hit_rate']:8.3f}")
PY
  done
done
