"""Markdown tables (family x budget) from `veloxpatch eval` results files.

.venv/bin/python scripts/results_markdown.py scripts/results/eval_passkey.json
"""

from __future__ import annotations

import json
import sys


def short(family: str) -> str:
    # calibration files make long labels: keep the file's name only
    if "filters=" in family:
        head, path = family.split("filters=", 1)
        return f"{head}filters={path.rsplit('/', 1)[-1]}"
    return family


def grid(table, cell) -> list[str]:
    budgets = sorted({t["budget"] for t in table if t["budget"] is not None})
    families = list(dict.fromkeys(t["family"] for t in table))
    lines = [
        "| arm | " + " | ".join(str(b) for b in budgets) + " | no budget |",
        "|---|" + "---|" * (len(budgets) + 1),
    ]
    for fam in families:
        by = {t["budget"]: t for t in table if t["family"] == fam}
        cells = [cell(by[b]) if b in by else "" for b in budgets]
        cells.append(cell(by[None]) if None in by else "")
        lines.append(f"| `{short(fam)}` | " + " | ".join(cells) + " |")
    return lines


def main():
    for path in sys.argv[1:]:
        res = json.load(open(path))
        print(f"<!-- {path} -->")
        if "passkey" in res:
            print(
                "\n".join(
                    grid(
                        res["passkey"]["table"],
                        lambda t: f"{t['correct']}/{t['cases']}",
                    )
                )
            )
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
