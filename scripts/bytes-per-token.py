#!/usr/bin/env python3
"""How many UTF-8 bytes a real BPE tokenizer spends per token on different kinds of text.

    scripts/bytes-per-token.py

A check on the assumption behind fleet-sim's `--text-styles` (`fleet_sim::workload::TEXT_STYLES`)
and kvroute's `router.bytes_per_token`: the text is this repository's own (English docs, Rust,
Python, JSON, YAML, a numbers-heavy JSONL trace) and the seed articles next to it (German,
Russian). The tokenizer is the 65,000-token BPE vocabulary that PyPI's `anthropic` 0.7.0 ships
as `tokenizer.json`, the one real vocabulary the package registries serve as a file; the
models vLLM serves use others, so read the spread, not the level. Needs the registries: it
downloads that wheel and installs `tokenizers` into a venv under target/.
"""
import glob
import json
import os
import subprocess
import sys
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.path.join(ROOT, "target", "bytes-per-token")
SEEDS = os.path.join(ROOT, "..", "shared", "seeds")


def tokenizer():
    """The tokenizer, fetched and installed on first use."""
    venv = os.path.join(WORK, "venv")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "tokenizers"], check=True)
    path = os.path.join(WORK, "anthropic", "tokenizer.json")
    if not os.path.exists(path):
        subprocess.run(
            [python, "-m", "pip", "download", "-q", "--no-deps", "-d", WORK, "anthropic==0.7.0"],
            check=True,
        )
        with zipfile.ZipFile(os.path.join(WORK, "anthropic-0.7.0-py3-none-any.whl")) as wheel:
            wheel.extract("anthropic/tokenizer.json", WORK)
    return python, path


def main():
    os.makedirs(WORK, exist_ok=True)
    python, path = tokenizer()
    read = lambda p: open(p, encoding="utf-8").read()
    kinds = [
        ("English prose (ARCHITECTURE, CONTRIBUTING)", ["ARCHITECTURE.md", "CONTRIBUTING.md"]),
        ("German prose (seed article)", glob.glob(os.path.join(SEEDS, "002_*.txt"))),
        ("Russian prose (seed articles)", sorted(glob.glob(os.path.join(SEEDS, "00[03]_*.txt")))),
        ("Rust (scorer-core/src)", sorted(glob.glob("scorer-core/src/**/*.rs", recursive=True))[:40]),
        ("Python (scripts)", sorted(glob.glob("scripts/*.py"))),
        ("JSON (tests)", sorted(glob.glob("tests/**/*.json", recursive=True))[:50]),
        ("YAML (envoy-config)", sorted(glob.glob("envoy-config/**/*.yaml", recursive=True))),
        ("numbers-heavy JSONL (Mooncake trace)", ["tests/fleet-sim/traces/mooncake_synthetic_trace.jsonl"]),
    ]
    texts = {name: [read(p)[:200_000] for p in paths] for name, paths in kinds if paths}
    count = (
        "import json, sys\n"
        "from tokenizers import Tokenizer\n"
        "tok = Tokenizer.from_file(sys.argv[1])\n"
        "texts = json.load(sys.stdin)\n"
        "print(json.dumps({k: [len(tok.encode(t).ids) for t in v] for k, v in texts.items()}))\n"
    )
    out = subprocess.run(
        [python, "-c", count, path], input=json.dumps(texts),
        capture_output=True, text=True, check=True,
    ).stdout
    tokens = json.loads(out)
    print(f"{'text':44} {'bytes':>9} {'tokens':>8} bytes/token")
    for name, parts in texts.items():
        b = sum(len(t.encode()) for t in parts)
        t = sum(tokens[name])
        print(f"{name:44} {b:9d} {t:8d} {b / t:6.2f}")


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
