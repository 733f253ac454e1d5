"""`veloxpatch eval` and `veloxpatch bench`: quality and speed of any arms, ours
and the tools users would pick instead, side by side."""

from __future__ import annotations

import sys

import click

from .checks import (
    Count,
    Counts,
    NonEmpty,
    OutputFile,
    TextSource,
    UserError,
    refuse_existing,
    refuse_missing_calibration,
    refuse_unread,
    user_errors,
)


def _arms(text: str, budgets: list[int], sizes: str = ""):
    """The arms `--arms` and `--budgets` (or `--max-kv-bytes`) name: at least one,
    none twice, and every budget or size used by some arm."""
    from ..api import algorithm
    from ..eval.arms import AUTO, expand, is_peer, split_arms
    from ..pricing import parse_target

    limits = [s.strip() for s in sizes.split(",") if s.strip()]
    texts = split_arms(text)
    if not texts:
        raise UserError(f"--arms names no arm, got {text!r}")
    if budgets and limits:
        raise UserError("--budgets and --max-kv-bytes: give one (both set the budget)")
    for size in limits:  # a share (20%) for auto arms, checked as they expand
        parse_target(size, "--max-kv-bytes")
    arms = expand(texts, budgets, limits)
    for arm in arms:  # an unknown name first, not as an arm no budget applies to
        if not is_peer(arm.algo) and arm.algo != AUTO:
            algorithm(arm.algo)
    flag = "--budgets" if budgets else "--max-kv-bytes"
    if (budgets or limits) and [a.label for a in arms] == [
        a.label for a in expand(texts)
    ]:
        raise UserError(
            f"{flag} applies to no arm (each names its budget or takes none)"
        )
    labels = [a.label for a in arms]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise UserError(f"--arms names {', '.join(twice)} twice")
    return arms


def _config() -> dict:
    """The parameters as the results file records them: lists as the user wrote
    them (comma-separated), --force left out (it is not part of the run)."""
    params = click.get_current_context().params
    return {
        k: ",".join(map(str, v)) if isinstance(v, list) else v
        for k, v in params.items()
        if k != "force"
    }


def _check_arms(arms):
    """Validate every arm before anything runs; return (runnable, skipped)."""
    from ..api import make_options
    from ..auto import check_options, load_table
    from ..eval.arms import AUTO, is_peer
    from ..pricing import split_share

    runnable, skipped = [], []
    for arm in arms:
        if arm.algo == AUTO:
            check_options(arm.options)
            load_table()
            runnable.append(arm)
            continue
        if not is_peer(arm.algo):
            # unknown names raise here; a share is priced per prompt
            make_options(arm.algo, split_share(arm.algo, arm.options)[0])
            refuse_missing_calibration(arm.algo, dict(arm.options))
            runnable.append(arm)
            continue
        from ..eval import peers

        reason = peers.check(arm.algo, dict(arm.options))  # raises when invalid
        if reason is None:
            runnable.append(arm)
        else:
            skipped.append({"arm": arm.label, "reason": reason})
    return runnable, skipped


class _Lines:
    """Progress as one line per step, for logs (click's bar draws nothing
    until the end when stderr is not a terminal)."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done = total, label, 0

    def __enter__(self):
        import time

        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n: int) -> None:
        import time

        self.done += n
        took = time.monotonic() - self.t0
        click.echo(f"{self.label}: {self.done}/{self.total} ({took:.0f} s)", err=True)


def _progress(total: int, label: str):
    if sys.stderr.isatty():
        return click.progressbar(length=total, label=label, file=sys.stderr)
    return _Lines(total, label)


common = [
    click.option(
        "--model", type=NonEmpty(), default=None, help="default: the embedded SmolLM2"
    ),
    click.option(
        "--arms",
        required=True,
        help="NAME[:key=value,...],... e.g. snapkv,mlx.rotating",
    ),
    click.option(
        "--budgets",
        type=Counts(1, empty_ok=True),
        default="",
        help="budgets for arms that name none",
    ),
    click.option("--prefill-step-size", type=Count(1), default=2048, show_default=True),
    click.option(
        "--text",
        type=TextSource(),
        default="evaluation",
        help="prose: evaluation (pydoc), licenses-evaluation, or a UTF-8 file",
    ),
    click.option(
        "--max-kv-bytes",
        default="",
        metavar="SIZES",
        help="KV bytes, e.g. 6MB,12MB,24MB, or shares of each prompt's full KV, "
        "e.g. 20% (not mlx.rotating): every arm with a budget (ours, mlx.rotating, "
        "auto) runs at each as its max_kv_bytes; the others once",
    ),
    click.option("--out", type=OutputFile(), required=True, help="results JSON"),
    click.option("--force", is_flag=True, help="overwrite --out (and --plot)"),
]


def _with(options):
    def wrap(fn):
        for opt in reversed(options):
            fn = opt(fn)
        return fn

    return wrap


@click.command("eval")
@_with(common)
@click.option("--tasks", default="passkey,ppl,agreement", show_default=True)
@click.option("--context", type=int, default=1500, show_default=True)
@click.option("--cases", type=int, default=20, show_default=True, help="passkey cases")
@click.option(
    "--segments", type=int, default=2, show_default=True, help="ppl stretches"
)
@click.option("--continuation", type=int, default=256, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--decode-lead-in",
    is_flag=True,
    help="passkey: end the prompt at the question and feed the answer's lead-in "
    "('The secret number is') as answer tokens, so lookahead compresses before "
    "the first digit is predicted",
)
@click.option(
    "--search",
    type=Counts(1, empty_ok=True),
    default="",
    metavar="BUDGETS",
    help="passkey: budgets tried in order, e.g. 768,1024, for families under 90% "
    "of full at every budget, until each reaches it",
)
@click.option(
    "--protocol",
    type=click.Choice(["aware", "agnostic"]),
    default="aware",
    show_default=True,
    help="question (passkey) or continuation (ppl) inside the compressed "
    "prompt, or sent after the context was compressed on its own",
)
@click.option(
    "--plot",
    "plot_path",
    type=OutputFile(),
    default=None,
    help="image (PNG, PDF, SVG...): quality against budget",
)
@user_errors
def eval_(
    model, arms, budgets, max_kv_bytes, out, force, tasks, plot_path, **task_options
):
    """Passkey accuracy, perplexity and agreement with full, per arm."""
    from ..eval import harness
    from ..eval.arms import Arm
    from ..eval.runinfo import run_info, write_results
    from ..eval.tasks import TASKS
    from ..loading import models

    # each task takes the options it reads (its fields) and checks them now
    task_list = harness.make_tasks(harness.parse_tasks(tasks), task_options)
    read = {name for task in task_list for name in task.options()}
    unread = [n for cls in TASKS.values() for n in cls.options() if n not in read]
    refuse_unread(
        click.get_current_context(),
        dict.fromkeys(unread),
        f"not read by --tasks {tasks}",
    )
    arm_list = _arms(arms, budgets, max_kv_bytes)
    if not any(a.algo == "full" and not a.options for a in arm_list):
        arm_list.insert(0, Arm("full"))  # the reference every table needs
    arm_list, skipped = _check_arms(arm_list)
    refuse_existing(force, out=out, plot=plot_path)
    if plot_path:
        from ..eval.plot import check_path

        check_path(plot_path)  # matplotlib missing or the format unknown: now
    for s in skipped:
        click.echo(f"skipped {s['arm']}: {s['reason']}", err=True)
    info = run_info()
    loaded, tokenizer = models.load(model)
    results = {
        "run": info,
        "config": _config(),
        "skipped": skipped,
    }
    results.update(harness.run_tasks(loaded, tokenizer, arm_list, task_list, _progress))
    write_results(out, results)
    click.echo(harness.format_tables(results, task_list))
    if plot_path:
        from ..eval.plot import plot

        plot(results, plot_path)
        click.echo(f"plot: {plot_path}")
    click.echo(f"results: {out}")


@click.command("bench")
@_with(common)
@click.option("--contexts", type=Counts(1), default="1000,2000,4000", show_default=True)
@click.option("--repeats", type=Count(1), default=3, show_default=True)
@click.option("--decode-tokens", type=Count(1), default=32, show_default=True)
@user_errors
def bench(
    model,
    arms,
    budgets,
    prefill_step_size,
    text,
    max_kv_bytes,
    out,
    force,
    contexts,
    repeats,
    decode_tokens,
):
    """Prefill/decode tok/s, KV bytes and peak memory vs unpatched mlx-lm.

    Peaks are mlx's, above the memory in use before the prompt (the weights),
    during the prefill (chunks of --prefill-step-size) and the decode apart."""
    from ..eval import bench as bench_mod
    from ..eval.runinfo import run_info, write_results
    from ..loading import models

    arm_list, skipped = _check_arms(_arms(arms, budgets, max_kv_bytes))
    refuse_existing(force, out=out)
    for s in skipped:
        click.echo(f"skipped {s['arm']}: {s['reason']}", err=True)
    info = run_info()
    loaded, tokenizer = models.load(model)
    with _progress(len(contexts) * repeats, "repeats") as bar:
        raw, table = bench_mod.run(
            loaded,
            tokenizer,
            arm_list,
            contexts,
            repeats=repeats,
            decode_tokens=decode_tokens,
            step=prefill_step_size,
            text=text,
            tick=lambda: bar.update(1),
        )
    write_results(
        out,
        {
            "run": info,
            "config": _config(),
            "skipped": skipped,
            "table": table,
            "raw": raw,
        },
    )
    click.echo(bench_mod.format_table(table))
    click.echo(f"results: {out}")
