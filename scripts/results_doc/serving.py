"""The serving benchmark: `veloxpatch serve` against mlx-lm's own server code on
the same model, 1 to N concurrent long-prompt chat requests."""

from __future__ import annotations

from results_markdown import load, meta, table

BASE = "mlx_lm_unpatched"


def serve_bench() -> list[str]:
    res = load("bench_serve")
    cfg = res["config"]
    rows = res["table"]
    at = {(r["arm"], r["concurrency"]): r for r in rows}
    levels = sorted({r["concurrency"] for r in rows})
    lo, hi = levels[0], levels[-1]

    def mb(v):
        return "-" if v is None else f"{v / 1e6:.1f}"

    body = [
        [
            f"`{r['arm']}`",
            str(r["concurrency"]),
            f"{r['aggregate_tokens_per_s']:.2f}",
            f"{r['ttft_s_median']:.1f}",
            mb(r["kv_bytes_per_request"]),
            mb(r["full_kv_bytes_per_request"]),
            mb(r["peak_rss_bytes"]),
            "yes" if r["batched"] else "no",
        ]
        for r in rows
    ]
    notes = []
    for top in dict.fromkeys([4 if 4 in levels else hi, hi]):
        base_gain = (
            at[(BASE, top)]["aggregate_tokens_per_s"]
            / at[(BASE, lo)]["aggregate_tokens_per_s"]
        )
        for arm in dict.fromkeys(r["arm"] for r in rows):
            if arm == BASE or (arm, top) not in at or (arm, lo) not in at:
                continue
            r, r1 = at[(arm, top)], at[(arm, lo)]
            gain = r["aggregate_tokens_per_s"] / r1["aggregate_tokens_per_s"]
            vs = r["aggregate_tokens_per_s"] / at[(BASE, top)]["aggregate_tokens_per_s"]
            held = r["kv_bytes_per_request"] or 0
            full = r["full_kv_bytes_per_request"] or 1
            notes.append(
                f"`{arm}` at {top} requests: {vs:.2f}x mlx-lm's aggregate tokens/s, "
                f"{held / full:.0%} of a full cache's KV bytes, gain {lo}->{top} "
                f"requests {gain:.2f}x ({gain / base_gain:.2f} of mlx-lm's "
                f"{base_gain:.2f}x)"
            )
    return [
        "## Serving: `veloxpatch serve` against mlx-lm's server",
        "",
        f"{'/'.join(map(str, levels))} concurrent streamed chat requests, each a "
        f"~{cfg['prompt_tokens']:,}-token prompt of evaluation prose and "
        f"{cfg['max_tokens']} generated tokens, a fresh server per arm and level "
        "(mlx-lm's own server code on the same embedded model for "
        f"`{BASE}`). Aggregate tokens/s counts generated tokens over the wave's "
        "wall time (prefill included); KV bytes are what each request held at "
        "its end, from the servers' log lines; peak RSS is the server process's.",
        "",
        meta("bench_serve", res),
        "",
        *table(
            [
                "arm",
                "requests",
                "agg tok/s",
                "TTFT s",
                "KV MB/request",
                "full KV MB",
                "peak RSS MB",
                "batched",
            ],
            body,
        ),
        "",
        "    .venv/bin/python scripts/bench_serve.py "
        f"--concurrency {cfg['concurrency']} "
        f"--prompt-tokens {cfg['prompt_tokens']} --max-tokens {cfg['max_tokens']} "
        f"--out {cfg['out']}",
        "",
        "; ".join(notes) + ".",
        "",
    ]
