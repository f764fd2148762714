#!/usr/bin/env python3
"""Writes a Mooncake-format conversation trace (`timestamp`, `input_length`, `output_length`,
`hash_ids` of 512-token blocks) for `fleet-sim compare --workload FILE`.

Why: the matrix's multi-turn workload is one shape (one system prompt, six turns, fixed
lengths) that kvroute's defaults were chosen beside. This trace is another shape, fixed before
any run and never tuned on: conversations of 1-15 turns from 20 applications, each with its own
system prompt of 1-4 blocks, user turns of 1-4 blocks, answers of 20-600 tokens that join the
history, and think times of about 30 s, spread over an hour. Every figure it gives is a check
of robustness, not a target.

Usage: scripts/conversation-trace.py [--seed N] [--sessions N] OUT.jsonl
"""

import argparse
import json
import random

BLOCK_TOKENS = 512


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--sessions", type=int, default=1500)
    parser.add_argument("--apps", type=int, default=20)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    next_block = 10**6
    requests = []
    for _ in range(args.sessions):
        app = rng.randrange(args.apps)
        history = list(range(app * 10, app * 10 + rng.randint(1, 4)))
        at = rng.uniform(0, 3_600_000)
        for _ in range(rng.randint(1, 15)):
            for _ in range(rng.randint(1, 4)):
                history.append(next_block)
                next_block += 1
            # The last block is partly filled.
            prompt = len(history) * BLOCK_TOKENS - rng.randint(0, 400)
            requests.append((int(at), prompt, rng.randint(20, 600), list(history)))
            # The answer joins the history the next turn sends.
            history.append(next_block)
            next_block += 1
            at += rng.expovariate(1 / 30_000)
    requests.sort(key=lambda r: r[0])
    with open(args.out, "w") as f:
        for timestamp, prompt, output, blocks in requests:
            line = {
                "timestamp": timestamp,
                "input_length": prompt,
                "output_length": output,
                "hash_ids": blocks,
            }
            f.write(json.dumps(line) + "\n")
    print(f"wrote {len(requests)} requests to {args.out}")


if __name__ == "__main__":
    main()
