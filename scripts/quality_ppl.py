r"""Perplexity, greedy agreement and KL of a continuation after a compressed context.

On the embedded SmolLM2 by default: `segments` stretches of evaluation-half prose,
each a `context`-token context followed by a `continuation`-token continuation fed
one token per call (so decode-time eviction happens as in generation).

This is `veloxpatch eval --tasks ppl` with the defaults below; every option of
`veloxpatch eval` passes through (`--help` lists them), `--force` included (an
existing `--out` is refused without it). The stretches are spread evenly over
the text, as `veloxpatch eval` places them (before it, this script started them
20,000 tokens apart).

    .venv/bin/python scripts/quality_ppl.py --arms full,streaming_llm,knorm \
        --budgets 256,512,1024 --out scripts/results/ppl_core.json
"""

from __future__ import annotations

import sys

# this script's defaults; anything typed on the command line wins
DEFAULTS = {
    "tasks": "ppl",
    "arms": "full,streaming_llm,knorm",
    "budgets": "256,512,1024",
    "context": 2000,
    "continuation": 256,
    "segments": 2,
    "out": "scripts/results/ppl.json",
}


def main(argv: list[str] | None = None, standalone_mode: bool = True):
    from eval_script import run_eval

    return run_eval(__doc__, DEFAULTS, argv, standalone_mode)


if __name__ == "__main__":
    sys.exit(main())
