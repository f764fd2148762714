#!/usr/bin/env bash
# Soak: the demo topology (4 simulated vLLM replicas, the control plane, a real Envoy with the
# filter) under mixed load at 80% of its measured capacity for MINUTES (default 30). Samples
# every 30 s: requests served/failed, the control plane's RSS and index size, Envoy's RSS, heap
# and V8 (wasm) memory. Writes target/soak/samples.csv and target/soak/summary.json, prints
# first/last/max and the slope of every series, and fails when any request failed.
#
#   scripts/soak.sh [MINUTES] [kvroute-soak options...]     # make soak SOAK_MINUTES=30
#
# The binaries are copied to target/soak/bin first, so rebuilding the workspace during a long
# soak does not touch the running programs. Logs: target/e2e-logs/soak-*.
set -euo pipefail
cd "$(dirname "$0")/.."

minutes=${1:-30}
if ! [[ $minutes =~ ^[0-9]+([.][0-9]+)?$ ]]; then
    echo "usage: $0 [MINUTES] [kvroute-soak options...]" >&2
    exit 2
fi
shift || true
target=${CARGO_TARGET_DIR:-target}

make --no-print-directory setup wasm >/dev/null
cargo build --release -q -p control-plane -p vllm-sim -p kvroute-bench \
    --bin kvroute-control-plane --bin vllm-sim --bin kvroute-soak

bin="$target/soak/bin"
mkdir -p "$bin"
bin=$(cd "$bin" && pwd) # absolute, whether CARGO_TARGET_DIR is relative or not
for b in kvroute-control-plane vllm-sim kvroute-soak; do
    cp -f "$target/release/$b" "$bin/$b"
done
cp -f "$target/wasm32-unknown-unknown/release/kvroute_filter.wasm" "$bin/kvroute_filter.wasm"

export KVROUTE_CONTROL_PLANE="$bin/kvroute-control-plane"
export KVROUTE_VLLM_SIM="$bin/vllm-sim"
export KVROUTE_WASM="$bin/kvroute_filter.wasm"
exec "$bin/kvroute-soak" --minutes "$minutes" --out-dir "$target/soak" "$@"
