"""The README's first Python example, run as written on the embedded model, and
on another document whose answer it states once: right answers, and auto's line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import smollm

ROOT = Path(__file__).resolve().parents[1]
LICENCES = Path("/usr/share/common-licenses")
FACT = "This copy of the licence is filed in cabinet number 4127."
ASKED = "In which cabinet number is this copy of the licence filed?"


def first_python_example() -> str:
    readme = (ROOT / "README.md").read_text()
    return re.search(r"```python\n(.*?)```", readme, re.S).group(1)


def on_another_document(code: str, path: Path) -> str:
    """The example with its `document` and `question` lines replaced: the
    Artistic licence with one fact put in its middle, and a question about it."""
    lines = code.splitlines()
    doc = [i for i, line in enumerate(lines) if line.startswith("document = ")]
    asked = [i for i, line in enumerate(lines) if line.startswith("question = ")]
    assert len(doc) == 1 and len(asked) == 1, code
    lines[doc[0]] = f"document = open({str(path)!r}).read()"
    lines[asked[0]] = f"question = {ASKED!r}"
    return "\n".join(lines) + "\n"


@smollm
def test_the_first_python_example_answers_and_says_what_auto_chose(tmp_path):
    code = first_python_example()
    paragraphs = (LICENCES / "Artistic").read_text().split("\n\n")
    middle = len(paragraphs) // 2
    other = tmp_path / "artistic-with-a-fact.txt"
    other.write_text("\n\n".join(paragraphs[:middle] + [FACT] + paragraphs[middle:]))
    # both in one interpreter, each in a namespace of its own, as a user runs it
    driver = (
        f"exec({code!r}, {{}})\nprint('=' * 20)\n"
        f"exec({on_another_document(code, other)!r}, {{}})\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", driver],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    apache, artistic = out.stdout.split("=" * 20 + "\n")
    for answer, expected in ((apache, "Apache"), (artistic, "4127")):
        reply, line = answer.rstrip("\n").rsplit("\n", 1)
        assert expected in reply, answer
        assert line.startswith("auto: ") and "of full KV" in line, answer
