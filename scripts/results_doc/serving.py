"""The serving benchmark: `veloxpatch serve` against mlx-lm's own server code on
the same model, 1 to N concurrent long-prompt chat requests."""

from __future__ import annotations

from statistics import median

import results_markdown as rm
from results_markdown import PY, command, load, meta, table

# what the bench scripts' commands are rebuilt from (their recorded config)
SERVE_KEYS = ["concurrency", "prompt_tokens", "max_tokens", "arms", "out"]
SHARED_KEYS = ["documents", "users", "seed", "system_tokens", "max_tokens", "arms"]
SHARED_KEYS += ["out"]

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
        *command(f"{PY} scripts/bench_serve.py", cfg, SERVE_KEYS),
        "",
        "; ".join(notes) + ".",
        "",
    ]


def shared_system() -> list[str]:
    res = load("bench_shared_system")
    before = load("bench_shared_system_before")
    cfg = res["config"]
    rows = res["table"] + [{**r, "arm": f"{r['arm']} before"} for r in before["table"]]
    arms = list(dict.fromkeys(r["arm"] for r in rows))

    def span(values):
        lo, hi = min(values), max(values)
        return f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"

    body, later_of = [], {}
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        later = median([u["ttft_s"] for r in mine for u in r["users"][1:]])
        cached = [u["cached_tokens"] for r in mine for u in r["users"][1:]]
        prompt = [u["prompt_tokens"] for r in mine for u in r["users"][1:]]
        later_of[arm] = later
        body.append(
            [
                f"`{arm}`",
                f"{median([r['ttft_s_first'] for r in mine]):.1f}",
                f"{later:.2f}",
                f"{span(cached)} of {span(prompt)}",
                f"{sum(r['number_correct'] for r in mine)}/{len(mine)}",
            ]
        )
    notes = []
    pairs = [("kvzip", "kvzip before"), ("kvzip_compressed_system", "kvzip before")]
    pairs += [("kvzip_compressed_system", "full")]
    for arm, other in pairs:
        if arm in later_of and other in later_of:
            notes.append(
                f"later users' TTFT, `{arm}` against `{other}`: "
                f"{later_of[arm] / later_of[other]:.2f}x"
            )
    return [
        "## Users sharing a system prompt, through the server",
        "",
        f"{cfg['documents']} documents of ~{cfg['system_tokens']:,} tokens of "
        "evaluation prose with a five-digit secret number (the chat benchmark's "
        "documents) sent as the system message, each to a fresh server per arm, "
        f"by {cfg['users']} users one after another with questions of their own; "
        "the last user asks for the number (greedy, "
        f"{cfg['max_tokens']} tokens). TTFT: the first user's and the later users' "
        "(medians over documents); cached: usage's cached_tokens of the later "
        "users. `kvzip` is served one request at a time; `kvzip before` is the "
        "same run at the commit before the server kept a system prompt's entry "
        "for such requests (this script copied into it: its uncommitted change). "
        "`kvzip_compressed_system` is `--compress-system-prompt`. kvzip at its "
        "default budget (256).",
        "",
        meta("bench_shared_system", res),
        "",
        meta("bench_shared_system_before", before),
        "",
        *table(
            [
                "arm",
                "TTFT first user s",
                "TTFT later users s",
                "later users' cached tokens",
                "number (last user)",
            ],
            body,
        ),
        "",
        *command(f"{PY} scripts/bench_shared_system.py", cfg, SHARED_KEYS),
        "",
        "; ".join(notes) + ".",
        "",
        *shared_system_quality(),
    ]


def shared_system_quality() -> list[str]:
    """The number asked for by a second user, over more documents: kvzip's
    compression with the question (the default) or of the system prompt alone,
    and `full`, from every bench_shared_system_quality*.json."""
    found = sorted(rm.RESULTS.glob("bench_shared_system_quality*.json"))
    names = [p.stem for p in found]
    if not names:
        return []
    from veloxpatch.eval.passkey import wilson

    runs = [load(n) for n in names]
    cfg = runs[0]["config"]
    rows = [{**r, "seed": res["config"]["seed"]} for res in runs for r in res["table"]]
    body = []
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        right = sum(r["number_correct"] for r in mine)
        lo, hi = wilson(right, len(mine))
        missed = [
            f"{r['seed']}:{r['document']}" for r in mine if not r["number_correct"]
        ]
        body.append(
            [
                f"`{arm}`",
                f"{right}/{len(mine)} [{lo:.2f}, {hi:.2f}]",
                ", ".join(missed) or "-",
            ]
        )
    seeds = {}
    for res in runs:
        c = res["config"]
        for arm in c["arms"].split(","):
            seeds.setdefault(arm, []).append(f"{c['seed']} ({c['documents']})")
    which = "; ".join(f"`{a}` {', '.join(s)}" for a, s in seeds.items())
    lines = [
        f"The number on other documents, {cfg['users']} users each (one question, "
        f"then the number); seeds of bench_chat's documents (their count): {which}:",
        "",
    ]
    for name, res in zip(names, runs):
        lines += [meta(name, res), ""]
    lines += table(["arm", "number (last user)", "documents missed (seed:index)"], body)
    lines.append("")
    for res in runs:
        prog = f"{PY} scripts/bench_shared_system.py"
        lines += [*command(prog, res["config"], SHARED_KEYS), ""]
    return lines
