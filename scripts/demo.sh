#!/usr/bin/env bash
# Set up, then answer a question on the embedded SmolLM2 with its KV cache
# compressed by SnapKV to 16 rows per head (of 37 prompt tokens).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/veloxpatch generate --algo snapkv --budget 16 --algo-arg window=8 \
  --prompt "${1:-What is the capital of France?}" --max-tokens 48
