"""Sections from scripts/quality_ppl.py and scripts/quality_passkey.py runs:
quality against budget up to 1,024 rows, and lookahead."""

from __future__ import annotations

from results_markdown import (
    PY,
    command,
    load,
    meta,
    part_of,
    split_arm,
    table,
    table_of,
    wilson,
)

PPL_KEYS = ["arms", "budgets", "context", "continuation", "segments"]
PPL_KEYS += ["prefill_step_size", "out"]
PK_KEYS = ["arms", "budgets", "search", "cases", "context", "seed", "prefill_step_size"]
PK_KEYS += ["decode_lead_in", "out"]


# true of files the script wrote before it called `veloxpatch eval`
_OLD_SEGMENTS = (
    " The second segment differs from the one `veloxpatch eval` uses, so these "
    "perplexities are not comparable with the eval tables."
)


def _families(rows: list[dict]) -> dict:
    """{family: {budget: row}} from rows named by arm, in first-seen order."""
    out: dict = {}
    for r in rows:
        fam, budget = split_arm(r["arm"])
        out.setdefault(fam, {})[budget] = r
    return out


def _ppl_table(results: list[dict]) -> list[str]:
    rows = []
    for res in results:
        for fam, by in _families(table_of(res, "continuation")).items():
            if fam in {r[0].strip("`") for r in rows}:
                continue  # `full` appears in several files

            order = sorted(by, key=lambda b: -1 if b is None else b)

            def cells(key, fmt, by=by, order=order):
                return " / ".join(fmt.format(by[b][key]) for b in order)

            rows.append(
                [
                    f"`{fam}`",
                    cells("perplexity", "{:.2f}"),
                    cells("agreement", "{:.3f}"),
                    cells("kl", "{:.3f}"),
                    cells("kv_mb", "{:.1f}"),
                ]
            )
    return table(["arm", "ppl", "agreement", "KL", "KV MB"], rows)


def perplexity() -> list[str]:
    core, qa = load("ppl_core"), load("ppl_query_aware")
    cfg = core["config"]
    segments = "" if "continuation" in core else _OLD_SEGMENTS
    return [
        "## Continuation quality against budget",
        "",
        f"Perplexity of {cfg['continuation']} tokens after a {cfg['context']:,}-"
        f"token context, mean of {cfg['segments']} segments of evaluation prose, "
        "each continuation token fed alone (`scripts/quality_ppl.py`); agreement "
        "is top-1 agreement with `full`, KL the mean KL(full ‖ arm). Cells are "
        "budgets 256 / 512 / 1024. SnapKV-family bytes include the window rows "
        f"held during decode, Ada-KV's its head padding.{segments}",
        "",
        meta("ppl_core", core),
        "",
        meta("ppl_query_aware", qa),
        "",
        *_ppl_table([core, qa]),
        "",
        *command(f"{PY} scripts/quality_ppl.py", cfg, PPL_KEYS),
        "",
        *command(f"{PY} scripts/quality_ppl.py", qa["config"], PPL_KEYS),
        "",
        "`knorm` with `recent=0` (its default until it was measured) keeps the "
        "lowest-norm keys and no recent ones, which breaks the continuation at "
        "every budget; `knorm:recent=64` recovers much of it.",
        "",
    ]


def _passkey_grid(res_list, families, budgets, smallest=True) -> list[str]:
    rows = []
    for res in res_list:
        fams = _families(table_of(res, "passkey"))
        best = part_of(res, "passkey").get("smallest_budget_for_90pct_of_full", {})
        for fam in families:
            if fam not in fams:
                continue
            cells = [wilson(fams[fam][b]) if b in fams[fam] else "" for b in budgets]
            if smallest:
                cells.append(str(best.get(fam) or f"> {max(fams[fam])}"))
            rows.append([f"`{fam}`", *cells])
    head = ["arm", *map(str, budgets)]
    return table(head + (["smallest budget ≥ 90% of full"] if smallest else []), rows)


def passkey() -> list[str]:
    look, acc = load("passkey_snapkv_lookahead"), load("passkey_accumulated")
    full = _families(table_of(look, "passkey"))["full"][None]
    budgets = [128, 256, 512, 768, 1024]
    at256 = max(
        r["correct"]
        for r in table_of(look, "passkey") + table_of(acc, "passkey")
        if r["budget"] == 256 and ":" not in r["family"]  # no lookahead
    )
    return [
        "## Passkey against budget, up to 1,024 rows",
        "",
        f'{full["cases"]} seeded cases of ~1,515 tokens (a five-digit "secret '
        'number" at depths 5-95% of evaluation prose, question at the end, chat '
        'template, the assistant turn opened with "The secret number is"; '
        "`scripts/quality_passkey.py`, Wilson 95% intervals; `full` "
        f"{wilson(full)}).",
        "",
        meta("passkey_snapkv_lookahead", look),
        "",
        meta("passkey_accumulated", acc),
        "",
        *_passkey_grid(
            [look, acc],
            ["snapkv", "pyramidkv", "adakv", "h2o", "tova", "keyformer"],
            budgets,
        ),
        "",
        *command(f"{PY} scripts/quality_passkey.py", look["config"], PK_KEYS),
        "",
        *command(f"{PY} scripts/quality_passkey.py", acc["config"], PK_KEYS),
        "",
        "A 135M model attends weakly to the needle from the question at the end "
        "of the prompt: at budget 256 (17% of the cache) every method keeps the "
        f"key in at most {at256} of {full['cases']} cases, and half the cache is "
        "needed for 90% of `full`.",
        "",
    ]


def lookahead() -> list[str]:
    look, dec = (
        load("passkey_snapkv_lookahead"),
        load("passkey_lookahead_decoded_lead_in"),
    )
    first, ppl = load("passkey_snapkv_family"), load("ppl_lookahead")
    key = ("arm", "seed", "depth")
    raw, first_raw = part_of(look, "passkey")["raw"], part_of(first, "passkey")["raw"]
    answers = {tuple(r[k] for k in key): r["answer"] for r in raw}
    equal = sum(answers.get(tuple(r[k] for k in key)) == r["answer"] for r in first_raw)
    ks = [f"{a}:lookahead={k}" for a in ("snapkv", "adakv") for k in (4, 8, 16)]
    return [
        "## Lookahead",
        "",
        "`lookahead=k` (SnapKV family) delays the prompt-end compression until "
        "the first k answer tokens exist and scores with their queries too. With "
        "the passkey prompt above, the answer's first digit is predicted by the "
        "last prompt token and each of the next k tokens attends before the "
        "compression, so `lookahead=k` ≥ 4 writes the whole five-digit key from "
        "the full cache: the first table shows that the option works end to end "
        "and keeps the later answer intact, not that the compressed cache holds "
        "the key.",
        "",
        *_passkey_grid([look], ks, [128, 256, 512]),
        "",
        "The k = 0 arms of this run give the same answers as an earlier run made "
        "before the option existed, case for case "
        f"({equal} of {len(first_raw)}):",
        "",
        meta("passkey_snapkv_family", first),
        "",
        *command(f"{PY} scripts/quality_passkey.py", first["config"], PK_KEYS),
        "",
        "The stricter run ends the prompt at the question and feeds the lead-in "
        '"The secret number is" (4 tokens) as answer tokens '
        "(`--decode-lead-in`): with k = 3 the compression happens before the "
        "first digit is predicted.",
        "",
        meta("passkey_lookahead_decoded_lead_in", dec),
        "",
        *_passkey_grid(
            [dec],
            ["snapkv", "snapkv:lookahead=3", "adakv", "adakv:lookahead=3"],
            [256, 512],
        ),
        "",
        *command(f"{PY} scripts/quality_passkey.py", dec["config"], PK_KEYS),
        "",
        "Lead-in queries alone move the needle little at 512 and not at all at "
        "256: the gain comes from the answer's own first tokens.",
        "",
        'Perplexity of the same continuation as in "Continuation quality" with '
        "lookahead; the first k continuation tokens are scored before the "
        "compression. Cells are budgets 256 / 512.",
        "",
        meta("ppl_lookahead", ppl),
        "",
        *_ppl_table([ppl]),
        "",
        *command(f"{PY} scripts/quality_ppl.py", ppl["config"], PPL_KEYS),
        "",
    ]


def knorm_recent() -> list[str]:
    res = load("knorm_recent")
    cfg = res["config"]
    rows = {r["arm"]: r for r in table_of(res, "continuation")}
    full = rows["full"]["perplexity"]
    cells: dict = {}
    for arm, r in rows.items():
        fam, budget = split_arm(arm)
        if budget is not None:
            cells.setdefault(fam, {})[budget] = r
    body = []
    for fam, by in cells.items():

        def cell(b, by=by):
            if b not in by:
                return "(not valid)"
            r = by[b]
            return (
                f"{r['perplexity'] / full:.2f}x ({r['agreement']:.3f}, {r['kl']:.3f})"
            )

        body.append([f"`{fam}`", cell(256), cell(512)])
    return [
        "## `knorm`: choosing its default `recent`",
        "",
        f"Perplexity of {cfg['continuation']} tokens after a {cfg['context']:,}-"
        f"token context, mean of {cfg['segments']} segments of evaluation prose, as "
        f"a ratio to `full` ({full:.2f}); agreement and KL against `full` in "
        "brackets. `recent` rows are never evicted; the rest of the budget keeps "
        "the lowest-norm keys.",
        "",
        meta("knorm_recent", res),
        "",
        *table(["arm", "budget 256", "budget 512"], body),
        "",
        *command(f"{PY} scripts/quality_ppl.py", cfg, PPL_KEYS),
        "",
        "More recent rows help at both budgets; about half the budget is the best "
        "measured, so the default is (budget - sinks) // 2, the rule `h2o` uses "
        "(126 and 254 rows here, not run exactly). Even then `knorm` stays behind "
        "`streaming_llm`: on this model and text the key norm adds nothing to "
        "recency.",
        "",
    ]


CHUNK_FILES = ("passkey_chunks_aware", "passkey_chunks_agnostic")
CHUNK_FILES += ("ppl_chunks_aware", "ppl_chunks_agnostic")
CHUNK_FAMILIES = ("snapkv", "adakv", "expected_attention")


def prompt_chunks() -> list[str]:
    """compress="chunks" against "prompt_end" at equal budget, both protocols:
    shown once every file of the comparison exists."""
    import results_markdown as rm

    if not all((rm.RESULTS / f"{n}.json").exists() for n in CHUNK_FILES):
        return []
    pk_aware, pk_agn, ppl_aware, ppl_agn = (load(n) for n in CHUNK_FILES)
    fams = []
    for f in CHUNK_FAMILIES:
        fams += [f, f"{f}:compress=chunks"]
    budgets = [256, 512]
    lines = [
        "## Compression during the prompt against at its end",
        "",
        '`compress="chunks"` (default chunk 512) cuts the cache back to its '
        "budget every 512 prompt tokens, scored with what has been read so far; "
        '`"prompt_end"` (the default) holds the whole prompt and compresses once '
        "with the question's window. Same cases, same budgets; passkey prompts "
        f"of ~{pk_aware['config']['context']:,} tokens and continuation contexts "
        f"of {ppl_aware['config']['context']:,}, so the chunked mode cuts two or "
        "three times before the end. Question-aware: the question inside the "
        "prompt; agnostic: the context compressed on its own, the question (or "
        "the continuation) sent after.",
        "",
    ]
    for title, res in (("question in the prompt", pk_aware), ("asked after", pk_agn)):
        full = _families(table_of(res, "passkey"))["full"][None]
        lines += [
            f"Passkey, {title} (Wilson 95% intervals; `full` {wilson(full)}):",
            "",
            meta(res["config"]["out"].split("/")[-1][:-5], res),
            "",
            *_passkey_grid([res], fams, budgets, smallest=False),
            "",
            *command(
                f"{PY} scripts/quality_passkey.py",
                res["config"],
                PK_KEYS + ["protocol"],
            ),
            "",
        ]
    for title, res in (("in the prompt", ppl_aware), ("after", ppl_agn)):
        lines += [
            f"Continuation {title}; cells are budgets 256 / 512:",
            "",
            meta(res["config"]["out"].split("/")[-1][:-5], res),
            "",
            *_ppl_table([res]),
            "",
            *command(
                f"{PY} scripts/quality_ppl.py", res["config"], PPL_KEYS + ["protocol"]
            ),
            "",
        ]
    lines += _chunk_findings(pk_aware, pk_agn, ppl_aware, ppl_agn) + [""]
    return lines


def _chunk_findings(pk_aware, pk_agn, ppl_aware, ppl_agn) -> list[str]:
    """One line per family: chunked minus prompt-end, passkey and KL, per
    protocol and budget."""
    out = []
    for f in CHUNK_FAMILIES:
        parts = []
        for name, pk, ppl in (
            ("aware", pk_aware, ppl_aware),
            ("agnostic", pk_agn, ppl_agn),
        ):
            p, k = (
                _families(table_of(pk, "passkey")),
                _families(table_of(ppl, "continuation")),
            )
            chunked, end = f"{f}:compress=chunks", f
            if chunked not in p or end not in p:
                continue
            cells = []
            for b in (256, 512):
                if b in p[chunked] and b in p[end]:
                    cells.append(
                        f"{b}: passkey {p[chunked][b]['correct']} vs "
                        f"{p[end][b]['correct']}, KL {k[chunked][b]['kl']:.3f} vs "
                        f"{k[end][b]['kl']:.3f}"
                    )
            parts.append(f"{name} ({'; '.join(cells)})")
        out.append(f"- `{f}` chunked vs prompt-end: {', '.join(parts)}.")
    return out
