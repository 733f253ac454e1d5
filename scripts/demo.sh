#!/usr/bin/env bash
# Set up, then answer a question on the embedded SmolLM2 with its KV cache
# compressed by kvzip (the README's pick for one generate call) to 16 rows per head.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/veloxpatch generate --algo kvzip --budget 16 \
  --prompt "${1:-What is the capital of France?}" --max-tokens 48
