"""Real English prose with no download: the Python reference topics that ship
with the standard library (`pydoc_data.topics`, ~465k characters).

Topics are split by sorted name into a calibration half and an evaluation half
that share no paragraph: calibration (Q-Filters, A2ATS) reads only the first, every
quality measurement only the second.
"""

from __future__ import annotations

import functools
from pathlib import Path

SPLITS = ("calibration", "evaluation")


@functools.lru_cache(maxsize=4)
def prose(split: str = "evaluation") -> str:
    """A half of the built-in prose, or (any other value) a text file's content."""
    if split not in SPLITS:
        path = Path(split)
        if not path.is_file():
            raise ValueError(f"text must be one of {SPLITS} or a file, got {split!r}")
        return path.read_text(encoding="utf-8", errors="replace")
    calibration, evaluation = _halves()
    return calibration if split == "calibration" else evaluation


def _halves() -> tuple[str, str]:
    from pydoc_data.topics import topics

    names = sorted(topics)
    half = len(names) // 2
    seen: set[str] = set()
    out = []
    for chosen in (names[:half], names[half:]):
        parts = []
        for name in chosen:
            # Collapse the reST layout; topics repeat whole paragraphs (e.g. the
            # naming rules appear under several names), so each paragraph is
            # used once, and never in both halves.
            paragraphs = []
            for p in topics[name].split("\n\n"):
                p = " ".join(p.split())
                if p and p not in seen:
                    seen.add(p)
                    paragraphs.append(p)
            if paragraphs:
                parts.append("\n".join(paragraphs))
        out.append("\n\n".join(parts))
    return out[0], out[1]


def prose_tokens(tokenizer, n: int, split: str = "evaluation", start: int = 0):
    """`n` tokens of prose (after skipping `start` tokens), as a list of ids."""
    ids = _encoded(tokenizer, split)
    if start + n > len(ids):
        raise ValueError(f"only {len(ids)} tokens of {split} prose, asked {start + n}")
    return ids[start : start + n]


def prose_length(tokenizer, split: str = "evaluation") -> int:
    return len(_encoded(tokenizer, split))


_ENCODED: dict = {}


def _encoded(tokenizer, split: str) -> list[int]:
    key = (id(tokenizer), split)
    if key not in _ENCODED:
        _ENCODED[key] = tokenizer.encode(prose(split), add_special_tokens=False)
    return _ENCODED[key]
