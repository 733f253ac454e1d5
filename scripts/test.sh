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
# One pytest worker more than the cores, up to 4, each with one core's BLAS
# threads (tests/conftest.py): server tests wait on their servers, and a third
# worker on 2 cores fills that time (325 s against 388 s with two); a module's
# tests on one worker, so its servers and model loads start once; the longest
# modules first (tests/conftest.py), not xdist's order by number of tests.
workers=${VELOXPATCH_TEST_WORKERS:-$(.venv/bin/python -c "import os; print(min(4, (os.cpu_count() or 1) + 1))")}
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadscope --no-loadscope-reorder "$@"
