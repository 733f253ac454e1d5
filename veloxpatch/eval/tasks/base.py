"""The contract of an eval task: what `veloxpatch eval --tasks` can run.

A task is a dataclass whose fields are the `veloxpatch eval` options it reads
(named as the CLI parameters), checked when it is made, before any model loads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from ...errors import OptionError
from ...prose import check_source


@dataclass
class EvalTask:
    """Subclasses set `name`, `summary` and `progress_label`, declare their
    options as fields, and implement `steps`, `run` and `summary_lines`."""

    name: ClassVar[str] = ""  # its key in the results JSON
    summary: ClassVar[str] = ""  # one line: what it measures
    progress_label: ClassVar[str] = "steps"  # what one progress tick counts

    @classmethod
    def options(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_params(cls, params: dict) -> EvalTask:
        """The task with its options taken from the CLI's parameters (others
        ignored; a missing one keeps the field's default)."""
        return cls(**{k: params[k] for k in cls.options() if k in params})

    def check_fits(self, tokenizer) -> None:
        """Raise OptionError when this task's text is too short for its options
        (called once the model is loaded, before any task runs). Tasks that
        read prose override it."""

    def steps(self) -> int:
        """How many times `run` calls `tick` (the progress total)."""
        raise NotImplementedError

    def run(self, model, tokenizer, arms, tick: Callable[[], Any]) -> dict:
        """Every arm on this task: its results, usually {"table": ..., "raw": ...}."""
        raise NotImplementedError

    def summary_lines(self, result: dict) -> list[str]:
        """The printed summary of `result` (what `run` returned)."""
        raise NotImplementedError


def require(ok: bool, message: str) -> None:
    if not ok:
        raise OptionError(message)


def check_text(text: str) -> None:
    """A built-in prose half or a readable UTF-8 file (prose.prose reads it)."""
    check_source(text)


def check_protocol(protocol: str) -> None:
    """aware: the question (or continuation) sits in the compressed prompt;
    agnostic: the context is compressed before any of it exists."""
    require(
        protocol in ("aware", "agnostic"),
        f"--protocol must be aware or agnostic, got {protocol!r}",
    )
