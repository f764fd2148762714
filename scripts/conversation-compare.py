#!/usr/bin/env python3
"""kvroute's defaults on a conversation trace none of them was chosen on.

    cargo build --release -p fleet-sim
    scripts/conversation-compare.py [seeds, default 3,4,5,6,7] [--router-config JSON] [--out DIR]

For each seed, writes a trace with `scripts/conversation-trace.py --seed S` (about 12,000
requests: conversations of 1-15 turns from 20 applications with their own system prompts, in
Mooncake's format) and replays it with `fleet-sim compare` on 16 replicas of two shipped
profiles at two speedups each: llama8b-h100 at 6 and 12, qwen32b-h200 (a third of its prefill
rate) at 2 and 4. Round robin is saturated at all four; at speedup 1 on the H100s every
cache-aware policy is within a few ms of the others. Prints per configuration every policy's
TTFT p50 / p90 / p99 mean over the seeds with a 95 % t-interval, its end-to-end p50 and hit
rate, and kvroute's TTFT against the best peer's and the oracle's. Runs take about 1.5 minutes
each (20 in all); a run whose JSON is already in DIR (default target/conversation-compare) is
not run again. Nothing in the router was set on this trace.
"""
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys

from fleetsim_cli import seeds_and_router_config

FLEET_SIM = os.environ.get("FLEET_SIM", "target/release/fleet-sim")
PEERS = ["round-robin", "least-request", "sglang-cache-aware", "sglang-legacy", "llmd",
         "llmd-optimized", "dynamo"]
OURS = ["kvroute", "kvroute-precise"]
CONFIGS = [("llama8b-h100", 6), ("llama8b-h100", 12), ("qwen32b-h200", 2), ("qwen32b-h200", 4)]
# Two-sided 95 % t quantiles by degrees of freedom.
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def half_interval(values):
    if len(values) < 2:
        return 0.0
    return T95.get(len(values) - 1, 2.0) * statistics.stdev(values) / math.sqrt(len(values))


def run(out_dir, profile, speedup, seed, router_config):
    # Runs with other router settings keep their own files.
    tag = "" if not router_config else "_" + hashlib.sha256(router_config.encode()).hexdigest()[:8]
    out = os.path.join(out_dir, f"{profile}_{speedup}_s{seed}{tag}.json")
    if not os.path.exists(out):
        trace = os.path.join(out_dir, f"trace{seed}.jsonl")
        if not os.path.exists(trace):
            subprocess.run([sys.executable, "scripts/conversation-trace.py", "--seed", str(seed),
                            trace], stdout=subprocess.DEVNULL, check=True)
        cmd = [FLEET_SIM, "compare", "--workload", trace, "--replicas", "16", "--seed", str(seed),
               "--profile", f"tests/vllm-sim/profiles/{profile}.yaml", "--speedup", str(speedup),
               "--policies", ",".join(PEERS + OURS + ["oracle"]), "--json", out]
        if router_config:
            cmd += ["--router-config", router_config]
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return json.load(open(out))["results"]


def main():
    args = sys.argv[1:]
    out_dir = "target/conversation-compare"
    if "--out" in args:
        at = args.index("--out")
        out_dir = args[at + 1]
        del args[at:at + 2]
    seeds, router_config = seeds_and_router_config(args, "3,4,5,6,7")
    os.makedirs(out_dir, exist_ok=True)
    for profile, speedup in CONFIGS:
        rows = {}
        for seed in seeds:
            for r in run(out_dir, profile, speedup, seed, router_config):
                rows.setdefault(r["policy"], []).append(r)

        def values(policy, key, q):
            return [r[key][q] for r in rows[policy]]

        def mean(policy, key, q):
            return statistics.mean(values(policy, key, q))

        print(f"\n{profile}, 16 replicas, speedup {speedup}, seeds {','.join(map(str, seeds))}\n")
        print("| policy | TTFT p50 ms | TTFT p90 | TTFT p99 | e2e p50 | hit rate |")
        print("|---|---|---|---|---|---|")
        for policy in PEERS + OURS + ["oracle"]:
            cells = []
            for q in ("p50", "p90", "p99"):
                v = values(policy, "ttft_ms", q)
                cells.append(f"{statistics.mean(v):,.0f} ± {half_interval(v):,.0f}")
            hit = statistics.mean(r["prefix_hit_rate"] for r in rows[policy])
            print(f"| {policy} | {' | '.join(cells)} | {mean(policy, 'e2e_ms', 'p50'):,.0f} "
                  f"| {hit:.3f} |")
        ratios = []
        for q in ("p50", "p90", "p99"):
            best = min(PEERS, key=lambda p: mean(p, "ttft_ms", q))
            ratios.append(f"{q} {mean('kvroute', 'ttft_ms', q) / mean(best, 'ttft_ms', q):.2f} "
                          f"of {best}'s, {mean('kvroute', 'ttft_ms', q) / mean('oracle', 'ttft_ms', q):.2f} "
                          "of the oracle's")
        print("\nkvroute's TTFT: " + "; ".join(ratios))


if __name__ == "__main__":
    main()
