"""What every results file records about the run: versions and the machine."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

import veloxpatch
from veloxpatch import blas


def run_info() -> dict:
    import mlx.core as mx
    import mlx_lm

    commit = _git("rev-parse", "--short", "HEAD")
    # results files are what runs write, not what they ran
    dirty = _git("status", "--porcelain", "--", ":/", ":(exclude,top)scripts/results")
    return {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "veloxpatch": veloxpatch.__version__,
        "git_commit": commit,
        "git_dirty": bool(dirty),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
        "device": str(mx.default_device()),
        "blas": blas.active(),
        # 1, 5 and 15 minute load averages as the run starts (shared machines)
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def _git(*args) -> str:
    try:
        return subprocess.run(
            ["git", *args],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=os.path.dirname(__file__),
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def write_results(path, result: dict) -> None:
    """Write a results file (JSON), creating its folder."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
