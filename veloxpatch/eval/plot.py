"""Quality against budget, one line per arm family (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path

from ..errors import VeloxpatchError

PANELS = (
    ("passkey", "accuracy", "passkey accuracy"),
    ("continuation", "kl", "KL(full || arm), lower is better"),
    ("continuation", "agreement", "greedy agreement with full"),
)


def _algorithm(family: str) -> str:
    """The algorithm a family stands for: `veloxquant.tova` and `tova:window=8`
    are both tova, drawn in one colour (peers dashed)."""
    name = family.split(":")[0]
    return name.split(".", 1)[1] if name.startswith("veloxquant.") else name


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


def check_path(path: str) -> None:
    """`--plot`'s file, before any work: matplotlib is installed and the suffix
    names a format it writes (without one it would write `path.png`)."""
    require()
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    if Path(path).suffix.lstrip(".").lower() not in formats:
        raise VeloxpatchError(
            f"--plot must end in a format matplotlib writes "
            f"({', '.join('.' + f for f in sorted(formats))}), got {path!r}"
        )


def plot(results: dict, path: str) -> None:
    plt = require()
    panels = [p for p in PANELS if p[0] in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2))
    axes = [axes] if len(panels) == 1 else list(axes)
    colours = {}
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
                cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
                algo = _algorithm(family)
                colour = colours.setdefault(algo, cycle[len(colours) % len(cycle)])
                ax.plot(
                    [r["budget"] for r in with_budget],
                    [r[key] for r in with_budget],
                    "--o" if peer else "-o",
                    color=colour,
                    mfc="white" if ":" in family and not peer else colour,
                    label=family if len(family) < 40 else family[:37] + "...",
                )
            elif key == "kl" and rows[0][key] <= 0:
                continue  # full's KL is 0: no place on a log axis
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
        if key == "kl":
            ax.set_yscale("log")
    fig.tight_layout()
    # outside the panels: a dozen families would hide the lines
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
