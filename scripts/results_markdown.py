"""Markdown from results files: family x budget tables for `veloxpatch eval`
results, and the helpers `make_results_doc.py` builds docs/results.md with.

.venv/bin/python scripts/results_markdown.py scripts/results/eval_passkey.json
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "scripts" / "results"
PY = ".venv/bin/python"  # how the results pages write a script's command
# docs/results.md links to the results files relative to itself
LINK = "../scripts/results"
# the A2ATS runs' codebook is generated, not committed
CODEBOOK = "scripts/results/smollm2_a2ats_256.safetensors"
REGEN_CODEBOOK = (
    f"The codebook `{CODEBOOK}` is not committed (13 MB); make it first with "
    f"`veloxpatch calibrate --algo a2ats --tokens 8192 --codebook-size 256 --out "
    f"{CODEBOOK}`."
)


LOADED: set[str] = set()  # which results files the document has used


def load(name: str) -> dict:
    LOADED.add(name)
    return json.loads((RESULTS / f"{name}.json").read_text())


# the old quality_ppl.py's continuation columns, by their `veloxpatch eval` names
_OLD_PPL = {"perplexity": "perplexity_mean", "agreement": "agreement_mean"}
_OLD_PPL |= {"kl": "kl_mean"}


def part_of(res: dict, task: str) -> dict:
    """The `task` ("passkey" or "continuation") part of a results file, with
    `table`, `raw` and (passkey) `smallest_budget_for_90pct_of_full`, in
    `veloxpatch eval`'s schema, from either that schema ({task: {...}}) or that
    of the scripts before they called it (one task, its table at the top, ppl
    columns named perplexity_mean, ..., kv_bytes)."""
    if task in res:
        return res[task]
    if task != "continuation":
        return res
    table = [
        {**r, **{new: r[old] for new, old in _OLD_PPL.items()}}
        | {"kv_mb": r["kv_bytes"] / 1e6}
        for r in res["table"]
    ]
    return {**res, "table": table}


def table_of(res: dict, task: str) -> list[dict]:
    return part_of(res, task)["table"]


def short(family: str) -> str:
    # calibration files make long labels: keep the file's name only
    for key in ("filters=", "codebook=", "scorer="):
        while f"{key}scripts/results/" in family:
            family = family.replace(f"{key}scripts/results/", key)
    return family


def split_arm(arm: str) -> tuple[str, int | None]:
    """'knorm:budget=256,recent=64' -> ('knorm:recent=64', 256)."""
    name, _, opts = arm.partition(":")
    rest, budget = [], None
    for kv in filter(None, opts.split(",")):
        if kv.startswith("budget="):
            budget = int(kv.split("=", 1)[1])
        else:
            rest.append(kv)
    return (f"{name}:{','.join(rest)}" if rest else name), budget


def grid(table, cell, label=None) -> list[str]:
    """One row per family, one column per budget, plus a 'no budget' column."""
    label = label or (lambda fam: f"`{short(fam)}`")
    budgets = sorted({t["budget"] for t in table if t["budget"] is not None})
    families = list(dict.fromkeys(t["family"] for t in table))
    unbudgeted = any(t["budget"] is None for t in table)
    head = [str(b) for b in budgets] + (["no budget"] if unbudgeted else [])
    lines = ["| arm | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for fam in families:
        by = {t["budget"]: t for t in table if t["family"] == fam}
        cells = [cell(by[b]) if b in by else "" for b in budgets]
        if unbudgeted:
            cells.append(cell(by[None]) if None in by else "")
        lines.append(f"| {label(fam)} | " + " | ".join(cells) + " |")
    return lines


def table(head: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def by_key(rows: list[dict], key: str = "arm") -> dict:
    return {r[key]: r for r in rows}


def count(r: dict) -> str:
    return f"{r['correct']}/{r['cases']}"


def wilson(r: dict) -> str:
    lo, hi = r["wilson95"]
    return f"{count(r)} [{lo:.2f}, {hi:.2f}]"


def ratio(r: dict) -> str:
    """Median ratio against unpatched with the repeats' range (bench tables)."""
    m, lo, hi = r["ratio_vs_unpatched_median"], r["ratio_min"], r["ratio_max"]
    return f"{m:.2f} [{lo:.2f}, {hi:.2f}]"


def span(values, fmt="{:+.3f}") -> str:
    """'lo to hi' of the formatted values, or one value when they agree."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo} to {hi}"


def mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f}"


def meta(name: str, res: dict) -> str:
    """One line of what the run recorded: file, commit, date, model, chunking."""
    run, cfg = res.get("run", {}), res.get("config", {})
    parts = [f"[`{name}.json`]({LINK}/{name}.json)"]
    if "git_commit" in run:
        dirty = " with uncommitted changes" if run.get("git_dirty") else ""
        parts.append(f"commit `{run['git_commit']}`{dirty}")
    if "time_utc" in run:
        parts.append(run["time_utc"][:10])
    if "model" in cfg:
        model = cfg["model"] or "embedded SmolLM2-135M-Instruct"
        parts.append(f"model {model}")
    if "prefill_step_size" in cfg:
        parts.append(f"prefill_step_size {cfg['prefill_step_size']}")
    if "mlx" in run:
        parts.append(f"mlx {run['mlx']}, mlx-lm {run.get('mlx_lm', '?')}")
    if "blas" in run:
        blas = run["blas"]
        parts.append("OpenBLAS" if blas.startswith("OpenBLAS") else blas)
    return "Run: " + " · ".join(parts) + "."


def unread_eval_options(cfg: dict) -> set[str]:
    """`veloxpatch eval` options that none of a run's tasks reads: results record
    every option, but the CLI refuses one typed for a task not asked for."""
    from veloxpatch.eval.tasks import TASKS

    asked = [t.strip() for t in str(cfg.get("tasks", "")).split(",")]
    read = {o for t in asked if t in TASKS for o in TASKS[t].options()}
    return {o for task in TASKS.values() for o in task.options()} - read


def command(prog: str, cfg: dict, keys: list[str], rename=None, keep=()) -> list[str]:
    """The command that wrote a results file, rebuilt from its recorded config
    (keys it did not record, None, empty strings not in `keep`, and eval
    options its tasks do not read are left out)."""
    rename = rename or {}
    unread = unread_eval_options(cfg) if prog == "veloxpatch eval" else set()
    args = []
    for key in keys:
        value = cfg.get(key)
        if value is None or (value == "" and key not in keep) or key in unread:
            continue
        flag = "--" + rename.get(key, key).replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not False:
            args.append(f"{flag} {shlex.quote(str(value))}")
    body = " \\\n    ".join([prog, *args])
    return ["```bash", body, "```"]


def main():
    for path in sys.argv[1:]:
        res = json.load(open(path))
        print(f"<!-- {path} -->")
        if "passkey" in res:
            print("\n".join(grid(res["passkey"]["table"], count)))
            print()
        if "continuation" in res:
            t = res["continuation"]["table"]
            for name, fmt in (
                ("perplexity", "{:.2f}"),
                ("kl", "{:.3f}"),
                ("agreement", "{:.2f}"),
            ):
                print(f"{name}:")
                print("\n".join(grid(t, lambda r, n=name, f=fmt: f.format(r[n]))))
                print()


if __name__ == "__main__":
    main()
