#!/usr/bin/env python3
"""Eight engines as eight replicas, then as two data-parallel servers of four ranks, in
fleet-sim, the way docs/BENCHMARKS.md reports it (issue #18 point 4).

    cargo build --release -p fleet-sim
    scripts/data-parallel-compare.py [seeds, default 3,4,5,6,7]

Runs `fleet-sim compare --data-parallel-size 1` and `4` on multi-turn and shared-prefix for
each seed (the report split) and prints, per policy, the means over seeds of the hit rate,
TTFT p50 / p99 and end-to-end p50, eight replicas first. Rank-blind routers pick a server and
vLLM's balancer picks the rank (`tests/fleet-sim/src/data_parallel.rs`).
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

POLICIES = "round-robin,least-request,llmd-optimized,sglang-cache-aware,dynamo,kvroute,kvroute-precise"
FLEET_SIM = os.environ.get("FLEET_SIM", "target/release/fleet-sim")


def run(workload, ranks, seed, out):
    subprocess.run(
        [FLEET_SIM, "compare", "--workload", workload, "--replicas", "8",
         "--data-parallel-size", str(ranks), "--seed", str(seed),
         "--policies", POLICIES, "--json", out],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return json.load(open(out))["results"]


def main():
    seeds = [int(s) for s in (sys.argv[1] if len(sys.argv) > 1 else "3,4,5,6,7").split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for workload in ["multi-turn", "shared-prefix"]:
            rows = {}
            for ranks in (1, 4):
                for seed in seeds:
                    out = os.path.join(tmp, f"{workload}-{ranks}-{seed}.json")
                    for r in run(workload, ranks, seed, out):
                        rows.setdefault((r["policy"], ranks), []).append(r)
            print(f"\n{workload}, seeds {','.join(map(str, seeds))}: 8 replicas / 2 servers x 4 ranks")
            print("| policy | hit rate | TTFT p50 ms | TTFT p99 ms | e2e p50 ms |")
            print("|---|---|---|---|---|")
            for policy in POLICIES.split(","):
                def pair(get, fmt):
                    a, b = (statistics.mean(get(r) for r in rows[(policy, n)]) for n in (1, 4))
                    return f"{a:{fmt}} / {b:{fmt}}"
                print(f"| {policy} | {pair(lambda r: r['prefix_hit_rate'], '.3f')} "
                      f"| {pair(lambda r: r['ttft_ms']['p50'], ',.0f')} "
                      f"| {pair(lambda r: r['ttft_ms']['p99'], ',.0f')} "
                      f"| {pair(lambda r: r['e2e_ms']['p50'], ',.0f')} |")


if __name__ == "__main__":
    main()
