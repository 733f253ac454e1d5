"""Sections from the speed and memory benches (scripts/bench_*.py)."""

from __future__ import annotations

from results_markdown import (
    CODEBOOK,
    REGEN_CODEBOOK,
    by_key,
    command,
    load,
    mb,
    meta,
    ratio,
    short,
    table,
)

PY = ".venv/bin/python"
BOOK = f"a2ats:codebook={CODEBOOK}"


def memory() -> list[str]:
    res = load("bench_memory")
    cfg, rows = res["config"], by_key(res["rows"])
    full, k2, k4 = rows["full"], rows["kivi:bits=2"], rows["kivi:bits=4"]
    m4 = rows["mlx.quantized:kv_bits=4"]
    s, s4 = rows["snapkv:budget=512"], rows["snapkv:budget=512,kv_bits=4"]
    weights = full["weights_mb"]

    def above(r):
        return r["mlx_peak_decode_mb"] - r["weights_mb"]

    head = ["arm", "mlx peak during decode", "of which above the weights"]
    head += ["process RSS during decode", "KV held at the end", "decode tok/s"]
    body = [
        [
            f"`{r['arm']}`",
            f"{r['mlx_peak_decode_mb']:,.1f} MB",
            f"{above(r):.1f} MB",
            f"{r['peak_rss_decode_mb']:,.1f} MB",
            f"{r['kv_mb_end']:.1f} MB",
            f"{r['decode_tok_s']:.2f}",
        ]
        for r in res["rows"]
    ]
    return [
        "## Memory during a long decode",
        "",
        f"`scripts/bench_memory.py`: each arm in its own process prefills the same "
        f"{cfg['context']:,}-token context through mlx-lm's `generate_step` "
        f"(prefill chunks of 2048), then decodes {cfg['decode_tokens']} tokens. "
        "mlx's peak allocation and the process's peak resident set are reset when "
        "the first token is out, after mlx's buffer cache is cleared, so they "
        f"cover the decode alone. Both include the {weights:.0f} MB of weights. "
        "The BLAS in the run line is the parent process's, which loads no model; "
        "each arm's process loads OpenBLAS.",
        "",
        meta("bench_memory", res),
        "",
        *table(head, body),
        "",
        *command(
            f"{PY} scripts/bench_memory.py",
            cfg,
            ["arms", "context"] + ["decode_tokens", "out"],
        ),
        "",
        f"- KIVI's decode peaks "
        f"{full['mlx_peak_decode_mb'] - k2['mlx_peak_decode_mb']:.0f} MB (2-bit) "
        f"and {full['mlx_peak_decode_mb'] - k4['mlx_peak_decode_mb']:.0f} MB "
        f"(4-bit) below `full`. Above the weights, that is "
        f"{above(k2) / above(full):.0%} and {above(k4) / above(full):.0%} of "
        "`full`'s.",
        f"- The rest above KIVI's KV (about {above(k2) - k2['kv_mb_end']:.0f} MB at "
        "2 bits) is one layer's keys and values dequantized for its attention "
        "call, with the intermediates of unpacking; it is freed after each layer.",
        "- mlx-lm's own 4-bit cache peaks lower than KIVI at 4 bits "
        f"({m4['mlx_peak_decode_mb']:.1f} against {k4['mlx_peak_decode_mb']:.1f} "
        "MB): it quantizes every token, so it has no full-precision residual "
        "(128-159 rows here), and its quantized matmul needs no dequantized copy.",
        f"- `kv_bits=4` on SnapKV's 512 rows cuts its KV from "
        f"{s['kv_mb_end']:.1f} to {s4['kv_mb_end']:.1f} MB.",
        "- Process RSS after a prefill keeps the prefill's high-water mark (the "
        "allocator does not give pages back), so it tells less than mlx's peak. "
        f"KIVI's RSS is still "
        f"{full['peak_rss_decode_mb'] - k2['peak_rss_decode_mb']:.0f} MB lower "
        "than `full`'s, because it quantizes during the prefill.",
        f"- **KIVI decodes slowly**: {k2['decode_tok_s'] / full['decode_tok_s']:.2f}x "
        f"and {k4['decode_tok_s'] / full['decode_tok_s']:.2f}x `full`'s rate (2 "
        "and 4 bits); see the next section.",
        "",
    ]


def _bench_rows(res, extra=()) -> list[list]:
    out = []
    for r in res["table"]:
        row = [f"`{short(r['arm'])}`", f"{r['decode_tok_per_s_median']:.2f}"]
        row += [ratio(r)] + [f"{r[k]:.2f}" for k in extra]
        out.append(row + [mb(r["kv_bytes"])])
    return out


BENCH_KEYS = ["context", "budget", "arms", "early", "decode_tokens", "repeats"]
BENCH_KEYS += ["prefill_step_size", "out"]


def decode_quantized() -> list[str]:
    quiet, noisy = (
        load("bench_decode_a2ats_kivi_quiet"),
        load("bench_decode_a2ats_kivi"),
    )
    q, n = by_key(quiet["table"]), by_key(noisy["table"])

    def r(t, arm):
        return t[arm]["ratio_vs_unpatched_median"]

    cfg = quiet["config"]
    head = ["arm", "tok/s", "vs unpatched [min, max]", "KV MB"]
    mem = by_key(load("bench_memory")["rows"])
    kivi_vs_full = [
        mem[f"kivi:bits={b}"]["decode_tok_s"] / mem["full"]["decode_tok_s"]
        for b in (2, 4)
    ]
    return [
        "## Decode speed of A2ATS and KIVI",
        "",
        f"`scripts/bench_decode.py` at a {cfg['context']:,}-token context: one "
        "captured prefill replayed into every arm, "
        f"{cfg['decode_tokens']} greedy tokens, {cfg['repeats']} interleaved "
        "repeats on a quiet machine, median ratio against `unpatched` in the same "
        "run with the repeats' range. `top` is 3% unless the arm says otherwise; "
        "`a2ats` without a codebook ranks far keys by their exact scores.",
        "",
        meta("bench_decode_a2ats_kivi_quiet", quiet),
        "",
        *table(head, _bench_rows(quiet)),
        "",
        *command(f"{PY} scripts/bench_decode.py", cfg, BENCH_KEYS),
        "",
        REGEN_CODEBOOK,
        "",
        f"An earlier run ({noisy['config']['decode_tokens']} tokens, "
        f"{noisy['config']['repeats']} repeats) on CPUs shared with two other jobs, "
        f"with `top=0.1` and `kivi:bits=4` as well, agrees: `a2ats` "
        f"{r(n, BOOK):.2f}, `top=0.1` {r(n, BOOK + ',top=0.1'):.2f}, `kivi` 2/4 "
        f"bits {r(n, 'kivi:bits=2'):.2f}/{r(n, 'kivi:bits=4'):.2f}.",
        "",
        meta("bench_decode_a2ats_kivi", noisy),
        "",
        *table(head, _bench_rows(noisy)),
        "",
        "These are losses:",
        "",
        f"- **A2ATS decodes slower than `full` here**: {r(q, BOOK):.2f}x "
        f"`unpatched` at 3%, against `full`'s {r(q, 'full'):.2f}x. On a 135M model "
        "on a CPU, attention over 4,000 keys is a small share of a decode step. "
        "Retrieval adds a score lookup, a top-k, gathers and per-row RoPE in 30 "
        "layers, which costs more than it saves. It could pay off only where "
        "attention dominates (long contexts on large models with big head dims); "
        "that is not measured here.",
        f"- **KIVI decodes 3 to 4 times slower than `full`**: "
        f"{r(q, 'kivi:bits=2'):.2f}x `unpatched` at 2 bits here, "
        f"{kivi_vs_full[0]:.2f}x and {kivi_vs_full[1]:.2f}x `full`'s rate (2 and 4 "
        "bits) in the memory run. Every step unpacks and dequantizes every "
        "quantized row in every layer: the price of holding a quarter of the "
        "memory without a full-precision copy. mlx-lm's quantized matmul would "
        "avoid it, but it groups along the wrong axis for KIVI's per-channel keys.",
        "",
    ]


def decode_eviction() -> list[str]:
    old, qa = load("bench_decode"), load("bench_decode_query_aware")
    t = by_key(qa["table"])
    snap = t["snapkv:budget=512"]["decode_tok_per_s_median"]
    extra = [
        1000 / t[f"{a}:budget=512"]["decode_tok_per_s_median"] - 1000 / snap
        for a in ("h2o", "tova", "keyformer")
    ]
    look = t["snapkv:budget=512,lookahead=16"]
    head = ["arm", "tok/s", "vs unpatched [min, max]", "KV MB"]
    head_qa = head[:3] + [
        f"first {qa['config']['early']} tok/s",
        "later tok/s",
        "KV MB",
    ]
    keys_old = ["context", "budget", "algos", "decode_tokens", "repeats"]
    return [
        "## Decode speed of the eviction algorithms",
        "",
        f"`scripts/bench_decode.py` at a {old['config']['context']:,}-token "
        f"context, budget {old['config']['budget']}: one captured prefill "
        "replayed into every arm, greedy tokens through mlx-lm's "
        "`generate_step`, median of interleaved repeats, ratio against unpatched "
        "mlx-lm (a plain KVCache holding the same context) in the same run.",
        "",
        meta("bench_decode", old),
        "",
        *table(head, _bench_rows(old)),
        "",
        *command(f"{PY} scripts/bench_decode.py", old["config"], keys_old + ["out"]),
        "",
        "This run predates H2O and TOVA attending with the fused kernel plus "
        "explicit probabilities. The second run below measures the query-aware "
        f"algorithms at commit `{qa['run']['git_commit']}`, with that change, and "
        "lookahead; it ran beside a perplexity "
        "job on the same two CPUs, so its absolute tok/s are lower (the ratios "
        "are paired per repeat).",
        "",
        meta("bench_decode_query_aware", qa),
        "",
        *table(
            head_qa,
            _bench_rows(qa, ("early_tok_per_s_median", "late_tok_per_s_median")),
        ),
        "",
        *command(f"{PY} scripts/bench_decode.py", qa["config"], BENCH_KEYS),
        "",
        "- H2O, TOVA and Keyformer pay for one explicit row of attention "
        "probabilities per step and head: "
        f"{min(extra):.0f}-{max(extra):.0f} ms per step here against `snapkv` at "
        "the same budget.",
        f"- Lookahead's first {qa['config']['early']} steps run below full-cache "
        f"speed ({look['early_tok_per_s_median']:.2f} tok/s, then "
        f"{look['late_tok_per_s_median']:.2f}): they attend the whole prompt, and "
        "the last of them also scores every prompt row with the window and answer "
        "queries to compress once.",
        "",
    ]


def overhead() -> list[str]:
    res = load("bench_overhead")
    cfg = res["config"]
    rows = []
    for phase in ("prefill", "decode"):
        p = res[phase]
        r = p["ratio_patched_over_unpatched"]
        rows.append(
            [
                phase,
                f"{p['unpatched_tok_per_s']['median']:.2f}",
                f"{p['patched_full_tok_per_s']['median']:.2f}",
                f"{r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]",
            ]
        )
    head = ["phase", "unpatched tok/s", "patched `full` tok/s", "ratio [min, max]"]
    keys = ["repeats", "prompt_tokens", "decode_tokens", "prefill_step_size", "out"]
    return [
        "## Overhead of the patch",
        "",
        "`scripts/bench_overhead.py`: unpatched mlx-lm against patched `full`, "
        f"{cfg['repeats']} paired repeats, each running both arms back to back "
        "(alternating which goes first) through mlx-lm's own `generate_step`, "
        f"{cfg['prompt_tokens']:,}-token prompt, {cfg['decode_tokens']}-token "
        "decode; median of the per-pair ratios patched / unpatched.",
        "",
        meta("bench_overhead", res),
        "",
        *table(head, rows),
        "",
        *command(f"{PY} scripts/bench_overhead.py", cfg, keys),
        "",
    ]


# the options of a `veloxpatch bench` results file its command is rebuilt from
BENCH_CLI_KEYS = [
    "arms",
    "budgets",
    "contexts",
    "repeats",
    "decode_tokens",
    "prefill_step_size",
]
SOFTMAX = "bench_softmax"
SOFTMAX_BEFORE, SOFTMAX_AFTER = "bench_scoring_softmax_before", "bench_scoring_softmax"


def softmax_cpu() -> list[str]:
    res = load(SOFTMAX)
    cfg = res["config"]
    rows = [[r["case"], f"{r['median_ms']:.1f}"] for r in res["table"]]
    out = [
        "## Softmax on the CPU",
        "",
        "`scripts/bench_softmax.py`: mlx's CPU exp is scalar on these x86 "
        "machines (AVX-512 present), numpy's vectorised: one tile of kvzip's "
        f"reconstruction ({cfg['tile'][0]} queries x {cfg['tile'][1]:,} rows in "
        "each of SmolLM2's 9 query heads), and one layer's causal attention of a "
        f"{cfg['chunk'][0]}-token prefill chunk over {cfg['chunk'][1]:,} rows. "
        "The scores that kvzip, H2O, TOVA, Keyformer, SnapKV's window and kvzap's "
        "`tail` compute take their softmax from `attention_math.softmax`, which "
        "on the CPU goes through numpy; the attention output itself stays mlx's "
        "fused kernel, as unpatched mlx-lm's (the last rows: written out with "
        f"numpy's exp it would be faster; not done). Median of {cfg['repeats']} "
        "interleaved repeats.",
        "",
        meta(SOFTMAX, res),
        "",
        *table(["case", "ms"], rows),
        "",
        *command(f"{PY} scripts/bench_softmax.py", cfg, ["repeats", "out"]),
        "",
    ]
    before, after = load(SOFTMAX_BEFORE), load(SOFTMAX_AFTER)
    old = {(r["arm"], r["context"]): r for r in before["table"]}
    rows = []
    for r in after["table"]:
        o = old.get((r["arm"], r["context"]))
        if o is None:
            continue
        rows.append(
            [
                f"`{r['arm']}`",
                f"{r['context']:,}",
                f"{o['prefill_tok_per_s']:.1f} ({o['prefill_ratio']:.2f}x)",
                f"{r['prefill_tok_per_s']:.1f} ({r['prefill_ratio']:.2f}x)",
            ]
        )
    return out + [
        "`veloxpatch bench` before (numpy's exp not used) and after, the same "
        "command; prefill tok/s through mlx-lm's generate_step to the first token "
        "and, in brackets, the median ratio to unpatched mlx-lm in the same run "
        "(`kvzip` reconstructs the prompt inside it).",
        "",
        meta(SOFTMAX_BEFORE, before),
        "",
        meta(SOFTMAX_AFTER, after),
        "",
        *table(["arm", "context", "before", "after"], rows),
        "",
        *command("veloxpatch bench", after["config"], BENCH_CLI_KEYS),
        "",
    ]
