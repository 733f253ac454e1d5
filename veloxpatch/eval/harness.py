"""`veloxpatch eval`: the requested tasks (eval/tasks) over any arms.

Every arm is written `NAME[:key=value,...]`; ours replay one dense prefill per
case, peers (`unpatched`, `mlx.rotating`, `mlx.quantized`, `veloxquant.ALGO`)
prefill directly. Results keep every raw row next to the summary tables.
"""

from __future__ import annotations

from ..errors import OptionError
from .arms import bind_to
from .tasks import TASKS, EvalTask


def parse_tasks(text: str) -> list[str]:
    tasks = [t.strip() for t in text.split(",") if t.strip()]
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown or not tasks:
        raise OptionError(f"unknown task(s) {unknown}; valid: {', '.join(TASKS)}")
    return tasks


def make_tasks(names: list[str], params: dict) -> list[EvalTask]:
    """One task per distinct class asked for, in registry order, its options
    read (and checked) from `params`."""
    wanted = {TASKS[n] for n in names}
    classes = [c for c in dict.fromkeys(TASKS.values()) if c in wanted]
    return [cls.from_params(params) for cls in classes]


def run_tasks(model, tokenizer, arms, tasks: list[EvalTask], progress) -> dict:
    """Results by task name; `progress(total, label)` is a context manager
    whose `update(1)` marks a step done. Every task checks that its text is
    long enough, and every arm's options fit the model, before any runs."""
    for task in tasks:
        task.check_fits(tokenizer)
    bind_to(model, arms)
    results = {}
    for task in tasks:
        with progress(task.steps(), task.progress_label) as bar:
            results[task.name] = task.run(
                model, tokenizer, arms, tick=lambda: bar.update(1)
            )
    return results


def format_tables(results: dict, tasks: list[EvalTask]) -> str:
    """The printed summary: a table per task, a blank line between."""
    return "\n\n".join(
        "\n".join(task.summary_lines(results[task.name])) for task in tasks
    )
