r"""Passkey retrieval accuracy (Wilson 95% intervals) for algorithms x budgets.

A five-digit key hidden at depths spread over 5-95% of evaluation-half prose,
the question at the end, chat template. Each case is prefilled once and replayed
into every arm (exact for prompts within one prefill chunk, see eval/replay.py).
Algorithms that stay under 90% of `full` at every listed budget are retried at
the `--search` budgets, in order, to find the smallest budget that reaches it.

This is `veloxpatch eval --tasks passkey` with the defaults below; every option
of `veloxpatch eval` passes through (`--help` lists them), `--force` included
(an existing `--out` is refused without it).

    .venv/bin/python scripts/quality_passkey.py --arms snapkv,adakv \
        --budgets 128,256,512 --cases 30 --out scripts/results/passkey.json
"""

from __future__ import annotations

import sys

# this script's defaults; anything typed on the command line wins
DEFAULTS = {
    "tasks": "passkey",
    "arms": "snapkv,pyramidkv,adakv,h2o,tova,keyformer",
    "budgets": "128,256,512",
    "cases": 30,
    "context": 1500,
    "out": "scripts/results/passkey.json",
}


def main(argv: list[str] | None = None, standalone_mode: bool = True):
    from eval_script import run_eval

    return run_eval(__doc__, DEFAULTS, argv, standalone_mode)


if __name__ == "__main__":
    sys.exit(main())
