#!/usr/bin/env python3
"""Summarise per-request records that `fleet-sim matrix --records DIR` writes.

    scripts/records-summary.py DIR/agentic_qwen32b-h200_0.5_s1_kvroute.csv [more.csv ...]

Per file: TTFT and end-to-end percentiles, the hit rate; TTFT by kind of request (an agent's
first turn, a later turn or a subagent's fork, each staying on its parent's replica or moved
off it), with the prompt tokens each had to prefill; requests in the system (arrived, not
finished) per replica over time; and for moved requests, the prefill already queued (arrived,
no first token yet) on the replica they went to against the one holding their context.
"""
import csv
import statistics as st
import sys


def load(path):
    rows = list(csv.DictReader(open(path)))
    for r in rows:
        for k in ("arrival_ms", "first_token_ms", "finish_ms"):
            r[k] = float(r[k]) if r[k] else None
        for k in ("id", "replica", "prompt_tokens", "cached_tokens", "output_tokens"):
            r[k] = int(r[k])
        r["depends_on"] = int(r["depends_on"]) if r["depends_on"] else None
    return rows


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def queued(rows, replica, t):
    """Uncached prompt tokens on `replica` that arrived before `t` and had no first token yet."""
    return sum(r["prompt_tokens"] - r["cached_tokens"] for r in rows
               if r["replica"] == replica and r["arrival_ms"] < t and (r["first_token_ms"] or 1e18) > t)


def summarise(path):
    rows = load(path)
    by_id = {r["id"]: r for r in rows}
    n = max(r["replica"] for r in rows) + 1
    ttft = [r["first_token_ms"] - r["arrival_ms"] for r in rows if r["first_token_ms"]]
    e2e = [r["finish_ms"] - r["arrival_ms"] for r in rows if r["finish_ms"]]
    hit = sum(r["cached_tokens"] for r in rows) / max(1, sum(r["prompt_tokens"] for r in rows))
    print(path.split("/")[-1])
    print(f"  {len(rows)} requests, TTFT p50 {pct(ttft, .5):.0f} p90 {pct(ttft, .9):.0f} p99 {pct(ttft, .99):.0f},"
          f" e2e p50 {pct(e2e, .5):.0f} p90 {pct(e2e, .9):.0f}, hit rate {hit:.3f}")
    kinds = {}
    moved_queue = []
    for r in rows:
        parent = by_id.get(r["depends_on"]) if r["depends_on"] is not None else None
        if parent is None:
            kind = "first"
        else:
            moved = parent["replica"] != r["replica"]
            kind = ("fork" if r["session"] != parent["session"] else "turn") + ("-moved" if moved else "-stay")
            if moved:
                moved_queue.append((queued(rows, r["replica"], r["arrival_ms"]),
                                    queued(rows, parent["replica"], r["arrival_ms"])))
        kinds.setdefault(kind, []).append(r)
    for kind, rs in sorted(kinds.items()):
        t = [r["first_token_ms"] - r["arrival_ms"] for r in rs if r["first_token_ms"]]
        uncached = st.mean(r["prompt_tokens"] - r["cached_tokens"] for r in rs)
        print(f"  {kind:<11} {len(rs):4d} TTFT p50 {pct(t, .5):6.0f} p90 {pct(t, .9):6.0f} p99 {pct(t, .99):6.0f},"
              f" prefilled {uncached:5.0f} tokens each")
    if moved_queue:
        print(f"  moved: prefill queued ahead on the new replica {st.mean(q[0] for q in moved_queue):.0f} tokens,"
              f" on the one holding the context {st.mean(q[1] for q in moved_queue):.0f}")
    events = sorted([(r["arrival_ms"], 1, r["replica"]) for r in rows if r["finish_ms"]]
                    + [(r["finish_ms"], -1, r["replica"]) for r in rows if r["finish_ms"]])
    current, area, peak, last = [0] * n, [0.0] * n, [0] * n, events[0][0] if events else 0.0
    start = last
    for t, d, rep in events:
        for i in range(n):
            area[i] += current[i] * (t - last)
        last = t
        current[rep] += d
        peak[rep] = max(peak[rep], current[rep])
    span = max(last - start, 1e-9)
    counts = [0] * n
    for r in rows:
        counts[r["replica"]] += 1
    print("  in the system per replica, mean: " + " ".join(f"{a / span:.1f}" for a in area))
    print("  in the system per replica, peak: " + " ".join(map(str, peak)))
    print("  requests per replica:            " + " ".join(map(str, counts)))


for p in sys.argv[1:]:
    summarise(p)
