#!/usr/bin/env bash
# Set up, then run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! .venv/bin/python -c "import sys; from veloxpatch import blas; sys.exit(0 if blas.find_openblas() else 1)"; then
  cat >&2 <<'MSG'
################################################################################
#  WARNING: OpenBLAS not found. mlx will use its bundled reference BLAS and the  #
#  real-model (SmolLM2) tests will run ~15x slower.                             #
#  Install it:  apt-get install libopenblas0-pthread                            #
################################################################################
MSG
fi
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
