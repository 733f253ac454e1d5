"""Peak memory per phase against context length (scripts/bench_memory.py's
multi-context run): shown once its results file exists."""

from __future__ import annotations

import results_markdown as rm
from results_markdown import LINK, PY, command, load, meta, short, table

NAME = "bench_memory_peak"
# 8,192 tokens again, unpatched and snapkv's two modes, after the attention tiles
RERUN = "bench_memory_peak_8192"
TRAINED = 8192  # SmolLM2's trained context: beyond it, memory and speed only
CHUNKED = ("compress", "chunk")  # the options a prompt-end twin lacks
KEYS = ["arms", "contexts", "decode_tokens", "prefill_step_size", "out"]


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.1f}"


def _x(part: float, whole: float) -> str:
    return f"{part / whole:.2f}x" if whole else ""


def _rss(r: dict) -> str:
    got = [r.get("peak_rss_prefill_mb"), r.get("peak_rss_decode_mb")]
    return " / ".join("?" if v is None else f"{v:,.0f}" for v in got)


def _row_bytes(base: dict) -> float | None:
    """Bytes of one token's KV over every layer: unpatched's KV at the first
    token over the rows mlx-lm allocated (multiples of 256)."""
    if not base:
        return None
    return base["kv_bytes_prefill_end"] / (-(-base["context"] // 256) * 256)


LAYERS = 30  # SmolLM2's, the model these runs use
# cut back after every call: while one layer attends a prefill chunk, the others
# hold their budget (one layer's chunk over all layers is step / LAYERS rows)
EVERY_CALL = ("h2o", "tova", "keyformer", "knorm", "streaming_llm")
PROMPT_END = ("snapkv", "pyramidkv", "adakv", "expected_attention", "qfilters", "kvzip")


def _bound(arm: str, context: int, step: int) -> int | None:
    """The rows per layer an arm says it holds at most while reading the
    prompt: budget + chunk where it cuts every chunk (compress="chunks",
    kvzap), budget plus one layer's share of a prefill chunk where it cuts
    after every call, the whole prompt where it compresses at the prompt's
    end; None where rows are not what it bounds (quantized)."""
    name, _, rest = arm.partition(":")
    opts = dict(o.partition("=")[::2] for o in rest.split(",") if o)
    budget = int(opts["budget"]) if "budget" in opts else None
    if name in ("unpatched", "full"):
        return context
    if name == "mlx.rotating":
        return budget
    if budget is None or "kv_bits" in opts or name.startswith("mlx."):
        return None
    if opts.get("compress") == "chunks" or name == "kvzap":
        return budget + int(opts.get("chunk", 512))
    if name in EVERY_CALL:
        return budget + -(-step // LAYERS)
    if name == "kvzip":  # its reconstruction adds one repeated chunk of the context
        return context + min(int(opts.get("chunk", 2048)), context)
    return context if name in PROMPT_END else None


def _table(rows: list[dict], step: int = 512) -> list[str]:
    base = next((r for r in rows if r["arm"] == "unpatched" and "error" not in r), {})
    row_bytes = _row_bytes(base)
    head = ["arm", "prefill peak", "vs unpatched", "decode peak", "KV at first token"]
    head += ["KV at the end", "peak KV", "its rows", "bound", "rows / bound"]
    head += ["peak RSS prefill / decode"]
    head += ["prefill s", "decode tok/s"]
    body = []
    for r in rows:
        if "error" in r:
            error = r["error"].splitlines()[0].replace("|", "\\|")[:160]
            body.append([f"`{short(r['arm'])}`", f"failed: {error}"] + [""] * 11)
            continue
        rows_held = r["kv_peak_bytes"] / row_bytes if row_bytes else None
        bound = _bound(r["arm"], r["context"], step)
        body.append(
            [
                f"`{short(r['arm'])}`",
                _mb(r["prefill_peak_bytes"]),
                _x(r["prefill_peak_bytes"], base.get("prefill_peak_bytes", 0)),
                _mb(r["decode_peak_bytes"]),
                _mb(r["kv_bytes_prefill_end"]),
                _mb(r["kv_bytes"]),
                _mb(r["kv_peak_bytes"]),
                "" if rows_held is None else f"{rows_held:,.0f}",
                "" if bound is None else f"{bound:,}",
                "" if None in (bound, rows_held) else f"{rows_held / bound:.2f}",
                _rss(r),
                f"{r['prefill_seconds']:,.1f}",
                f"{r['decode_tok_s']:.2f}",
            ]
        )
    return table(head, body)


def _chunked(rows: list[dict]) -> list[str]:
    """For each compress=chunks arm at the longest context both modes ran: its
    prefill peak against its prompt-end twin's and unpatched's."""
    ok = {r["arm"]: r for r in rows if "error" not in r}
    base = ok.get("unpatched")
    out = []
    for arm, r in ok.items():
        if "compress=chunks" not in arm:
            continue
        name, _, opts = arm.partition(":")
        rest = [o for o in opts.split(",") if o.partition("=")[0] not in CHUNKED]
        twin = ok.get(f"{name}:{','.join(rest)}" if rest else name)
        parts = []
        if twin is not None:
            parts.append(
                f"{_x(r['prefill_peak_bytes'], twin['prefill_peak_bytes'])} "
                f"its prompt-end mode's ({_mb(twin['prefill_peak_bytes'])} MB)"
            )
        if base is not None:
            parts.append(
                f"{_x(r['prefill_peak_bytes'], base['prefill_peak_bytes'])} "
                f"`unpatched`'s, its peak KV "
                f"{_x(r['kv_peak_bytes'], base['kv_peak_bytes'])}"
            )
        if parts:
            out.append(
                f"- `{short(arm)}` peaks at {_mb(r['prefill_peak_bytes'])} MB during "
                f"the prefill: {' and '.join(parts)}; prefill "
                f"{r['prefill_seconds']:,.1f} s"
                + (
                    f" against {twin['prefill_seconds']:,.1f} s."
                    if twin is not None
                    else "."
                )
            )
    return out


def peak_memory() -> list[str]:
    if not (rm.RESULTS / f"{NAME}.json").exists():
        return []
    res = load(NAME)
    cfg, rows = res["config"], res["rows"]
    step = cfg.get("prefill_step_size")
    contexts = sorted({r["context"] for r in rows})
    beyond = [c for c in contexts if c > TRAINED]
    lines = [
        "## Peak memory per phase against context length",
        "",
        "`scripts/bench_memory.py`: each arm at each context length in its own "
        f"process prefills evaluation prose through mlx-lm's `generate_step` in "
        f"chunks of **{step:,} tokens** (`prefill_step_size`), then decodes "
        f"{cfg['decode_tokens']} greedy tokens. Peaks are mlx's "
        "(`mx.get_peak_memory()` after `mx.reset_peak_memory()`), above the "
        "memory in use before the prompt (the weights): the prefill's up to the "
        "first token out, the decode's after it. MB are 10^6 bytes. Peak RSS "
        "(VmHWM, reset per phase; MB of 2^20 bytes) is the whole process's, "
        "weights included; the allocator keeps pages, so the decode's rarely "
        "falls below the prefill's. Peak KV is the most KV bytes held at once "
        "(ours read after every attention call, before any cut back), its rows "
        "those bytes over one token's KV in every layer (unpatched's; ours hold "
        "each row's position too). The bound is the rows per layer an arm "
        "says it holds at most while reading the prompt: budget + chunk where it "
        "cuts every chunk (`compress=chunks`, `kvzap`), budget plus one layer's "
        "share of a prefill chunk where it cuts after every call (only one layer "
        "attends at a time), the whole prompt where it compresses at the "
        "prompt's end (kvzip: plus the repeated chunk its reconstruction "
        "attends with), heads padded to the largest and the positions it stores "
        "count in its bytes. "
        "`unpatched` is mlx-lm with the model's own "
        "caches, `mlx.rotating` its RotatingKVCache, `mlx.quantized` its "
        "QuantizedKVCache from the first token.",
        "",
    ]
    if beyond:
        lines += [
            f"SmolLM2 was trained on {TRAINED:,} tokens: at "
            f"{', '.join(f'{c:,}' for c in beyond)} only memory and speed are "
            "measured, no quality is claimed.",
            "",
        ]
    lines += [meta(NAME, res), ""]
    if (rm.RESULTS / f"{NAME}.svg").exists():
        lines += [
            f"![peak memory above the weights against context length, one line "
            f"per arm]({LINK}/{NAME}.svg)",
            "",
        ]
    # the comparison of modes at the longest context the model was trained for
    note_at = max([c for c in contexts if c <= TRAINED] or contexts[:1])
    for context in contexts:
        mine = [r for r in rows if r["context"] == context]
        lines += [
            f"### {context:,} tokens, prefill chunk {step:,}",
            "",
            *_table(mine, step),
            "",
        ]
        if context == note_at and (notes := _chunked(mine)):
            lines += notes + [""]
    lines += [
        *_bench_command(cfg),
        "",
    ]
    for more in cfg.get("added", []):
        run = more["run"]
        lines += [
            f"Added (commit `{run.get('git_commit', '?')[:7]}`):",
            "",
            *_bench_command({**cfg, **more}, add=True),
            "",
        ]
    return lines + _rerun()


def _bench_command(cfg: dict, add: bool = False) -> list[str]:
    """The bench_memory.py command a run's configuration records."""
    prog = f"{PY} scripts/bench_memory.py" + (" --add" if add else "")
    return command(prog, cfg, KEYS, rename={"prefill_step_size": "prefill_step"})


def _rerun() -> list[str]:
    """The 8,192-token rerun, the last part of the peak-memory section."""
    if not (rm.RESULTS / f"{RERUN}.json").exists():
        return []
    res = load(RERUN)
    cfg, rows = res["config"], res["rows"]
    step = cfg.get("prefill_step_size")
    return [
        f"### {', '.join(f'{c:,}' for c in sorted({r['context'] for r in rows}))} "
        "tokens again: `unpatched` and `snapkv`",
        "",
        "The same protocol, run again once long prompt calls attended in chained "
        "tiles of queries on the CPU (`4cb9230`, the next section) and caches "
        "evaluated what they rewrite as they go: every row above predates both "
        "(only these arms were rerun), and the README quotes these. KV bytes now "
        "count every array a cache keeps between calls (`d23e52e`; here "
        "SnapKV's window of queries, 2.2 MB), which the rows above did not: "
        "`its rows` over `bound`, which counts rows only, reads above 1.",
        "",
        meta(RERUN, res),
        "",
        *_table(rows, step),
        "",
        *_chunked(rows),
        "",
        *_bench_command(cfg),
        "",
    ]


def attention_tiles() -> list[str]:
    name = "bench_attention_tiles"
    if not (rm.RESULTS / f"{name}.json").exists():
        return []
    res = load(name)
    cfg = res["config"]
    body = [
        [
            f"`{r['arm']}`",
            r["mode"],
            f"{r['queries']:,} x {r['rows_against']:,}",
            _mb(r["peak_bytes"]),
            f"{r['seconds']:.2f}" if "seconds" in r else "",
        ]
        for r in res["rows"]
    ]
    return [
        "## Attention in tiles of queries",
        "",
        "`scripts/bench_attention_tiles.py`: where veloxpatch computes attention "
        "probabilities itself (H2O's and Keyformer's accumulated attention, "
        "kvzip's reconstruction), it takes them a tile of queries at a time "
        "(at most 2^22 float32 logits), each evaluated before the next. On the "
        "CPU, where mlx's fused attention materialises a call's scores, every "
        "cache but `full` (which stays mlx-lm's call, bit for bit) also runs a "
        "long call's fused attention in tiles of at most 2^20 scores, each over "
        "the rows its queries can see and chained after the previous "
        "(`attention_math.fused_attention`); `kivi` reads its quantized rows "
        "dequantized once. `one piece` turns both off. One "
        "layer of SmolLM2's shape, random inputs, mlx's peak above the memory "
        "in use before the call and the call's seconds (median of "
        f"{cfg['repeats']}, each in a process of its own): `h2o` and `keyformer` "
        f"at budget 512, `snapkv` (nothing evicted: the fused attention alone) "
        f"and `kivi:bits=4`, the last {cfg['chunk']:,}-query chunk of a "
        f"{cfg['context']:,}-token prompt; `kvzip`, one {cfg['chunk']:,}-query "
        f"repeat chunk against a {cfg['context']:,}-row context.",
        "",
        meta(name, res),
        "",
        *table(["arm", "tiles", "queries x rows", "peak MB", "seconds"], body),
        "",
        *command(
            f"{PY} scripts/bench_attention_tiles.py", cfg, ["context", "chunk", "out"]
        ),
        "",
    ]


# earlier runs of the same command, newest first, and what changed since each
LONG_PROMPT_KV_BITS_BEFORE = {
    "10dd4e9": (
        "Before the rows kept by a compression were copied out of what it read "
        "(`b55e6d9`) and each layer's prompt-end compression was evaluated as it "
        "ran (`98215fa`), the residual left by regrouping quantized rows was a "
        "slice of all of them dequantized, which kept that copy alive between "
        "calls, and at the prompt's end every layer's regrouping was held at once. "
        "The same command; `unpatched` as above."
    ),
    "81dd46d": (
        "Before the CPU's fused attention ran in tiles, the quantized rows' "
        "prompt chunks were read through an [L, slots] mask, many query rows "
        "went through mlx's quantized kernels and a cut during the prompt was "
        "evaluated only at the caller's step end. The same command (the "
        "uncommitted change is the newer `scripts/long_prompt.py`, for its "
        "arms); `unpatched` as above."
    ),
}


def long_prompt() -> list[str]:
    before = [f"long_prompt_kv_bits_{c}" for c in LONG_PROMPT_KV_BITS_BEFORE]
    names = ["long_prompt", "long_prompt_kv_bits", *before]
    return [line for name in names for line in _long_prompt(name)]


def _long_prompt(name: str) -> list[str]:
    if not (rm.RESULTS / f"{name}.json").exists():
        return []
    res = load(name)
    cfg, rows = res["config"], res["table"]
    base = next((r for r in rows if r["arm"] == "unpatched"), None)
    body = [
        [
            f"`{r['arm']}`",
            f"{r['prompt_tokens']:,}",
            _mb(r["peak_bytes"]),
            _x(r["peak_bytes"], base["peak_bytes"]) if base else "",
            _mb(r["kv_held_bytes"]),
            f"{r['prefill_tok_s']:.1f}",
        ]
        for r in rows
    ]
    title = "## A prompt past the model's context through `veloxpatch generate`"
    quantized = []
    if name == "long_prompt_kv_bits":
        title = "## A long prompt at the same bytes, quantized rows"
        quantized = [
            "The `kv_bits` arms hold the same bytes as more rows (4-bit, and "
            "2-bit with `kv_rotate=hadamard`): the rows attended grow with them, "
            "and with them the attention's share of the peak and its time. "
            "tok/s: one run each, on a CPU shared with other work.",
            "",
        ]
    elif name.startswith("long_prompt_kv_bits_"):
        title = f"### The same at commit `{res['run']['git_commit']}`"
        quantized = [LONG_PROMPT_KV_BITS_BEFORE[name.rsplit("_", 1)[1]], ""]
    return [
        title,
        "",
        f"`scripts/long_prompt.py`: {cfg['tokens']:,} tokens of evaluation prose "
        "and a question, each arm a `veloxpatch generate` command in its own "
        f"process (prefill chunk {cfg['prefill_step']}; `unpatched` is mlx-lm's "
        "`stream_generate` with its own cache, measured the same way). The peak is "
        "what the stats line prints: mlx's peak above the memory in use before the "
        "prompt, MB of 10^6 bytes. SmolLM2 was trained on 8,192 tokens: only "
        "memory and speed are claimed here. `snapkv` arms run under "
        f"`--max-kv-bytes {cfg['max_kv_bytes']}`; the chunked one with "
        f"`compress=chunks,chunk={cfg['chunk']}`.",
        "",
        meta(name, res),
        "",
        *table(
            ["arm", "prompt tokens", "peak MB", "vs unpatched", "KV held MB", "tok/s"],
            body,
        ),
        "",
        *quantized,
        *_missing_arms(cfg, rows),
        *command(
            f"{PY} scripts/long_prompt.py",
            cfg,
            ["tokens", "prefill_step", "chunk", "max_kv_bytes", "arms", "out"],
        ),
        "",
    ]


def _missing_arms(cfg: dict, rows: list[dict]) -> list[str]:
    """The arms the command named that the file has no row for."""
    missing = [a for a in cfg["arms"].split(",") if a not in {r["arm"] for r in rows}]
    if not missing:
        return []
    names = ", ".join(f"`{a}`" for a in missing)
    return [f"Not measured: {names} (the run ended before it finished).", ""]
