#!/usr/bin/env bash
# Set up, then ask two questions about a 2,400-token document (the Apache
# License 2.0, or the file given) compressed once, with no question, to a fifth
# of its full KV cache: `--max-kv-bytes 20%` and no --algo lets veloxpatch choose
# the algorithm, rows and stored bits from its measured table (it says which).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
doc=${1:-/usr/share/common-licenses/Apache-2.0}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
.venv/bin/veloxpatch compress --max-kv-bytes 20% --context "$doc" --out "$tmp/doc.safetensors"
for question in "Which license is this text?" "What must a redistribution of the Work include?"; do
  echo "Q: $question"
  .venv/bin/veloxpatch generate --cache "$tmp/doc.safetensors" --prompt "$question" --max-tokens 40
done
