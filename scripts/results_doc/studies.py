"""Sections from the scoring studies: the A2ATS codebook and Q-Filters ranks."""

from __future__ import annotations

from statistics import mean

from results_markdown import (
    CODEBOOK,
    REGEN_CODEBOOK,
    by_key,
    command,
    count,
    load,
    meta,
    table,
)
from results_markdown import span as _span

PY = ".venv/bin/python"
BOOK_KEYS = ["sizes", "tokens", "segments", "context", "queries", "window"]
BOOK_KEYS += ["sinks", "top", "far_position", "seed", "save", "out"]


def a2ats_codebook() -> list[str]:
    res, ceil = load("a2ats_codebook"), load("a2ats_ceiling")
    cfg, rows = res["config"], res["rows"]
    pairs = [
        (a, p)
        for a in rows
        if a["query_aware"]
        for p in rows
        if not p["query_aware"] and p["size"] == a["size"]
    ]
    body = [
        [
            r["size"],
            "query-aware" if r["query_aware"] else "I (plain k-means)",
            f"{r['recall_windowed']:.3f}",
            f"{r['recall_exact']:.3f}",
            f"{r['error']:.3f}",
        ]
        for r in rows
    ]
    head = ["centroids per KV head", "H", "recall of windowed far logits"]
    head += ["recall of exact attention", "error"]

    def wins(key, better):
        return [
            sum(better(x[key], y[key]) for x, y in zip(a["per_layer"], p["per_layer"]))
            for a, p in pairs
        ]

    layers = len(rows[0]["per_layer"])
    win_w = wins("recall_windowed", lambda x, y: x > y)
    win_e = wins("error", lambda x, y: x < y)
    win_x = wins("recall_exact", lambda x, y: x > y)
    per_layer = [x["ceiling"] for x in ceil["ceiling"]["per_layer"]]
    a2 = by_key(load("eval_a2ats_passkey")["passkey"]["table"])
    book = f"a2ats:codebook={CODEBOOK}"
    recalls = [r["recall_windowed"] for r in rows if r["query_aware"]]
    return [
        "## A2ATS: does the codebook find the keys attention needs?",
        "",
        f"`scripts/a2ats_codebook.py` calibrates codebooks on {cfg['tokens']:,} "
        f"tokens of the calibration half and scores {cfg['segments']} held-out "
        f"{cfg['context']:,}-token stretches of evaluation prose, with the last "
        f"{cfg['queries']} queries of each stretch and w = {cfg['window']}, "
        f"b = {cfg['far_position']}, {cfg['sinks']} sinks. Recall is the share of "
        f"the true top {cfg['top']:.0%} far keys that the codebook's top "
        f"{cfg['top']:.0%} finds; error is E[(q̃·(k − c))²] / E[(q̃·k)²]. Each "
        f"number is the mean over queries, heads and the {layers} layers (per "
        "layer in the JSON). The ceiling run ranks far keys by the exact ⟨q̃, k⟩, "
        "a perfect codebook.",
        "",
        meta("a2ats_codebook", res),
        "",
        meta("a2ats_ceiling", ceil),
        "",
        *table(head, body),
        "",
        *command(f"{PY} scripts/a2ats_codebook.py", cfg, BOOK_KEYS),
        "",
        *command(
            f"{PY} scripts/a2ats_codebook.py",
            ceil["config"],
            BOOK_KEYS,
            keep=("sizes", "save"),
        ),
        "",
        "The first command also saves the 256-centroid codebook the evaluation "
        "runs use. " + REGEN_CODEBOOK,
        "",
        "- Against what the codebook approximates, ⟨q̃, k⟩, the query-aware "
        f"assignment wins in {_span(win_w, '{}')} of {layers} layers at every "
        "size (error lower in "
        f"{_span(win_e, '{}')}): recall "
        f"{_span([a['recall_windowed'] - p['recall_windowed'] for a, p in pairs])}, "
        f"error × {_span([a['error'] / p['error'] for a, p in pairs], '{:.2f}')}.",
        "- Against exact attention the gain is small: recall "
        f"{_span([a['recall_exact'] - p['recall_exact'] for a, p in pairs])}, "
        f"winning in {_span(win_x, '{}')} of {layers} layers. The method itself "
        "caps it: even a perfect codebook finds only "
        f"**{ceil['ceiling']['ceiling']:.3f}** of exact attention's top "
        f"{cfg['top']:.0%} ({_span(per_layer, '{:.2f}')} by layer). Rotating "
        "every far key to one position b discards where it is, and SmolLM2's "
        "attention depends on it.",
        "- **Size.** The evaluations use 256 centroids on SmolLM2, not the "
        "paper's 4,096. Its head dim is 64, and 8,192 calibration keys per head "
        "give 32 keys per centroid at 256, 8 at 1,024 and 2 at 4,096 (memorised, "
        "not clustered). The lookup table costs 9 × C × 64 multiply-adds per "
        "layer and decode step: at C = 4,096 that is as much as full attention "
        "over a 4,096-token context, which removes the point of retrieving. "
        f"Recall grows slowly with size ({', '.join(f'{x:.2f}' for x in recalls)}) "
        "while k-means time and table cost grow linearly. `--codebook-size` "
        "defaults to 4,096 for the larger head dims the paper used.",
        f"- Passkey: retrieving the top 3% by exact far scores finds the key in "
        f"{count(a2['a2ats'])} cases; the 256-centroid codebook at 3% in "
        f"{count(a2[book])}, at 10% in {count(a2[book + ',top=0.1'])}, with "
        "windowed attention in "
        f"{count(a2['a2ats:attention=windowed,codebook=' + CODEBOOK])}. The "
        "retrieval rule is not the problem here; the codebook's approximation of "
        "far scores is. A needle that only the question attends to is exactly "
        "the key a 256-centroid code blurs.",
        "",
    ]


def qfilters_rank() -> list[str]:
    res = load("qfilters_rank")
    cfg, t = res["config"], res["table"]
    names = {
        "calibrated": "calibrated Q-Filters (`veloxpatch calibrate`, 4,096 "
        "calibration-half tokens)",
        "on_the_fly": "on-the-fly Q-Filters (the prompt's own queries, read from "
        "the `qfilters` cache)",
        "knorm": "key L2 norm (`knorm`'s signal, negated)",
    }
    body = [
        [
            names[k],
            f"{t[k]['mean_spearman']:+.3f}",
            f"{t[k]['share_heads_positive']:.0%}",
            " / ".join(f"{mean(s[k]):.2f}" for s in res["raw"]),
        ]
        for k in names
    ]
    head = ["signal", "mean Spearman", "heads with ρ > 0", "per stretch"]
    vq = by_key(load("eval_vs_veloxquant")["continuation"]["table"])
    f = "filters=scripts/results/smollm2_qfilters.safetensors"

    def kls(arm):
        return " / ".join(
            f"{vq[f'qfilters:budget={b}{arm}']['kl']:.3f}" for b in (128, 256, 512)
        )

    return [
        "## Q-Filters: does the filter rank keys by the attention they get?",
        "",
        f"`scripts/qfilters_rank.py` on SmolLM2: {cfg['segments']} "
        f"{cfg['context']:,}-token stretches of evaluation prose, the post-RoPE "
        "keys of every layer, and as ground truth the mean softmax attention "
        f"each key receives from the last {cfg['later']} real queries (all query "
        "heads of its GQA group). Spearman rank correlation between that truth "
        "and each key-only signal, per layer and KV head (keys older than those "
        "queries, sinks excluded), averaged over layers, KV heads and stretches.",
        "",
        meta("qfilters_rank", res),
        "",
        *table(head, body),
        "",
        *command(
            f"{PY} scripts/qfilters_rank.py",
            cfg,
            ["filters", "context"] + ["later", "segments", "out"],
        ),
        "",
        "The calibrated filters beat the key-norm signal by a wide margin on "
        "every stretch. Orientation: on the 3,000 calibration queries per head, "
        "the share projecting positively on their own head's filter rounded to "
        "1.00 in every layer (the calibration run printed the per-layer minimum; "
        "`veloxpatch calibrate` prints the per-head minimum), and "
        "`tests/test_smollm.py` checks a majority for every layer and head. In "
        "the continuation comparison with veloxquant the two modes are close "
        f"(KL at 128 / 256 / 512: {kls(',' + f)} with the file, {kls('')} on the "
        "fly); the file's advantage is memory: it evicts during prefill, while "
        "the on-the-fly mode holds the whole prompt until it ends. Calibration "
        "took 6 minutes here (4,096 tokens through the float32 model, shared "
        "CPUs).",
        "",
    ]
