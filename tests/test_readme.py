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
    first half of the Artistic licence with one fact put in its middle, and a
    question about it."""
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
    paragraphs = paragraphs[: len(paragraphs) // 2]  # ~500 tokens with the fact
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
        assert "the last prompt read" in line, answer  # the rows that ran


# ---- every keyword the README and docs/algorithms.md show is one the code takes ----
DOCS = ("README.md", "docs/algorithms.md")
# keywords `apply`/`patched` take beside an algorithm's options
APPLY_KEYWORDS = {"tokenizer", "auto_path", "max_peak_bytes"}


def options_of(algo: str) -> set[str]:
    from veloxpatch.api import algorithm

    return set(algorithm(algo).Options.option_names())


def shown_keywords() -> list[tuple[str, str, str]]:
    """(where, algorithm, keyword) for each keyword the docs pair with an
    algorithm: `algo:key=value,...` arms, `patched(model, "algo", key=...)`
    calls, the README table's options column, and the "`key` (default)" of
    docs/algorithms.md's bullets."""
    from veloxpatch.api import algos

    known = set(algos()) | {"auto"}
    found = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for algo, rest in re.findall(r"\b([a-z_0-9]+):((?:[a-z_]+=[^,`\s]+,?)+)", text):
            if algo in known:
                found += [(doc, algo, k) for k in re.findall(r"([a-z_]+)=", rest)]
        calls = re.findall(r"(?:patched|apply)\(model, \"(\w+)\"(.*?)\)", text)
        for algo, rest in calls:
            found += [(doc, algo, k) for k in re.findall(r"(\w+)=", rest)]
    table = (ROOT / DOCS[1]).read_text()  # the table of every algorithm
    for algo, column in re.findall(r"^\| `(\w+)` \|[^|]*\|([^|]*)\|", table, re.M):
        if algo in known and "as snapkv" not in column:
            found += [(DOCS[1], algo, k) for k in re.findall(r"`(\w+)`", column)]
    for algo, bullet in re.findall(
        r"^- `(\w+)`: (.*?)(?=^- |^\S|\Z)", (ROOT / DOCS[1]).read_text(), re.M | re.S
    ):
        if algo in known:
            found += [(DOCS[1], algo, k) for k in re.findall(r"`(\w+)` \(", bullet)]
    return found


def test_every_keyword_the_docs_show_is_one_the_code_takes():
    shown = shown_keywords()
    assert len({(a, k) for _, a, k in shown}) > 40  # the patterns still match the docs
    refused = sorted(
        {
            f"{doc}: {algo} {key}"
            for doc, algo, key in shown
            if algo != "auto" and key not in options_of(algo) | APPLY_KEYWORDS
        }
    )
    assert not refused, refused
    auto = {k for _, a, k in shown if a == "auto"}
    assert auto <= {"max_kv_bytes", "max_peak_bytes"} | APPLY_KEYWORDS, auto


def printed_commands() -> list[tuple[str, list[str]]]:
    """(doc, arguments) of each `veloxpatch ...` command line the docs print in a
    code block or inline code, placeholders and comments left out."""
    import shlex

    found = []
    for doc in (*DOCS, "docs/auto.md", "docs/serving.md", "docs/evaluation.md"):
        text = (ROOT / doc).read_text()
        lines = re.findall(r"^veloxpatch (.+)$", text, re.M)
        lines += re.findall(r"`veloxpatch ([^`]+)`", text)
        for line in lines:
            line = line.split(" #")[0].strip()
            if "..." in line or "<" in line or "|" in line:
                continue  # a placeholder or an alternative, not a command
            found.append((doc, shlex.split(line)))
    return found


def test_every_command_the_docs_print_parses(tmp_path, monkeypatch):
    import click

    from veloxpatch.cli import main

    commands = printed_commands()
    assert len(commands) > 20
    monkeypatch.chdir(tmp_path)  # the files they read exist here, empty
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    for _, args in commands:
        for arg in args:
            if arg.endswith((".txt", ".safetensors")) and not Path(arg).exists():
                Path(arg).parent.mkdir(parents=True, exist_ok=True)
                Path(arg).touch()
    bad = []
    for doc, args in commands:
        if len(args) < 2 or (len(args) == 2 and args[1].startswith("--")):
            continue  # a command or one of its flags named in a sentence
        try:
            with main.make_context("veloxpatch", list(args)) as ctx:
                name, cmd, rest = main.resolve_command(ctx, list(args))
                cmd.make_context(name, rest, parent=ctx)
        except click.exceptions.Exit:
            continue  # --help, --version
        except click.ClickException as e:
            bad.append(f"{doc}: veloxpatch {' '.join(args)}: {e.format_message()}")
    assert not bad, "\n".join(bad)
