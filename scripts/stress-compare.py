#!/usr/bin/env python3
"""kvroute's defaults on fleets none of them was chosen on: the synthetic stress profiles.

    cargo build --release -p fleet-sim
    scripts/stress-compare.py [seeds, default 11,12,13,14,15] [--router-config JSON]

Runs `fleet-sim compare` for every profile in `tests/fleet-sim/stress/` on 8 replicas, on
multi-turn, shared-prefix, long-doc, agentic and the shipped Mooncake trace (its first 600
requests), at two loads: the workload's own arrival rate scaled by the profile's prefill rate
against llama8b-h100's 10,000 tokens/s, times 0.5 and times 2. Prints per cell kvroute's TTFT
p50 / p99 against the best peer's (the lowest mean over the seeds), its end-to-end p50 against
the fastest peer's, and marks the cells where kvroute's TTFT p50 is over 1.2x or its p99 over
1.3x the best peer's. The seeds are none of the matrix's (1-7) or the local path's (3-22,
101-140); nothing was tuned on these profiles.
"""
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

from fleetsim_cli import seeds_and_router_config

FLEET_SIM = os.environ.get("FLEET_SIM", "target/release/fleet-sim")
PEERS = ["round-robin", "least-request", "sglang-cache-aware", "llmd", "llmd-optimized", "dynamo"]
WORKLOADS = ["multi-turn", "shared-prefix", "long-doc", "agentic",
             "tests/fleet-sim/traces/mooncake_synthetic_trace.jsonl"]
LOADS = [0.5, 2.0]
H100_PREFILL = 10000.0


def prefill_rate(profile):
    text = open(profile).read()
    return float(re.search(r"^prefill_tokens_per_s:\s*([0-9.]+)", text, re.M).group(1))


def run(profile, workload, speedup, seed, out, router_config):
    cmd = [FLEET_SIM, "compare", "--workload", workload, "--replicas", "8",
           "--profile", profile, "--seed", str(seed), "--speedup", f"{speedup:.3f}",
           "--policies", ",".join(PEERS + ["kvroute"]), "--json", out]
    if workload.endswith(".jsonl"):
        cmd += ["--limit", "600"]
    if router_config:
        cmd += ["--router-config", router_config]
    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return json.load(open(out))["results"]


def main():
    seeds, router_config = seeds_and_router_config(sys.argv[1:], "11,12,13,14,15")
    print("| profile | workload | load | kvroute TTFT p50 / p99 ms | best peer p50 | best peer p99 "
          "| p50 / p99 ratio | e2e p50 against the fastest peer |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for profile in sorted(glob.glob("tests/fleet-sim/stress/*.yaml")):
            scale = prefill_rate(profile) / H100_PREFILL
            for workload in WORKLOADS:
                for load in LOADS:
                    rows = {}
                    for seed in seeds:
                        out = os.path.join(tmp, "run.json")
                        for r in run(profile, workload, load * scale, seed, out, router_config):
                            rows.setdefault(r["policy"], []).append(r)

                    def mean(policy, key, q):
                        return statistics.mean(r[key][q] for r in rows[policy])

                    k50, k99 = mean("kvroute", "ttft_ms", "p50"), mean("kvroute", "ttft_ms", "p99")
                    b50 = min(PEERS, key=lambda p: mean(p, "ttft_ms", "p50"))
                    b99 = min(PEERS, key=lambda p: mean(p, "ttft_ms", "p99"))
                    fast = min(PEERS, key=lambda p: mean(p, "e2e_ms", "p50"))
                    r50, r99 = k50 / mean(b50, "ttft_ms", "p50"), k99 / mean(b99, "ttft_ms", "p99")
                    e2e = mean("kvroute", "e2e_ms", "p50") / mean(fast, "e2e_ms", "p50")
                    mark = " **behind**" if r50 > 1.2 or r99 > 1.3 else ""
                    name = os.path.basename(workload).split("_")[0].replace(".jsonl", "")
                    print(f"| {os.path.basename(profile)[:-5]} | {name} | {load} | {k50:,.0f} / {k99:,.0f} "
                          f"| {b50} {mean(b50, 'ttft_ms', 'p50'):,.0f} "
                          f"| {b99} {mean(b99, 'ttft_ms', 'p99'):,.0f} "
                          f"| {r50:.2f} / {r99:.2f}{mark} | {e2e:.2f} ({fast}) |", flush=True)


if __name__ == "__main__":
    main()
