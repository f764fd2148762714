#!/usr/bin/env python3
"""Subagent fan-out in fleet-sim, the way docs/BENCHMARKS.md reports it (issue #17 point 4).

    cargo build --release -p fleet-sim
    scripts/fanout-compare.py [seeds, default 3,4,5,6,7] [--router-config JSON]

Runs `fleet-sim compare` on the agentic workload with three subagents per fork (the default),
with eight, and with eight sent within milliseconds of each other (`tool_ms=5`), on 8
llama8b-h100 replicas, for each seed (the report split), and prints per policy the means over
seeds of how its forks were placed (replicas per burst, context prefills per burst, forks on
the parent's replica), the forks' TTFT and end-to-end time, every request's TTFT and
end-to-end time, and the busiest replica's share of requests.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

from fleetsim_cli import seeds_and_router_config

POLICIES = "round-robin,least-request,sglang-cache-aware,llmd-optimized,dynamo,kvroute,kvroute-precise"
FLEET_SIM = os.environ.get("FLEET_SIM", "target/release/fleet-sim")
WORKLOADS = [
    ("Three subagents per burst (the default)", "agentic"),
    ("Eight subagents per burst", "agentic:fanout=8"),
    ("Eight subagents within milliseconds of each other", "agentic:fanout=8,tool_ms=5"),
]


def run(workload, seed, out, router_config):
    cmd = [FLEET_SIM, "compare", "--workload", workload, "--replicas", "8",
           "--seed", str(seed), "--policies", POLICIES, "--json", out]
    if router_config:
        cmd += ["--router-config", router_config]
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    report = json.load(open(out))
    forks = {f["policy"]: f for f in report["forks"]}
    return [(r, forks[r["policy"]]) for r in report["results"]]


def main():
    seeds, router_config = seeds_and_router_config(sys.argv[1:], "3,4,5,6,7")
    with tempfile.TemporaryDirectory() as tmp:
        for title, workload in WORKLOADS:
            rows = {}
            for seed in seeds:
                out = os.path.join(tmp, f"{seed}.json")
                for result, forks in run(workload, seed, out, router_config):
                    rows.setdefault(result["policy"], []).append((result, forks))
            print(f"\n{title} (`{workload}`), seeds {','.join(map(str, seeds))}:\n")
            print("| policy | replicas per burst | context prefills per burst "
                  "| forks on the parent's replica | fork TTFT p50 / p99 ms | fork e2e p50 ms "
                  "| all requests TTFT p50 / p99 | all e2e p50 | busiest replica |")
            print("|---|---|---|---|---|---|---|---|---|")
            for policy in POLICIES.split(","):
                runs = rows[policy]

                def mean(get):
                    return statistics.mean(get(r, f) for r, f in runs)
                print(f"| {policy} | {mean(lambda r, f: f['replicas_per_burst']):.2f} "
                      f"| {mean(lambda r, f: f['context_prefills_per_burst']):.2f} "
                      f"| {100 * mean(lambda r, f: f['stayed']):.0f} % "
                      f"| {mean(lambda r, f: f['ttft_ms']['p50']):,.0f} / "
                      f"{mean(lambda r, f: f['ttft_ms']['p99']):,.0f} "
                      f"| {mean(lambda r, f: f['e2e_ms']['p50']):,.0f} "
                      f"| {mean(lambda r, f: r['ttft_ms']['p50']):,.0f} / "
                      f"{mean(lambda r, f: r['ttft_ms']['p99']):,.0f} "
                      f"| {mean(lambda r, f: r['e2e_ms']['p50']):,.0f} "
                      f"| {100 * mean(lambda r, f: r['busiest_replica_share']):.0f} % |")


if __name__ == "__main__":
    main()
