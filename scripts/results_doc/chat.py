"""The chat benchmark (scripts/bench_chat.py): multi-turn conversations and
users sharing a document, through the server with mlx-lm's prompt cache on.
No section until scripts/results/bench_chat.json exists."""

from __future__ import annotations

import results_markdown as rm
from results_markdown import load, meta, table

NAME = "bench_chat"


def _ci(p: dict) -> str:
    if not p["cases"]:
        return "-"
    lo, hi = p["wilson95"]
    return f"{p['correct']}/{p['cases']} [{lo:.2f}, {hi:.2f}]"


def _mb(v) -> str:
    return "-" if v is None else f"{v / 1e6:.1f}"


def _prompt_cache(r: dict) -> str:
    """veloxpatch serve logs the prompt cache's bytes; mlx-lm's server only in
    hundredths of a GB (marked ~)."""
    if r.get("prompt_cache_bytes_max") is not None:
        return _mb(r["prompt_cache_bytes_max"])
    if r.get("prompt_cache_gb_max") is not None:
        return f"~{r['prompt_cache_gb_max'] * 1000:.0f}"
    return "-"


def _s(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def _tokens(r: dict) -> str:
    cached, prompt = r["cached_tokens_turn2_median"], r["prompt_tokens_turn2_median"]
    if cached is None:
        return "-"
    return f"{cached:,.0f} of {prompt:,.0f}"


def chat_bench() -> list[str]:
    if not (rm.RESULTS / f"{NAME}.json").exists():
        return []  # not run yet
    res = load(NAME)
    cfg, rows = res["config"], res["table"]
    ok = [r for r in rows if "error" not in r]
    body = []
    for r in rows:
        if "error" in r:
            why = r["error"].splitlines()[0].replace("|", "/")
            body.append([f"`{r['arm']}`", f"failed: {why}"] + [""] * 8)
            continue
        body.append(
            [
                f"`{r['arm']}`",
                _ci(r["needle_second_turn2_code"]),
                _ci(r["needle_first_turn1_code"]),
                _mb(r["kv_bytes_per_conversation"]),
                _mb(r["full_kv_bytes_per_conversation"]),
                _prompt_cache(r),
                _s(r["ttft_turn1_s_median"]),
                _s(r["ttft_turn2_s_median"]),
                _tokens(r),
                f"{r['cross_user_same']}/{r['pairs']}",
            ]
        )
    depths = sorted({d for r in ok for d in r["needle_second_by_depth"]}, key=float)
    by_depth = [
        [f"`{r['arm']}`"]
        + [
            _count(r["needle_second_by_depth"][d])
            if d in r["needle_second_by_depth"]
            else ""
            for d in depths
        ]
        for r in ok
    ]
    notes = []
    for r in ok:
        extra = []
        if r["turn2_reused_turn1"] < r["conversations"]:
            extra.append(
                f"turn 2 reused all of turn 1 from the prompt cache in "
                f"{r['turn2_reused_turn1']} of {r['conversations']} conversations"
            )
        if r["needle_second_key_in_summary"]:
            k = r["needle_second_turn2_code_key_not_in_summary"]
            extra.append(
                f"{r['needle_second_key_in_summary']} summaries gave the number "
                f"away (turn 2 without them: {_ci(k)})"
            )
        if r["summary_same"] < r["pairs"]:
            why = ""
            if r["arm"].startswith("kivi"):  # quantized rows, nothing evicted
                why = (
                    " (the second user's question reads the document's rows "
                    "quantized when the first user's cache is reused, exact in "
                    "a fresh prefill)"
                )
            extra.append(
                f"the summary differed by order for "
                f"{r['pairs'] - r['summary_same']} of {r['pairs']} documents{why}"
            )
        if extra:
            notes.append(f"`{r['arm']}`: " + "; ".join(extra))
    return [
        "## Chat: conversations and users sharing a document, through the server",
        "",
        f"{cfg['conversations']} documents of ~{cfg['context_tokens']:,} tokens of "
        f"`{cfg['text']}` prose, each with a five-digit secret number at a depth "
        f"cycling through {', '.join(map(str, cfg['depths']))}, sent to the "
        "server as OpenAI chat messages (no system message, greedy, streamed) "
        "with mlx-lm's prompt cache on, a fresh server per arm and order. "
        "*Needle second*: turn 1 asks for a one-sentence summary, its reply goes "
        "back as the assistant message, turn 2 asks for the number. *Needle "
        "first*: turn 1 asks for the number (a cold request), turn 2 for the "
        "summary. A number counts when its digits appear in the reply. KV MB is "
        "what a conversation's caches held after turn 2 and full KV MB what "
        "mlx-lm's cache would have held (the servers' log lines); prompt cache "
        "MB the most the "
        "prompt cache held when a request arrived (~: mlx-lm's log, in hundredths "
        "of a GB); TTFT and cached tokens are medians over both orders. "
        f"*Cross-user*: for the first {_documents(cfg['cross_user'])} two users "
        "send the document with one question each as fresh single-turn "
        "requests, in both orders (a fresh server per order); the column counts "
        "documents whose answer to the number was identical either way. A "
        "server that hands one user's question-specific compression to another "
        "(a prompt-cache entry trimmed back to the shared document) fails it.",
        "",
        meta(NAME, res),
        "",
        *table(
            [
                "arm",
                "needle second: number at turn 2",
                "needle first: number at turn 1",
                "KV MB/conversation",
                "full KV MB",
                "prompt cache MB",
                "TTFT turn 1 s",
                "TTFT turn 2 s",
                "turn-2 tokens cached",
                "cross-user same",
            ],
            body,
        ),
        "",
        "Needle second, by depth of the number:",
        "",
        *table(["arm", *depths], by_depth),
        "",
        "```bash",
        res["command"],
        *[a["command"] for a in res.get("added", [])],
        "```",
        "",
        *[
            f"Added with `--add` (the same documents and settings): "
            f"`{a['arms']}` at commit `{a['run']['git_commit']}`" + _load(a["run"])
            for a in res.get("added", [])
        ],
        *([""] if res.get("added") else []),
        *([("; ".join(notes) + "."), ""] if notes else []),
        *turn1_probe(),
        *kept_cache(),
    ]


def _load(run: dict) -> str:
    """The run's load average as it started: its timings are comparable with
    the others' only on a quiet machine."""
    load = run.get("load_average")
    if not load or load[0] < 1.0:  # 2 CPUs: 1 is another job on one of them
        return "."
    return (
        f" (load average {load[0]:.1f} as it started, CPUs shared with another "
        "run: its TTFT is not comparable)."
    )


PROBE = "chat_turn1_probe"
PROBE_TAIL0 = "chat_turn1_probe_tail0"  # kvzap without its tail queries


def turn1_probe() -> list[str]:
    """The first turn outside the server, with and without the passkey intro."""
    out = []
    for name in (PROBE, PROBE_TAIL0):
        if not (rm.RESULTS / f"{name}.json").exists():
            continue
        res = load(name)
        cfg = res["config"]
        rows = {}
        for r in res["table"]:
            rows.setdefault(r["arm"], {})[r["intro"]] = _ci(r)
        body = [[f"`{a}`", v.get(False, ""), v.get(True, "")] for a, v in rows.items()]
        intro = (
            "The number asked at turn 1, outside the server "
            "(`scripts/chat_turn1_probe.py`: the same first messages through "
            "`mlx_lm.stream_generate` in one process, the arms at "
            f"{cfg['budget']} rows), as sent and with the passkey cases' intro "
            '("There is a secret number hidden inside a long text...") ahead of '
            "the document:"
            if name == PROBE
            else "kvzap without `tail` (32 by default: the prompt's newest queries "
            "also rank the rows; its rows in the table above), the same messages:"
        )
        out += [
            intro,
            "",
            meta(name, res),
            "",
            *table(["arm", "as sent", "with the intro"], body),
            "",
            "```bash",
            f"python scripts/chat_turn1_probe.py --arms {cfg['arms']} "
            f"--out scripts/results/{name}.json",
            "```",
            "",
        ]
    return out


KEPT = "chat_kept_cache"


def kept_cache() -> list[str]:
    """The same conversations through one prompt cache kept across turns."""
    if not (rm.RESULTS / f"{KEPT}.json").exists():
        return []
    res = load(KEPT)
    cfg = res["config"]
    served = {r["arm"]: r for r in load("bench_chat")["table"]}
    rows = {}
    for r in res["table"]:
        rows.setdefault(r["arm"], {})[r["order"]] = _ci(r)
    body, losses = [], []
    for a, v in rows.items():
        s = served.get(a.removesuffix(f":budget={cfg['budget']}"))
        server = "" if s is None else _count(s["needle_second_turn2_code"])
        turns = [v.get("needle_second", ""), v.get("needle_first", "")]
        body.append([f"`{a}`", *turns, server])
        kept = next(
            r for r in res["table"] if (r["arm"], r["order"]) == (a, "needle_second")
        )
        if s and kept["correct"] < s["needle_second_turn2_code"]["correct"]:
            losses.append(
                f"`{a}` {_count(kept)} at turn 2 in a kept cache against "
                f"{server} through the server"
            )
    return [
        "The same conversations without the server, as a chat loop over "
        "`mlx_lm.stream_generate` runs them (`scripts/chat_kept_cache.py`): one "
        "prompt cache kept across the turns, holding turn 1's generated tokens, "
        "turn 2 appending only the template's text after the reply. The arms "
        f"at {cfg['budget']} rows, patched with the tokenizer (kvzip "
        "reconstructs turn 2 with the answer before it, since `d50d1f6`). A kept "
        "cache is compressed for good at turn 1's end; the server keeps each "
        "prompt's uncompressed snapshot and compresses the whole history again "
        "at turn 2 (its turn-2 numbers from the table above, the same "
        "documents):",
        "",
        meta(KEPT, res),
        "",
        *table(
            ["arm", "number at turn 2", "number at turn 1", "the server: at turn 2"],
            body,
        ),
        "",
        "```bash",
        f"python scripts/chat_kept_cache.py --arms {cfg['arms']} "
        f"--out scripts/results/{KEPT}.json",
        "```",
        "",
        *(
            [
                f"**Loss:** {'; '.join(losses)}: what turn 1 evicted is gone. A "
                "chat whose later turns ask what the first did not needs the "
                "uncompressed prompt kept, as the server's prompt cache keeps it, "
                "or a larger budget.",
                "",
            ]
            if losses
            else []
        ),
    ]


def _documents(n: int) -> str:
    return "document" if n == 1 else f"{n} documents"


def _count(p: dict) -> str:
    return f"{p['correct']}/{p['cases']}"
