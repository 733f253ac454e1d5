"""What scripts/quality_*.py share: `veloxpatch eval` run with a script's own
defaults, so there is one harness (sampling, tables, results schema); the run's
table is written beside its results file (`.md`, results_markdown.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def run_eval(doc: str, defaults: dict, argv=None, standalone_mode=True):
    """`veloxpatch eval ARGV` with `defaults` as the option defaults: a default
    map, not typed options, so `eval` still refuses only what the user typed
    and `--help` shows the script's defaults."""
    from veloxpatch.cli import main

    argv = sys.argv[1:] if argv is None else list(argv)
    if {"-h", "--help"} & set(argv):
        print(doc)  # what the script is for, before eval's options
    # usage and error hints name `veloxpatch eval`, which this is
    try:
        done = main(
            ["eval", *argv],
            prog_name="veloxpatch",
            standalone_mode=standalone_mode,
            default_map={"eval": defaults},
            show_default=True,
        )
    except SystemExit as exit_:
        if exit_.code in (0, None):
            _markdown(argv, defaults)
        raise
    _markdown(argv, defaults)
    return done


def out_path(argv: list[str], defaults: dict) -> str:
    """The results file a run writes: `--out` as typed, else the default."""
    for i, arg in enumerate(argv):
        if arg == "--out" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--out="):
            return arg.split("=", 1)[1]
    return defaults["out"]


def _markdown(argv: list[str], defaults: dict) -> None:
    if {"-h", "--help"} & set(argv):
        return
    from results_markdown import eval_beside

    out = Path(out_path(argv, defaults))
    if out.is_file():
        eval_beside(out, json.loads(out.read_text()))
