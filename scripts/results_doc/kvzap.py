"""kvzap: its calibration, and the runs that compare it with kvzip and the
others (agnostic and in-prompt passkey, continuation KL, prefill cost, the
chat). Each part appears once its results file exists."""

from __future__ import annotations

import results_markdown as rm
from results_markdown import command, grid, load, meta, table, wilson

from .agnostic import KEYS as AGNOSTIC_KEYS
from .continuation import KEYS as KL_KEYS
from .speed import BENCH_CLI_KEYS

KEYS = [*AGNOSTIC_KEYS, "text"]

CALIBRATION = "kvzap_calibration"
CALIBRATION_39K = "kvzap_calibration_39k"  # the whole calibration prose
FIT_STUDY = "kvzap_fit_study"  # ridge on shares of the data, MLP variants
AGNOSTIC = "passkey_kvzap_agnostic"
LICENSES = "passkey_kvzap_licenses"
OPTIONS = "passkey_kvzap_options"
SIZES = "passkey_kvzap_calibration"
AWARE = "passkey_kvzap_aware"
AWARE_DEFAULT = "passkey_kvzap_aware_default"
KL_DEFAULT = "ppl_kvzap_default"
KL_LICENSES = "ppl_kvzap_licenses"
KL_DECODE = "ppl_kvzap_decode"
KL_DECODE_LICENSES = "ppl_kvzap_decode_licenses"
KL = "ppl_kvzap"
BENCH = "bench_kvzap"
BENCH_TAIL = "bench_kvzap_tail"
# `tail` (the prompt's newest queries also rank rows at each choice)
KL_TAIL = "ppl_kvzap_tail"
KL_TAIL_LICENSES = "ppl_kvzap_tail_licenses"
AWARE_TAIL = "passkey_kvzap_aware_tail"
AGNOSTIC_TAIL = "passkey_kvzap_agnostic_tail"
# the surrogates fitted on the whole calibration prose (39,936 tokens)
AGNOSTIC_39K = "passkey_kvzap_agnostic_39k"
AWARE_39K = "passkey_kvzap_aware_39k"
KL_39K = "ppl_kvzap_39k"
KL_39K_LICENSES = "ppl_kvzap_39k_licenses"
KL_MLP_39K = "ppl_kvzap_mlp_39k"
# surrogates fitted to KVzip's own scores (`calibrate --target kvzip`)
KL_TARGET_SELECTION = "ppl_kvzap_target_selection"  # where the target was chosen
KL_TARGET = "ppl_kvzap_target"
KL_TARGET_LICENSES = "ppl_kvzap_target_licenses"
AGNOSTIC_TARGET = "passkey_kvzap_target"
# 4-bit rows at the rows kvzip keeps under mlx-lm's 4-bit cache's bytes
AGNOSTIC_BYTES = "passkey_kvzap_bytes"
KL_BYTES = "ppl_kvzap_bytes"
# ten segments a prose, kvzip in the same run (the runs above have three)
KL_SEGMENTS = "ppl_kvzap_segments"
KL_SEGMENTS_LICENSES = "ppl_kvzap_segments_licenses"


def _have(name: str) -> bool:
    return (rm.RESULTS / f"{name}.json").exists()


def prefill_ratios() -> tuple[int | None, dict]:
    """(the longest context benched, each algorithm's prefill tok/s over
    unpatched's there): kvzap's from its run with `tail` once it exists."""
    if not _have(BENCH):
        return None, {}
    bench = load(BENCH)["table"]
    at = max(r["context"] for r in bench)
    pre = {r["algo"]: r["prefill_ratio"] for r in bench if r["context"] == at}
    if _have(BENCH_TAIL):
        tail = load(BENCH_TAIL)["table"]
        pre |= {
            r["algo"]: r["prefill_ratio"]
            for r in tail
            if r["context"] == at and r["algo"] == "kvzap"
        }
    return at, pre


def _run(name: str, intro: str, body: list[str], keys=KEYS) -> list[str]:
    res = load(name)
    return [
        intro,
        "",
        meta(name, res),
        "",
        *body,
        "",
        *command("veloxpatch eval", res["config"], keys),
        "",
    ]


def _kv(rows) -> list[str]:
    full = next((r["kv_mb"] for r in rows if r["arm"] == "full"), None)

    def cell(r):
        share = f" ({r['kv_mb'] / full:.0%} of full)" if full else ""
        return f"{r['kv_mb']:.1f}{share}"

    return ["KV MB held by the compressed context (mean):", "", *grid(rows, cell)]


def calibration() -> list[str]:
    if not _have(CALIBRATION):
        return []
    runs = [n for n in (CALIBRATION, CALIBRATION_39K) if _have(n)]
    results = {n: load(n) for n in runs}
    rows = [
        [
            f"{r['tokens']:,}",
            r["kind"],
            f"{r['segments']} x {r['segment_tokens']:,}",
            r["held_out_segments"],
            f"{r['mean_r2']:.3f}",
            f"{r['mean_spearman']:.3f}",
            f"{min(x['spearman'] for x in r['held_out']):.2f}-"
            f"{max(x['spearman'] for x in r['held_out']):.2f}",
            f"{r['scoring_seconds']:.0f}",
            f"{r['fit_seconds']:.1f}",
        ]
        for res in results.values()
        for r in res["table"]
    ]
    head = [
        "tokens",
        "kind",
        "segments",
        "held out",
        "R^2",
        "rank corr.",
        "rank corr. by layer",
        "scoring s",
        "fit s",
    ]
    commands = []
    for name, res in results.items():
        cfg = res["config"]
        pct = cfg.get("percentiles_of", "16384:linear")
        pct = "" if pct == "16384:linear" else f" --percentiles-of {pct}"
        commands.append(
            f"python scripts/kvzap_calibration.py --runs {cfg['runs']}{pct} "
            f"--out scripts/results/{name}.json"
        )
    return [
        "### Calibration",
        "",
        "`veloxpatch calibrate --algo kvzap` on the calibration prose: KVzip+ "
        "scores of every segment from kvzip's reconstruction pass (the scoring "
        "seconds, most of the time), then one surrogate per layer; R^2 and "
        "Spearman's rank correlation of predicted against true log scores on the "
        "held-out segments, mean over layers (and its range over layers). The "
        "seconds were measured on a CPU shared with other runs. 39,936 tokens is "
        "the whole calibration prose (40,779 tokens).",
        "",
        *[meta(name, res) for name, res in results.items()],
        "",
        *table(head, rows),
        "",
        "```bash",
        *commands,
        "```",
        "",
    ]


def fit_study() -> list[str]:
    if not _have(FIT_STUDY):
        return []
    res = load(FIT_STUDY)

    def what(r):
        if r["fit"] == "ridge":
            return f"ridge, {r['options']['samples_share']:.0%} of the samples"
        opts = ", ".join(f"{k}={v}" for k, v in r["options"].items())
        return f"mlp ({opts or 'as shipped'})"

    rows = [
        [
            what(r),
            f"{r['mean_r2']:.3f}",
            f"{r['mean_spearman']:.3f}",
            f"{r['min_spearman']:.2f}",
        ]
        for r in res["table"]
    ]
    head = ["fit", "R^2", "rank corr.", "worst layer's"]
    cfg = res["config"]
    ridge = {
        r["options"]["samples_share"]: r for r in res["table"] if r["fit"] == "ridge"
    }
    mlps = [r for r in res["table"] if r["fit"] == "mlp"]
    best = max(mlps, key=lambda r: r["mean_r2"])
    finding = (
        f"On all the samples ridge reaches R^2 {ridge[1]['mean_r2']:.3f}, "
        f"the best MLP ({what(best)[5:-1]}) {best['mean_r2']:.3f}, the MLP as "
        f"shipped {mlps[0]['mean_r2']:.3f}. Ridge on half and a quarter of "
        f"the samples: {ridge[0.5]['mean_r2']:.3f} and {ridge[0.25]['mean_r2']:.3f}."
    )
    if best["mean_r2"] < ridge[1]["mean_r2"]:
        finding += (
            " No MLP variant reaches ridge on this much text: the data, not the "
            "form of the fit, limits the surrogates (more text: the table above)."
        )
    load_average = res["run"].get("load_average", [0])[0]
    return [
        "### The fit or the data",
        "",
        f"One collection of {cfg['tokens']:,} tokens of calibration prose "
        f"({res['segments']} segments, {res['samples_per_segment']} sampled "
        "positions each, held out as `veloxpatch calibrate` holds them "
        "out), every fit judged on the same held-out segments: ridge trained on "
        "a share of each segment's samples, and the MLP as `--kind mlp` "
        "ships it and with the usual remedies for a small training set "
        "(`fit_mlp`'s options). (Its fit seconds, in the file, ran on CPUs "
        f"shared with other runs: load average {load_average:.1f} as it started.)",
        "",
        meta(FIT_STUDY, res),
        "",
        *table(head, rows),
        "",
        finding,
        "",
        "```bash",
        f"python scripts/kvzap_fit_study.py --tokens {cfg['tokens']} "
        f"--out scripts/results/{FIT_STUDY}.json",
        "```",
        "",
    ]


def passkey_parts() -> list[tuple[str, str, bool]]:
    """(results file, what it measured, whether to show KV MB) of the passkey
    runs, in the order they appear."""
    pct = load(CALIBRATION)["score_percentiles"] if _have(CALIBRATION) else {}
    where = ", ".join(f"{pct[q]}" for q in ("0.5", "0.75", "0.9") if q in pct)
    return [
        (
            AGNOSTIC,
            "### Passkey asked after compression (question-agnostic)\n\n"
            "The agnostic passkey cases (compress the context with no question, "
            "then ask on copies), every arm in one run. `kvzap` uses the surrogates "
            "fitted on 16,384 tokens of calibration prose (another text than the "
            "evaluation prose); its `threshold` arms keep no budget: the thresholds "
            "are the 50th, 75th and 90th percentiles of its predicted scores on "
            f"2,048 tokens of calibration prose ({where}), rounded.",
            True,
        ),
        (
            LICENSES,
            "### Where the budget is shared: cuts within a call\n\n"
            "The agnostic passkey cases on the second prose (`--text "
            "licenses-evaluation`), which chose kvzap's `chunk`. In budget mode "
            "a layer is cut to its share every `chunk` tokens within a call, "
            "before the other layers have seen those rows; the model-wide choice "
            "comes when the last layer has. With `chunk=512` a 1,500-token context "
            "is cut twice per layer before any model-wide choice; with 2,048 "
            "(mlx-lm's prefill step, the default since) never; `layerwise=true` "
            "keeps `budget` rows in every layer.",
            True,
        ),
        (
            OPTIONS,
            "The same options on the evaluation prose's cases (those of the first "
            "table, whose `kvzap` arm cut every 512 tokens):",
            False,
        ),
        (
            SIZES,
            "### How much calibration text\n\n"
            "The same cases with surrogates fitted on 1,024 and 4,096 tokens "
            "(linear) and on 16,384 tokens (2-layer MLP, hidden 128), at 256 rows "
            "and the default chunk; the linear one fitted on 16,384 tokens is the "
            "`chunk=2048` row above.",
            False,
        ),
        (
            AWARE,
            "### Passkey with the question in the prompt (inside generate)\n\n"
            "The question at the end of the prompt, as `mlx_lm.generate` runs it: "
            "`kvzap` scores as the rows enter, `kvzip` reconstructs the prompt "
            "from its ids before the call that ends it.",
            True,
        ),
        (
            AWARE_DEFAULT,
            "The same cases with kvzap at its default (`chunk` 2,048; the run "
            "above cut every 512 tokens):",
            False,
        ),
        (
            AWARE_TAIL,
            "### The prompt's newest queries at each choice (`tail`)\n\n"
            "As kvzip's `tail`: at each model-wide choice during the prompt a "
            "row also ranks by its KVzip+ weight under the prompt's newest 32 "
            "queries (the larger of that and its predicted score; the stored "
            "score stays the prediction). When the question ends the prompt "
            "those are its queries. The in-prompt cases above, kvzap at its "
            "default (`tail` 32):",
            False,
        ),
        (
            AGNOSTIC_TAIL,
            "The agnostic cases (the first table's; there the newest queries are "
            "the context's own end), with and without it:",
            False,
        ),
        (
            AGNOSTIC_39K,
            "### Surrogates fitted on the whole calibration prose\n\n"
            "The linear surrogates fitted on 39,936 tokens (held-out R^2 0.598 "
            "against 0.569 on 16,384; the calibration table above), kvzap at its "
            "defaults otherwise. The agnostic cases (kvzip's 18/20 is in the "
            "first table):",
            False,
        ),
        (
            AWARE_39K,
            "The in-prompt cases (kvzip's is in the in-prompt table above):",
            False,
        ),
        (
            AGNOSTIC_TARGET,
            "### Surrogates of KVzip's own scores\n\n"
            "Fitted by `veloxpatch calibrate --algo kvzap --target kvzip` on the "
            "same 16,384 tokens (held-out R^2 0.574, rank correlation 0.729): "
            "the maximum repeat probability, without KVzip+'s weights, which "
            "make layers comparable for one threshold. Chosen on the licence "
            "texts' calibration split (continuation KL, below). The agnostic "
            "cases of the first table (kvzip's 18/20 is there), the KVzip+ "
            "surrogates in the same run:",
            False,
        ),
        (
            AGNOSTIC_BYTES,
            "### At mlx-lm's 4-bit cache's bytes\n\n"
            "`max_kv_bytes=10.7MB` buys `kvzip:kv_bits=4,kv_residual=0` 584 rows "
            "per layer and KV head, 4-bit, from the prompt's end (section \"At "
            "mlx-lm's 4-bit cache's bytes\"). kvzap at the same 584 rows, 4-bit, "
            "no residual: `max_kv_bytes` cannot price kvzap there, its bound counts "
            "one prompt chunk held at full precision (2,048 rows), more than those "
            "bytes. "
            "The agnostic cases of the first table, mlx-lm's 4-bit cache in the "
            "same run:",
            True,
        ),
    ]


def kvzap() -> list[str]:
    parts = calibration() + fit_study()
    for name, intro, with_kv in passkey_parts():
        if _have(name):
            rows = load(name)["passkey"]["table"]
            body = [*grid(rows, wilson), *(["", *_kv(rows)] if with_kv else [])]
            parts += _run(name, intro, body)
    if _have(KL):
        res = load(KL)
        rows = res["continuation"]["table"]
        parts += _run(
            KL,
            "### Continuation after a context compressed on its own\n\n"
            "KL(full || arm) and perplexity of 256 teacher-forced tokens after a "
            "context of about 1,500 tokens compressed with no question.",
            [
                *grid(rows, lambda r: f"KL {r['kl']:.3f}, ppl {r['perplexity']:.2f}"),
            ],
            KL_KEYS,
        )
    kl_runs = [
        (
            KL_DEFAULT,
            "The same segments with kvzap at `chunk` 2,048, its generated rows "
            'then cut by their predicted scores (what `decode="surrogate"` '
            "does now):",
            KL_KEYS,
        ),
        (
            KL_LICENSES,
            "The continuation on the second prose (generated rows cut by their "
            "predicted scores, as above), with a wider protected window "
            "(`window=128`, kvpress's DMS default) and no per-head floor "
            "(`floor=0`), to see where kvzap's continuation lost to kvzip's: "
            "the KL rose once the first `window` generated tokens were cut "
            "(its profile by position is in the file):",
            KL_KEYS,
        ),
        (
            KL_DECODE,
            "### What the continuation reads: cuts while decoding\n\n"
            "While decoding, each layer is cut back to its share every `window` "
            'tokens. `decode="attention"` (the default since) ranks the rows '
            "then by SnapKV's score under the last `window` generated queries, "
            'as kvzip decodes; `decode="surrogate"` by their predicted '
            "scores. The evaluation prose's segments, kvzip in the same run:",
            KL_KEYS,
        ),
        (
            KL_DECODE_LICENSES,
            "The same on the second prose (kvzip's 0.147 there is in the "
            "previous licence-text table):",
            KL_KEYS,
        ),
        (
            "ppl_kvzap_decode_mlp",
            "The evaluation prose's segments with the 2-layer MLP surrogate "
            "(fitted on 16,384 tokens; its file is not committed, "
            '`scripts/kvzap_calibration.py` makes it) and `decode="attention"` '
            "(kvzip's 0.059 is in the table above):",
            KL_KEYS,
        ),
        (
            KL_TAIL,
            "The evaluation prose's segments with and without `tail` (kvzip's "
            "0.059 is in the table above):",
            KL_KEYS,
        ),
        (
            KL_TAIL_LICENSES,
            "The second prose with `tail` (kvzip's 0.147 as above):",
            KL_KEYS,
        ),
        (
            "ppl_kvzap_tail_128",
            "A longer `tail` (128 queries) on a third text, the licence texts' "
            "calibration split, which no kvzap default was chosen on, with "
            "`snapkv` and `kvzip` in the same run: a longer tail is worse there "
            "(0.141 against 0.119 at 32), so it was not tried on the "
            "evaluation proses:",
            KL_KEYS,
        ),
        (
            KL_39K,
            "The evaluation prose's segments with the surrogates fitted on "
            "39,936 tokens (kvzip's 0.059 as above):",
            KL_KEYS,
        ),
        (
            KL_39K_LICENSES,
            "The same on the second prose (kvzip's 0.147 as above):",
            KL_KEYS,
        ),
        (
            KL_MLP_39K,
            "The evaluation prose's segments with the 2-layer MLP surrogates "
            "fitted on the same 39,936 tokens (held-out R^2 0.556; 9 MB, not "
            "committed: the command is in `.gitignore`), kvzap at its defaults "
            "otherwise (kvzip's 0.059 as above):",
            KL_KEYS,
        ),
        (
            KL_BYTES,
            "The continuation at the rows `max_kv_bytes=12.6MB` buys kvzip (744 per "
            "layer and KV head, 4-bit, no residual; kvzip's KL there is in the "
            "section \"At mlx-lm's 4-bit cache's bytes\"), mlx-lm's 4-bit cache "
            "in the same run:",
            KL_KEYS,
        ),
        (
            KL_TARGET_SELECTION,
            "Surrogates fitted to KVzip's own scores (`veloxpatch calibrate "
            "--algo kvzap --target kvzip`: the maximum repeat probability, "
            "without KVzip+'s ||W_o v|| / ||x|| weights; `tail` then weighs rows "
            "by the same score) against the KVzip+ ones, on the licence texts' "
            "calibration split, where the target was chosen (lower in each of "
            "the three segments):",
            KL_KEYS,
        ),
        (
            KL_TARGET,
            "The same on the evaluation prose (run after that choice), `kvzip` "
            "in the same run:",
            KL_KEYS,
        ),
        (
            KL_TARGET_LICENSES,
            "The same on the second prose, where the KVzip+ surrogates are the "
            "lower. With one evaluation prose each way, the default target "
            "stays KVzip+:",
            KL_KEYS,
        ),
        (
            "ppl_kvzap_decode_even_licenses",
            "kvzip's decode also brings every layer back to `budget` at its "
            "first cut; tried for kvzap on the second prose (made at e784857, "
            "then reverted: each layer keeps its share):",
            KL_KEYS,
        ),
    ]
    kl_runs += [
        (
            KL_SEGMENTS,
            "### The continuation over ten segments\n\n"
            "The runs above have three segments a prose, and kvzip's KL moves "
            "more between segments than between most arms. kvzap at its "
            "defaults and kvzip on ten segments spread evenly over the "
            "evaluation prose (the first and last as above, eight no run above "
            "read), in one run:",
            KL_KEYS,
        ),
        (KL_SEGMENTS_LICENSES, "The same on the second prose:", KL_KEYS),
    ]
    for name, intro, keys in kl_runs:
        if _have(name):
            rows = load(name)["continuation"]["table"]
            cell = lambda r: f"KL {r['kl']:.3f}, ppl {r['perplexity']:.2f}"  # noqa: E731
            body = grid(rows, cell)
            if name == KL_BYTES:  # at equal bytes the bytes are the point
                body += ["", *_kv(rows)]
            if name in (KL_SEGMENTS, KL_SEGMENTS_LICENSES):
                body += ["", f"- {_paired(name)}"]
            parts += _run(name, intro, body, keys)
    benches = [
        (
            BENCH,
            "### What compressing costs the prefill\n\n"
            "`veloxpatch bench`: prefill tok/s through mlx-lm's generate_step "
            "(chunks of 512) to the first token, median of the repeats' ratios "
            "to unpatched mlx-lm in the same run; `kvzip` reconstructs the prompt "
            "inside it (the patch knows the tokenizer).",
        ),
        (
            BENCH_TAIL,
            "The same with `tail` (kvzap's default since: each model-wide choice "
            "also weighs the rows under the prompt's newest 32 queries), on a "
            "quiet machine:",
        ),
    ]
    for name, intro in benches:
        if not _have(name):
            continue
        res = load(name)
        body = table(
            ["arm", "context", "prefill tok/s", "vs unpatched", "KV MB"],
            [
                [
                    f"`{r['arm']}`",
                    f"{r['context']:,}",
                    f"{r['prefill_tok_per_s']:.1f}",
                    f"{r['prefill_ratio']:.2f}",
                    f"{r['kv_bytes'] / 1e6:.1f}",
                ]
                for r in res["table"]
            ],
        )
        parts += [
            intro,
            "",
            meta(name, res),
            "",
            *body,
            "",
            *command("veloxpatch bench", res["config"], BENCH_CLI_KEYS),
            "",
        ]
    if not parts:
        return []
    return [
        "## kvzap: KVzip's scores predicted from the hidden state",
        "",
        "kvzap (`veloxpatch/caches/kvzap.py`) scores each pair as it enters "
        "the cache, from the hidden state entering attention, with a per-layer "
        "surrogate fitted to this model's own KVzip+ scores: no token ids, no "
        "second pass (docs/algorithms.md).",
        "",
        *summary(),
        *parts,
    ]


def _find(name: str, part: str, test) -> dict | None:
    if not _have(name):
        return None
    return next((r for r in load(name)[part]["table"] if test(r)), None)


def summary() -> list[str]:
    """kvzap at its defaults (linear surrogates from 16,384 tokens, chunk
    2,048) against kvzip at 256 rows, wins and losses, where measured."""

    def default(r):
        return (
            r["algo"] == "kvzap"
            and "chunk=512" not in r["arm"]
            and ("linear.safetensors" in r["arm"] and "threshold" not in r["arm"])
            and "layerwise" not in r["arm"]
            and "decode=surrogate" not in r["arm"]
            and "tail=" not in r["arm"]
        )

    def kvzip(r):
        return r["arm"] == "kvzip:budget=256"

    def newest(names, part, test):  # the latest run of the defaults
        return next(filter(None, (_find(n, part, test) for n in names)), None)

    out = []
    pairs = [
        ("agnostic passkey", ((AGNOSTIC_TAIL, OPTIONS), AGNOSTIC)),
        (
            "second prose's agnostic passkey (where `chunk` was chosen; before `tail`)",
            ((LICENSES,), LICENSES),
        ),
        ("in-prompt passkey", ((AWARE_TAIL, AWARE_DEFAULT), AWARE)),
    ]
    for what, (ours, theirs) in pairs:
        a, b = newest(ours, "passkey", default), _find(theirs, "passkey", kvzip)
        if a and b:
            ratio = a["correct"] / b["correct"] if b["correct"] else float("nan")
            out.append(
                f"- {what}: `kvzap` {a['correct']}/{a['cases']}, `kvzip` "
                f"{b['correct']}/{b['cases']} ({ratio:.2f}x)"
            )
    for what, names, theirs in (
        ("continuation KL (3 segments)", (KL_TAIL, KL_DECODE), KL_DECODE),
        (
            "second prose's continuation KL (3 segments)",
            (KL_TAIL_LICENSES, KL_DECODE_LICENSES),
            KL_LICENSES,
        ),
        ("continuation KL (10 segments, one run)", (KL_SEGMENTS,), KL_SEGMENTS),
        (
            "second prose's continuation KL (10 segments, one run)",
            (KL_SEGMENTS_LICENSES,),
            KL_SEGMENTS_LICENSES,
        ),
    ):
        a = newest(names, "continuation", default)
        b = _find(theirs, "continuation", kvzip)
        if a and b:
            verdict = "**loss**: " if a["kl"] > b["kl"] else ""
            out.append(
                f"- {verdict}{what}: `kvzap` {a['kl']:.3f}, `kvzip` {b['kl']:.3f}"
            )
    big = [
        (part, _find(name, part, lambda r: r["algo"] == "kvzap"))
        for name, part in (
            (AGNOSTIC_39K, "passkey"),
            (AWARE_39K, "passkey"),
            (KL_39K, "continuation"),
            (KL_39K_LICENSES, "continuation"),
            (KL_MLP_39K, "continuation"),
        )
    ]
    cells = [
        f"{r['correct']}/{r['cases']}" if part == "passkey" else f"KL {r['kl']:.3f}"
        for part, r in big
        if r
    ]
    if cells:
        out.append(
            "- surrogates fitted on 39,936 tokens instead (agnostic, in-prompt, "
            f"KL on the two proses; the MLP's KL): {', '.join(cells)}"
        )
    out += _kvzip_target()
    at, pre = prefill_ratios()
    if "kvzap" in pre and "kvzip" in pre:
        out.append(
            f"- prefill at {at:,} tokens: `kvzap` {pre['kvzap']:.2f}x "
            f"unpatched's, `kvzip` {pre['kvzip']:.2f}x"
        )
    if not out:
        return []
    return [
        "At 256 rows, kvzap at its defaults against kvzip:",
        "",
        *out,
        "",
        *_at_mlx_bytes(),
    ]


def _paired(name: str) -> str:
    """kvzap (defaults) against kvzip segment by segment in one run."""
    by: dict = {}
    for r in load(name)["continuation"]["raw"]:
        by.setdefault(r["segment"], {})[r["algo"]] = r["kl"]
    diffs = [
        s["kvzap"] - s["kvzip"] for s in by.values() if {"kvzap", "kvzip"} <= set(s)
    ]
    mean = sum(diffs) / len(diffs)
    verdict = "**loss**: " if mean > 0 else ""
    return (
        f"{verdict}kvzap's KL minus kvzip's, per segment: mean {mean:+.4f}, from "
        f"{min(diffs):+.3f} to {max(diffs):+.3f}; kvzap lower in "
        f"{sum(d < 0 for d in diffs)} of {len(diffs)}"
    )


def _kvzip_target() -> list[str]:
    """The surrogates of KVzip's own scores against kvzip in the same runs."""

    def plain(r):
        return r["algo"] == "kvzap" and "_kvzip.safetensors" in r["arm"]

    def kvzip(r):
        return r["arm"] == "kvzip:budget=256"

    cells = []
    for what, name in (("KL", KL_TARGET), ("second prose's KL", KL_TARGET_LICENSES)):
        a, b = _find(name, "continuation", plain), _find(name, "continuation", kvzip)
        if a and b:
            loss = "**loss**: " if a["kl"] > b["kl"] else ""
            cells.append(f"{loss}{what} {a['kl']:.3f} against {b['kl']:.3f}")
    a = _find(AGNOSTIC_TARGET, "passkey", plain)
    if a:
        cells.append(f"agnostic passkey {a['correct']}/{a['cases']}")
    if not cells:
        return []
    return [
        "- surrogates of KVzip's own scores (`calibrate --target kvzip`), "
        f"`kvzip` in the same runs: {'; '.join(cells)}"
    ]


def _at_mlx_bytes() -> list[str]:
    """kvzap's 4-bit rows at kvzip's rows under mlx-lm's 4-bit bytes."""

    def mlx4(r):
        return r["arm"] == "mlx.quantized:kv_bits=4"

    def ours(r):
        return r["algo"] == "kvzap"

    cells = []
    for name, part in ((AGNOSTIC_BYTES, "passkey"), (KL_BYTES, "continuation")):
        a, m = _find(name, part, ours), _find(name, part, mlx4)
        if not (a and m):
            continue
        if part == "passkey":
            cells.append(
                f"agnostic passkey {a['correct']}/{a['cases']} at {a['kv_mb']:.1f} MB "
                f"against {m['correct']}/{m['cases']} at {m['kv_mb']:.1f} MB"
            )
        else:
            verdict = "**a loss**" if a["kl"] > m["kl"] else "a win"
            cells.append(
                f"continuation KL {a['kl']:.3f} at {a['kv_mb']:.1f} MB against "
                f"{m['kl']:.3f} at {m['kv_mb']:.1f} MB ({verdict})"
            )
    if not cells:
        return []
    return [
        "Against mlx-lm's 4-bit cache, kvzap's rows 4-bit at the rows kvzip keeps "
        f"under its bytes: {'; '.join(cells)}.",
        "",
    ]
