"""Quality against KV bytes, question-agnostic, every arm ours and mlx-lm's: the
frontier of each side and the best configuration at each memory point. The
points are also what `scripts/pareto_plot.py` draws."""

from __future__ import annotations

import results_markdown as rm
from results_markdown import LINK, load, short, table

PASSKEY = (
    "passkey_agnostic",
    "passkey_agnostic_kvzip",
    "passkey_kvzip_choice_tail",
    "passkey_agnostic_bytes",
    "passkey_rotated",  # rotated low-bit rows (issue 30), once run
    "passkey_rotated_lean",
    "passkey_rotated_sinks",  # kv_sinks 1 by default with kv_rotate since
    "passkey_kvzap_bytes",  # kvzap 4-bit at kvzip's rows under mlx-lm's bytes
)
# later files replace an arm of earlier ones (kvzip:budget=256 decodes since 4257d75)
KL_FILES = (
    "ppl_agnostic",
    "ppl_agnostic_decode",
    "ppl_kvzip_choice_tail",
    "ppl_agnostic_bytes",
    "ppl_rotated_bytes",
    "ppl_rotated_sinks",  # the rotated KIVI rows again, with their default sink
    "ppl_kvzap_bytes",
)
FRACTIONS = (0.05, 0.10, 0.17, 0.25, 0.50)  # of the full cache's bytes
PLOT = "pareto_agnostic.svg"


def present(names) -> list[str]:
    return [n for n in names if (rm.RESULTS / f"{n}.json").exists()]


def mlx_side(label: str) -> bool:
    return label.startswith("mlx.") or label == "unpatched"


def points(metric: str) -> tuple[list[dict], float]:
    """[{label, mb, value, mlx}] and full's MB. passkey: accuracy (later files
    replace an arm of earlier ones); kl: KL(full || arm) of the continuation.
    mlx.rotating's buffer holds the whole prompt until its first decode step:
    it is placed at its steady size, as the continuation run measures it."""
    kl = {
        t["arm"]: t
        for name in present(KL_FILES)
        for t in load(name)["continuation"]["table"]
    }
    full_mb = kl["full"]["kv_mb"]
    if metric == "kl":
        rows = {a: (t["kv_mb"], t["kl"]) for a, t in kl.items() if a != "full"}
    else:
        rows = {}
        for name in present(PASSKEY):
            for t in load(name)["passkey"]["table"]:
                if t["arm"] == "full":
                    full_mb = t["kv_mb"]  # the passkey contexts' own full cache
                    continue
                mb = t["kv_mb"]
                if t["family"] == "mlx.rotating" and t["arm"] in kl:
                    mb = kl[t["arm"]]["kv_mb"]
                rows[t["arm"]] = (mb, t["accuracy"], t["correct"], t["cases"])
    out = []
    for label, (mb, value, *n) in rows.items():
        out.append(
            {"label": short(label), "mb": mb, "value": value, "mlx": mlx_side(label)}
            | ({"n": n} if n else {})
        )
    return sorted(out, key=lambda p: p["mb"]), full_mb


def frontier(pts: list[dict], higher: bool) -> list[dict]:
    """Points no other point beats at fewer or equal bytes."""
    best, out = None, []
    sign = -1 if higher else 1
    for p in sorted(pts, key=lambda p: (p["mb"], sign * p["value"])):
        if best is None or (p["value"] > best if higher else p["value"] < best):
            best = p["value"]
            out.append(p)
    return out


def best_at(pts, limit, higher):
    fit = [p for p in pts if p["mb"] <= limit]
    if not fit:
        return None
    pick = max if higher else min
    return pick(fit, key=lambda p: p["value"])


def _cell(p, metric):
    if p is None:
        return "none fits"
    v = f"{p['n'][0]}/{p['n'][1]}" if metric == "passkey" else f"{p['value']:.4f}"
    return f"`{p['label']}` {v} ({p['mb']:.1f} MB)"


def pareto() -> list[str]:
    lines = [
        "## Quality against KV bytes (question-agnostic)",
        "",
        "Every arm of the agnostic runs on evaluation prose (~1,500-token "
        "contexts): passkey answers from "
        + ", ".join(f"[`{n}.json`]({LINK}/{n}.json)" for n in present(PASSKEY))
        + " and KL(full ‖ arm) of a 256-token continuation from "
        + ", ".join(f"[`{n}.json`]({LINK}/{n}.json)" for n in present(KL_FILES))
        + ", against the KV bytes held after the context "
        "is compressed (mlx.rotating at its steady size: its buffer holds the "
        "whole prompt until its first decode step). The best configuration that "
        "fits each memory point, ours and mlx-lm's; a point on a side's frontier "
        f"is beaten by nothing of that side at fewer bytes. Plot: [{PLOT}]"
        f"({LINK}/{PLOT}) (`scripts/pareto_plot.py`). "
        + (
            "The rotated KIVI rows' KL is from `ppl_rotated_sinks`, with the sink "
            "`kv_rotate` has by default."
            if "ppl_rotated_sinks" in present(KL_FILES)
            else "The rotated KIVI rows of `ppl_rotated_bytes` ran before "
            "`kv_sinks` was 1 by default with `kv_rotate` (without sinks)."
        ),
        "",
    ]
    for metric, higher, what in (
        ("passkey", True, "passkey answers"),
        ("kl", False, "KL"),
    ):
        pts, full_mb = points(metric)
        rows = []
        for f in FRACTIONS:
            limit = f * full_mb
            ours = best_at([p for p in pts if not p["mlx"]], limit, higher)
            theirs = best_at([p for p in pts if p["mlx"]], limit, higher)
            memory = f"{f:.0%} ({limit:.1f} MB)"
            rows.append([memory, _cell(ours, metric), _cell(theirs, metric)])
        lines += [
            f"Best {what} within each memory point (full cache {full_mb:.1f} MB):",
            "",
            *table(["memory", "veloxpatch", "mlx-lm"], rows),
            "",
        ]
        for side, name in ((False, "veloxpatch"), (True, "mlx-lm")):
            front = frontier([p for p in pts if p["mlx"] == side], higher)
            lines.append(
                f"{name} frontier ({what}): "
                + ", ".join(_cell(p, metric) for p in front)
                + "."
            )
        lines.append("")
    return lines
