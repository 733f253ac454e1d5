"""The README's first command, `scripts/demo.sh`, as a user runs it."""

import os
import subprocess
from pathlib import Path

from conftest import smollm

ROOT = Path(__file__).resolve().parents[1]


@smollm
def test_demo_chooses_and_answers_about_the_document():
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    out = subprocess.run(
        ["bash", "scripts/demo.sh"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "auto: " in out.stderr, out.stderr[-2000:]  # it says what it chose
    assert "Apache" in out.stdout.split("Q: ")[1], out.stdout
