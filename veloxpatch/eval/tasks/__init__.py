"""Eval tasks, one per file. Adding one: a file with an EvalTask subclass and
a line below. The key is the name `--tasks` takes; several names may share a
task (it then runs once). Tasks run, and print, in this order."""

from .base import EvalTask
from .continuation import ContinuationTask
from .passkey import PasskeyTask

TASKS: dict[str, type[EvalTask]] = {
    "passkey": PasskeyTask,
    "ppl": ContinuationTask,
    "agreement": ContinuationTask,
}

__all__ = ["TASKS", "ContinuationTask", "EvalTask", "PasskeyTask"]
