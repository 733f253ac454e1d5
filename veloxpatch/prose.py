"""Real English prose with no download: the Python reference topics that ship
with the standard library (`pydoc_data.topics`, ~465k characters).

Topics are split by sorted name into a calibration half and an evaluation half
that share no paragraph: calibration (Q-Filters, A2ATS) reads only the first, every
quality measurement only the second.

A second kind of English, so no result rests on one: the licence texts Debian
ships in every install (`/usr/share/common-licenses`, base-files), legal prose,
split by file into `licenses-calibration` and `licenses-evaluation` with no
licence family in both (GPL-3 is in one, LGPL-2.1 in the other; GFDL-1.2,
a near copy of 1.3, in neither).

`mixed-calibration` alternates the two calibration texts in blocks of about
1,000 tokens (the length kvzap's calibration segments have), so a file fitted
on it has seen both kinds in equal parts.
"""

from __future__ import annotations

import functools
from pathlib import Path

from .errors import OptionError

LICENSES = Path("/usr/share/common-licenses")
LICENSE_SPLITS = {
    "licenses-calibration": ("LGPL-2.1", "GFDL-1.3", "MPL-1.1", "Artistic"),
    "licenses-evaluation": ("GPL-3", "Apache-2.0", "MPL-2.0", "CC0-1.0"),
}
MIXED = "mixed-calibration"
SPLITS = ("calibration", "evaluation", *LICENSE_SPLITS, MIXED)
MIXED_BLOCK = 4096  # characters of one kind before the other's (~1,000 tokens)


def check_source(split: str) -> None:
    """A built-in half's name, or a readable UTF-8 text file; OptionError says
    what is wrong (the CLI checks `--text` with this before any model loads)."""
    if split in LICENSE_SPLITS or split == MIXED:
        _licenses(split if split in LICENSE_SPLITS else "licenses-calibration")
    elif split not in SPLITS:
        _read(split)


def _read(split: str) -> str:
    path = Path(split)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "is not a file"
        raise OptionError(
            f"--text must be {' or '.join(SPLITS)} or a text file; {split!r} {what}"
        )
    try:
        data = path.read_bytes()
    except OSError as e:
        raise OptionError(f"cannot read --text {split}: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OptionError(
            f"--text {split} is not UTF-8 text (byte 0x{data[e.start]:02x} at "
            f"offset {e.start})"
        ) from None


@functools.lru_cache(maxsize=4)
def prose(split: str = "evaluation") -> str:
    """A half of the built-in prose, or (any other value) a UTF-8 text file's
    content."""
    if split in LICENSE_SPLITS:
        return _licenses(split)
    if split not in SPLITS:
        return _read(split)
    if split == MIXED:
        return _mixed(_licenses("licenses-calibration"), _halves()[0])
    calibration, evaluation = _halves()
    return calibration if split == "calibration" else evaluation


def _licenses(split: str) -> str:
    paragraphs = _licence_paragraphs(split)
    if split == "licenses-calibration":  # GFDL-1.3 took paragraphs from GPL-3
        used = set(_licence_paragraphs("licenses-evaluation"))
        paragraphs = [p for p in paragraphs if p not in used]
    return "\n".join(paragraphs)


def _mixed(first: str, second: str) -> str:
    """Blocks of MIXED_BLOCK characters, one of each text in turn, cut at the
    paragraph ends that follow; as many characters of each as the shorter has."""
    n = min(len(first), len(second))
    blocks = [_blocks(first[:n]), _blocks(second[:n])]
    out = [b for pair in zip(*blocks) for b in pair]
    longer = blocks[0] if len(blocks[0]) > len(blocks[1]) else blocks[1]
    return "\n".join(out + longer[len(out) // 2 :])


def _blocks(text: str) -> list[str]:
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", start + MIXED_BLOCK)
        end = len(text) if end < 0 else end
        out.append(text[start:end].strip("\n"))
        start = end + 1
    return out


def _licence_paragraphs(split: str) -> list[str]:
    missing = [n for n in LICENSE_SPLITS[split] if not (LICENSES / n).is_file()]
    if missing:
        raise OptionError(
            f"--text {split} reads {LICENSES} (Debian's base-files), which lacks "
            f"{', '.join(missing)} on this machine; use evaluation or a text file"
        )
    # one paragraph per line, as the pydoc halves: the files are hard-wrapped
    out = []
    for name in LICENSE_SPLITS[split]:
        text = (LICENSES / name).read_text(encoding="utf-8")
        out += [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
    return out


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
    check_length(len(ids), start + n, split)
    return ids[start : start + n]


def prose_segments(
    tokenizer, context: int, continuation: int, n: int, split="evaluation"
):
    """`n` (context ids, continuation ids) stretches spread evenly over the text."""
    span = context + continuation
    total = prose_length(tokenizer, split)
    stride = (total - span) // max(1, n - 1) if n > 1 else 0
    for seg in range(n):
        ids = prose_tokens(tokenizer, span, split, start=seg * stride)
        yield ids[:context], ids[context:]


def prose_length(tokenizer, split: str = "evaluation") -> int:
    return len(_encoded(tokenizer, split))


def check_length(available: int, needed: int, split: str) -> None:
    """OptionError when `split` has fewer than `needed` tokens."""
    if needed > available:
        raise OptionError(
            f"--text {split} has {available:,} tokens, fewer than the {needed:,} needed"
        )


_ENCODED: dict = {}


def _encoded(tokenizer, split: str) -> list[int]:
    key = (id(tokenizer), split)
    if key not in _ENCODED:
        _ENCODED[key] = tokenizer.encode(prose(split), add_special_tokens=False)
    return _ENCODED[key]
