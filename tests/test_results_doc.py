"""docs/results.md and the README's results summary are generated from
scripts/results/*.json: they must match what scripts/make_results_doc.py writes
(no model, under a second)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_results_doc_is_up_to_date():
    done = subprocess.run(
        [sys.executable, "scripts/make_results_doc.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
