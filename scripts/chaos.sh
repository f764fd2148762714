#!/usr/bin/env bash
# A longer chaos run through a real Envoy: random control-plane faults (slow, hung, garbage,
# resets, 503s, killed and restarted) and replica faults (garbage metrics, slow completions)
# under continuous load. Passes when no request is lost and the wasm filter never traps.
#
#   scripts/chaos.sh [SECONDS] [--all]    # default 600 s; --all also runs every fault test
#
# KVROUTE_CHAOS_SEED picks the fault sequence (default: random, printed). Needs Envoy
# (`make setup`) and builds the release wasm on first use. Logs: target/e2e-logs/faults-*.
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${1:-600}
if ! [[ $secs =~ ^[0-9]+$ ]] || (( secs == 0 )); then
    echo "usage: $0 [SECONDS>0] [--all]" >&2
    exit 2
fi
seed=${KVROUTE_CHAOS_SEED:-$RANDOM}
echo "chaos: ${secs} s, seed ${seed}" >&2

make --no-print-directory setup wasm >/dev/null
if [[ ${2:-} == --all ]]; then
    cargo test -p kvroute-e2e -- faults:: --test-threads 1
fi
KVROUTE_CHAOS_SECS=$secs KVROUTE_CHAOS_SEED=$seed \
    cargo test -p kvroute-e2e -- faults::chaos_mixed_faults --nocapture --test-threads 1
