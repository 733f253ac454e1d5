"""Quality against budget, one line per arm family (matplotlib, optional)."""

from __future__ import annotations

from ..errors import VeloxpatchError

PANELS = (
    ("passkey", "accuracy", "passkey accuracy"),
    ("continuation", "perplexity", "perplexity"),
    ("continuation", "agreement", "greedy agreement with full"),
)


def require():
    """pyplot, or a clear error when the optional matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise VeloxpatchError(
            "--plot needs matplotlib: pip install 'veloxpatch[plot]'"
        ) from None
    return plt


def plot(results: dict, path: str) -> None:
    plt = require()
    panels = [p for p in PANELS if p[0] in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2))
    axes = [axes] if len(panels) == 1 else list(axes)
    for ax, (task, key, title) in zip(axes, panels):
        table = results[task]["table"]
        families = {}
        for t in table:
            families.setdefault(t["family"], []).append(t)
        for family, rows in families.items():
            with_budget = sorted(
                (r for r in rows if r["budget"]), key=lambda r: r["budget"]
            )
            if with_budget:
                peer = "." in family.split(":")[0] or family == "unpatched"
                ax.plot(
                    [r["budget"] for r in with_budget],
                    [r[key] for r in with_budget],
                    "--o" if peer else "-o",
                    label=family,
                )
            else:  # no budget (full, unpatched, mlx.quantized): a reference line
                ax.axhline(rows[0][key], linestyle=":", color="gray")
                ax.annotate(
                    family,
                    (0.01, rows[0][key]),
                    xycoords=("axes fraction", "data"),
                    fontsize=7,
                    color="gray",
                )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (KV rows per head)")
        ax.set_title(title)
        if key == "perplexity":
            ax.set_yscale("log")
    axes[-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
