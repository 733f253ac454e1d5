#!/usr/bin/env bash
# Set up, then answer a question on the embedded SmolLM2 with a patched model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/veloxpatch generate --algo full \
  --prompt "${1:-What is the capital of France?}" --max-tokens 48
