#!/usr/bin/env bash
# Runs kvroute's cargo-fuzz targets (fuzz/) for a while each and summarises what they did.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]     # default: 600 s for every target
#   scripts/fuzz.sh 60 prom_parser route_api  # one minute for two targets
#
# The toolchain is stable; cargo-fuzz's sanitizer flags are nightly-only, so the build runs
# with RUSTC_BOOTSTRAP=1. The seed corpora in fuzz/corpus/<target> stay small and in git; what
# the fuzzer discovers goes to target/fuzz-corpus/<target> (kept between runs), reports to
# target/fuzz-reports/<target>.log, and crashing inputs to fuzz/artifacts/<target>/ (replay
# one with `RUSTC_BOOTSTRAP=1 cargo fuzz run --fuzz-dir fuzz <target> <file>`).
#
# Environment: FUZZ_JOBS (parallel libFuzzer workers per target, default 1), FUZZ_RSS_MB
# (default 2048).
set -euo pipefail
cd "$(dirname "$0")/.."

secs=${1:-600}
shift || true
if ! [[ $secs =~ ^[0-9]+$ ]] || (( secs == 0 )); then
    echo "usage: $0 [SECONDS>0] [TARGET...]" >&2
    exit 2
fi

export RUSTC_BOOTSTRAP=1
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "installing cargo-fuzz from crates.io" >&2
    cargo install cargo-fuzz --locked
fi

if (( $# > 0 )); then
    targets=("$@")
else
    mapfile -t targets < <(cargo fuzz list --fuzz-dir fuzz)
fi

jobs=${FUZZ_JOBS:-1}
rss=${FUZZ_RSS_MB:-2048}
reports=target/fuzz-reports
mkdir -p "$reports"

echo "building ${#targets[@]} fuzz targets (release, ASan, debug assertions)" >&2
cargo fuzz build --fuzz-dir fuzz -O

failed=()
printf '%-16s %10s %10s %8s %8s %8s  %s\n' target execs exec/s cov ft corpus result
for t in "${targets[@]}"; do
    work=target/fuzz-corpus/$t
    mkdir -p "$work" "fuzz/corpus/$t"
    log=$reports/$t.log
    status=ok
    if ! cargo fuzz run --fuzz-dir fuzz -O "$t" "$work" "fuzz/corpus/$t" -- \
        -max_total_time="$secs" -print_final_stats=1 -rss_limit_mb="$rss" -timeout=10 \
        -jobs="$jobs" -workers="$jobs" >"$log" 2>&1; then
        status="FAILED (see $log, fuzz/artifacts/$t/)"
        failed+=("$t")
    fi
    if (( jobs > 1 )); then
        cat fuzz-*.log >>"$log" 2>/dev/null || true
        rm -f fuzz-*.log
    fi
    # A target that fails on its seed corpus logs no stats line: each figure is then '?', and
    # a grep finding nothing must not end the script (pipefail) before the failure is listed.
    execs=$( (grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" || true) | awk '{s+=$2} END {print s+0}')
    last=$( (grep -E '^#[0-9]+' "$log" || true) | tail -1)
    stat() { (grep -o "$1: [0-9]*" <<<"$last" || true) | awk '{print $2}'; }
    cov=$(stat cov)
    ft=$(stat ft)
    corp=$(stat corp)
    eps=$(stat exec/s)
    printf '%-16s %10s %10s %8s %8s %8s  %s\n' "$t" "$execs" "${eps:-?}" "${cov:-?}" "${ft:-?}" "${corp:-?}" "$status"
done

if (( ${#failed[@]} > 0 )); then
    echo "crashes or failures in: ${failed[*]}" >&2
    exit 1
fi
