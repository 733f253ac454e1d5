"""Real English prose with no download: the Python reference topics that ship
with the standard library (`pydoc_data.topics`, ~465k characters).

Topics are split by sorted name into a calibration half and an evaluation half
that never overlap: calibration (Q-Filters, A2ATS) reads only the first, every
quality measurement only the second.
"""

from __future__ import annotations

import functools

SPLITS = ("calibration", "evaluation")


@functools.lru_cache(maxsize=2)
def prose(split: str = "evaluation") -> str:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    from pydoc_data.topics import topics

    names = sorted(topics)
    half = len(names) // 2
    chosen = names[:half] if split == "calibration" else names[half:]
    # Collapse the reST layout whitespace; keep paragraphs as single lines.
    parts = []
    for name in chosen:
        paragraphs = [" ".join(p.split()) for p in topics[name].split("\n\n")]
        parts.append("\n".join(p for p in paragraphs if p))
    return "\n\n".join(parts)


def prose_tokens(tokenizer, n: int, split: str = "evaluation", start: int = 0):
    """`n` tokens of prose (after skipping `start` tokens), as a list of ids."""
    ids = _encoded(tokenizer, split)
    if start + n > len(ids):
        raise ValueError(f"only {len(ids)} tokens of {split} prose, asked {start + n}")
    return ids[start : start + n]


_ENCODED: dict = {}


def _encoded(tokenizer, split: str) -> list[int]:
    key = (id(tokenizer), split)
    if key not in _ENCODED:
        _ENCODED[key] = tokenizer.encode(prose(split), add_special_tokens=False)
    return _ENCODED[key]
