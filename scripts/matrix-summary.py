#!/usr/bin/env python3
"""Summarise `fleet-sim matrix --json` reports the way docs/BENCHMARKS.md does.

    scripts/matrix-summary.py target/fleet-sim/matrix.json [baseline.json]

Prints, for kvroute against the best peer per cell: cells whose TTFT p50 / p99 is at or below
the best peer's (within the 95 % intervals), both, loss cells (either not), the geometric
means of kvroute / best peer on p50 and p99, cells whose p50 is within 15 % of the oracle's,
kvroute's end-to-end p50 against the peer that finishes soonest in each cell (geomean, overall
and per workload), per pool, per workload and per load geomeans, and the loss cells. With a second report
(the baseline), also the cells whose verdict changed.
"""
import json
import math
import sys


OWN = {"kvroute", "kvroute-precise", "kvroute-local", "oracle"}


def verdicts(path):
    report = json.load(open(path))
    out = {}
    for c in report["cells"]:
        v = c.get("verdict")
        if not v:
            continue
        key = (c["workload"], c["pool"], c["load"])
        k = next(p for p in c["policies"] if p["policy"] == "kvroute")
        # End to end, against the peer that finishes soonest in this cell (the oracle and
        # kvroute's own variants are not peers).
        peers = [p for p in c["policies"] if p["policy"] not in OWN]
        e2e_best = min(p["e2e_p50_ms"]["mean"] for p in peers) if peers else float("nan")
        out[key] = dict(v, e2e_p50=k["e2e_p50_ms"]["mean"], tok_s=k["output_tokens_per_s"]["mean"],
                        hit=k["prefix_hit_rate"]["mean"],
                        e2e_ratio=k["e2e_p50_ms"]["mean"] / e2e_best)
    return out


def geomean(xs):
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def summary(vs, label):
    n = len(vs)
    p50 = sum(v["p50_ok"] for v in vs.values())
    p99 = sum(v["p99_ok"] for v in vs.values())
    both = sum(v["p50_ok"] and v["p99_ok"] for v in vs.values())
    orc = sum(1 for v in vs.values() if v["p50_vs_oracle"] is not None and v["p50_vs_oracle"] <= 1.15)
    print(f"{label}: p50 ok {p50}/{n}, p99 ok {p99}/{n}, both {both}, loss cells {n - both}, "
          f"geomean p50 {geomean([v['p50_ratio'] for v in vs.values()]):.3f} "
          f"p99 {geomean([v['p99_ratio'] for v in vs.values()]):.3f}, "
          f"p50 within 15% of oracle {orc}, "
          f"geomean kvroute/oracle p50 {geomean([v['p50_vs_oracle'] or float('nan') for v in vs.values()]):.3f}")
    print(f"  end-to-end p50 against the peer that finishes soonest, geomean "
          f"{geomean([v['e2e_ratio'] for v in vs.values()]):.3f}; by workload: " + ", ".join(
              f"{w} {geomean([v['e2e_ratio'] for k, v in vs.items() if k[0] == w]):.2f}"
              for w in dict.fromkeys(k[0] for k in vs)))
    for axis, idx in (("pool", 1), ("workload", 0), ("load", 2)):
        groups = {}
        for k, v in vs.items():
            groups.setdefault(k[idx], []).append(v)
        print(f"  by {axis}: " + ", ".join(
            f"{g} {geomean([v['p50_ratio'] for v in gs]):.2f}/{geomean([v['p99_ratio'] for v in gs]):.2f}"
            for g, gs in groups.items()))


def main():
    a = verdicts(sys.argv[1])
    summary(a, sys.argv[1])
    b = verdicts(sys.argv[2]) if len(sys.argv) > 2 else None
    if b:
        summary(b, sys.argv[2])
    print("loss cells:" if not b else "cells (new vs baseline):")
    for k, v in a.items():
        old = b.get(k) if b else None
        lost = not (v["p50_ok"] and v["p99_ok"])
        changed = old and (old["p50_ok"], old["p99_ok"]) != (v["p50_ok"], v["p99_ok"])
        if lost or changed or (old and k[0] == "agentic"):
            line = (f"  {k[0]:<14} {k[1]:<30} {k[2]:>3} p50 {v['best_peer_p50']:<18} {v['p50_ratio']:.2f}"
                    f" {'ok' if v['p50_ok'] else 'LOSS':<4} p99 {v['best_peer_p99']:<18} {v['p99_ratio']:.2f}"
                    f" {'ok' if v['p99_ok'] else 'LOSS':<4} orcl {v['p50_vs_oracle'] or 0:.2f} e2e {v['e2e_p50']:.0f}")
            if old:
                line += (f"   | was {old['p50_ratio']:.2f} {'ok' if old['p50_ok'] else 'LOSS'}"
                         f" / {old['p99_ratio']:.2f} {'ok' if old['p99_ok'] else 'LOSS'} e2e {old['e2e_p50']:.0f}")
            print(line)


if __name__ == "__main__":
    main()
