"""Draw quality against KV bytes (the points and frontiers of the results doc's
"Quality against KV bytes" section) as an SVG, with no plotting library.

    .venv/bin/python scripts/pareto_plot.py   # scripts/results/pareto_agnostic.svg
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_doc.pareto import PLOT, frontier, points  # noqa: E402
from results_markdown import RESULTS  # noqa: E402

W, H, PAD = 460, 340, 56  # one panel
COLORS = {False: "#1f77b4", True: "#ff7f0e"}  # veloxpatch, mlx-lm


def panel(x0, pts, full_mb, title, higher, log):
    vals = [p["value"] for p in pts]
    if log:
        lo = math.log10(max(min(v for v in vals if v > 0), 1e-5))
        hi = math.log10(max(vals))
        ymap = lambda v: (math.log10(max(v, 10**lo)) - lo) / (hi - lo or 1)  # noqa: E731
    else:
        ymap = lambda v: v  # noqa: E731

    def xy(p):
        x = x0 + PAD + p["mb"] / full_mb * (W - 1.5 * PAD)
        y = H - PAD - ymap(p["value"]) * (H - 1.6 * PAD)
        return x, y

    out = [
        f'<text x="{x0 + W / 2}" y="20" text-anchor="middle" font-size="14">'
        f"{title}</text>",
        f'<line x1="{x0 + PAD}" y1="{H - PAD}" x2="{x0 + W - PAD / 2}" y2="{H - PAD}" '
        'stroke="black"/>',
        f'<line x1="{x0 + PAD}" y1="{H - PAD}" x2="{x0 + PAD}" y2="{PAD / 2}" '
        'stroke="black"/>',
        f'<text x="{x0 + W / 2}" y="{H - 16}" text-anchor="middle" font-size="12">'
        f"KV MB held (full cache {full_mb:.1f} MB)</text>",
    ]
    for frac in (0.25, 0.5, 0.75, 1.0):
        x = x0 + PAD + frac * (W - 1.5 * PAD)
        out.append(
            f'<text x="{x}" y="{H - PAD + 14}" text-anchor="middle" font-size="10">'
            f"{frac * full_mb:.0f}</text>"
        )
    ticks = [0, 0.5, 1.0]
    if log:
        ticks = [10**e for e in range(math.floor(lo), math.ceil(hi) + 1)]
    for t in ticks:
        _, y = xy({"mb": 0, "value": t})
        if PAD / 2 <= y <= H - PAD:
            out.append(
                f'<text x="{x0 + PAD - 4}" y="{y + 3}" text-anchor="end" '
                f'font-size="10">{t:g}</text>'
            )
    for side in (False, True):
        mine = [p for p in pts if p["mlx"] == side]
        for p in mine:
            x, y = xy(p)
            out.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{COLORS[side]}" '
                f'fill-opacity="0.5"><title>{p["label"]}</title></circle>'
            )
        front = [xy(p) for p in frontier(mine, higher)]
        if front:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in front)
            out.append(
                f'<polyline points="{path}" fill="none" stroke="{COLORS[side]}" '
                'stroke-width="2"/>'
            )
    return out


def main():
    body = []
    for i, (metric, title, higher, log) in enumerate(
        (
            ("passkey", "passkey accuracy, asked after compression", True, False),
            ("kl", "KL(full || arm), 256-token continuation (log)", False, True),
        )
    ):
        pts, full_mb = points(metric)
        body += panel(i * W, pts, full_mb, title, higher, log)
    legend = [
        f'<text x="{PAD}" y="{H + 14}" font-size="12" fill="{COLORS[False]}">'
        "veloxpatch (frontier: line)</text>",
        f'<text x="{PAD + 220}" y="{H + 14}" font-size="12" fill="{COLORS[True]}">'
        "mlx-lm caches (frontier: line)</text>",
    ]
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{H + 24}" '
        'font-family="sans-serif">\n<rect width="100%" height="100%" fill="white"/>\n'
        + "\n".join(body + legend)
        + "\n</svg>\n"
    )
    out = RESULTS / PLOT
    out.write_text(svg)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
