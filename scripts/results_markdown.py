"""Markdown beside results files: every benchmark the README cites writes `X.md`
next to its `X.json` (what ran, when, and its table), through `write_beside`.

Re-make the table of committed results, with no new measurement (SCRIPT is the
script that wrote them, `eval` for `veloxpatch eval` and scripts/quality_*.py, `bench`
for `veloxpatch bench`):

    .venv/bin/python scripts/results_markdown.py bench_decode \\
        scripts/results/bench_decode.json
"""

from __future__ import annotations

import importlib
import json
import shlex
import sys
from pathlib import Path

PY = ".venv/bin/python"
# config entries a run records that are not command-line flags
NOT_FLAGS = {"added", "banned", "command", "depths", "system_message"}


def table(head: list[str], rows: list[list]) -> list[str]:
    def cell(c) -> str:
        return str(c).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]


def mb(nbytes) -> str:
    return "" if nbytes is None else f"{nbytes / 1e6:.1f}"


def count(r: dict) -> str:
    return f"{r['correct']}/{r['cases']}"


def run_line(res: dict) -> str:
    """Commit, date and versions the run recorded."""
    run = res.get("run", {})
    parts = []
    if "git_commit" in run:
        dirty = str(run.get("git_dirty")) == "True"
        dirty_note = " (uncommitted changes)" if dirty else ""
        parts.append(f"commit `{run['git_commit']}`{dirty_note}")
    if "time_utc" in run:
        parts.append(run["time_utc"][:10])
    if "mlx" in run:
        parts.append(f"mlx {run['mlx']}, mlx-lm {run.get('mlx_lm', '?')}")
    if "machine" in run:
        parts.append(run["machine"])
    return "Run: " + " · ".join(parts) + "." if parts else ""


def command(prog: str, cfg: dict, rename: dict | None = None) -> str:
    """The command rebuilt from the config the run recorded (its flags by name;
    `rename` maps a config key to a flag named otherwise)."""
    args = [prog]
    for key, value in cfg.items():
        if key in NOT_FLAGS or value is None or value is False or value == "":
            continue
        flag = "--" + (rename or {}).get(key, key).replace("_", "-")
        if value is True:
            args.append(flag)
        else:
            if isinstance(value, list):
                value = ",".join(str(v) for v in value)
            args.append(f"{flag} {shlex.quote(str(value))}")
    return " \\\n    ".join(args)


def write_beside(
    out, res: dict, title: str, body: list[str], prog: str, rename=None
) -> Path:
    """Write `out` with its suffix `.md`: title, run, command, then `body`."""
    path = Path(out).with_suffix(".md")
    cmd = res.get("command") or command(prog, res.get("config", {}), rename)
    lines = [f"# {title}", "", f"Results: [`{Path(out).name}`]({Path(out).name})."]
    lines += [run_line(res), "", "```bash", cmd, "```", "", *body, ""]
    path.write_text("\n".join(lines))
    return path


def grid(rows: list[dict], cell) -> list[str]:
    """One row per arm family, one column per budget (`veloxpatch eval` tables)."""
    budgets = sorted({r["budget"] for r in rows if r.get("budget") is not None})
    families = list(dict.fromkeys(r["family"] for r in rows))
    loose = any(r.get("budget") is None for r in rows)
    head = ["arm"] + [str(b) for b in budgets] + (["no budget"] if loose else [])
    out = []
    for fam in families:
        by = {r.get("budget"): r for r in rows if r["family"] == fam}
        keys = budgets + ([None] if loose else [])
        out.append([f"`{fam}`"] + [cell(by[b]) if b in by else "" for b in keys])
    return table(head, out)


def eval_markdown(res: dict) -> list[str]:
    """`veloxpatch eval`'s tasks: passkey answers and continuation KL/perplexity,
    arms against budgets."""
    body = []
    if "passkey" in res:
        body += ["Passkey answers right (KV MB held):", ""]
        cell = lambda r: f"{count(r)} ({r['kv_mb']:.1f})"  # noqa: E731
        body += grid(res["passkey"]["table"], cell) + [""]
    if "continuation" in res:
        rows = res["continuation"]["table"]
        for name, fmt in (("kl", "{:.4f}"), ("perplexity", "{:.2f}")):
            body += [f"Continuation {name}:", ""]
            body += grid(rows, lambda r, n=name, f=fmt: f.format(r[n])) + [""]
        body += ["KV MB:", ""] + grid(rows, lambda r: f"{r['kv_mb']:.1f}") + [""]
    return body


def unread_eval_options(cfg: dict) -> set[str]:
    """`veloxpatch eval` options none of a run's tasks reads: the results record
    every option, but the CLI refuses one typed for a task not asked for."""
    from veloxpatch.eval.tasks import TASKS

    asked = [t.strip() for t in str(cfg.get("tasks", "")).split(",")]
    read = {o for t in asked if t in TASKS for o in TASKS[t].options()}
    return {o for task in TASKS.values() for o in task.options()} - read


def eval_beside(out, res: dict) -> Path:
    prog = "veloxpatch eval"
    cfg = res.get("config", {})
    unread = unread_eval_options(cfg)
    shown = {**res, "config": {k: v for k, v in cfg.items() if k not in unread}}
    rename = {"plot_path": "plot"}  # the CLI flag is --plot
    return write_beside(out, shown, prog, eval_markdown(res), prog, rename)


def bench_beside(out, res: dict) -> Path:
    """`veloxpatch bench`: prefill and decode rates against unpatched mlx-lm in
    the same run (medians of the repeats), KV held and peaks."""
    rows = [
        [
            r["context"],
            f"`{r['arm']}`",
            f"{r['prefill_tok_per_s']:.1f}",
            f"{r['prefill_ratio']:.2f}",
            f"{r['decode_tok_per_s']:.2f}",
            f"{r['decode_ratio']:.2f}",
            mb(r["kv_bytes"]),
            mb(r["peak_memory_bytes"]),
        ]
        for r in res["table"]
    ]
    head = ["context", "arm", "prefill tok/s", "vs unpatched", "decode tok/s"]
    body = table(head + ["vs unpatched", "KV MB", "peak MB"], rows)
    return write_beside(out, res, "veloxpatch bench", body, "veloxpatch bench")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: results_markdown.py SCRIPT RESULTS.json...", file=sys.stderr)
        return 2
    script, files = argv[0], argv[1:]
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        print(f"no such results file: {', '.join(missing)}", file=sys.stderr)
        return 2
    if script in ("eval", "bench"):
        write = eval_beside if script == "eval" else bench_beside
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        write = importlib.import_module(script).write_markdown
    for f in files:
        print(write(f, json.loads(Path(f).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
