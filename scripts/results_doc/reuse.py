"""Sections on compressing a context before any question: KVzip+ against KVzip,
perplexity/KL of a continuation after the compressed context, and the same
measurements on a second kind of English (Debian's licence texts)."""

from __future__ import annotations

from results_markdown import command, grid, load, meta, short, wilson

KEYS = [
    "arms",
    "budgets",
    "tasks",
    "protocol",
    "context",
    "cases",
    "segments",
    "continuation",
    "text",
    "out",
]


def _by(rows):
    return {(t["family"], t["budget"]): t for t in rows}


def _kl(t):
    return f"{t['perplexity']:.2f} / {t['kl']:.3f}"


def kvzip_plus() -> list[str]:
    res = load("passkey_agnostic_kvzip")
    rows = res["passkey"]["table"]
    pk = _by(rows)
    ppl = _by(load("ppl_agnostic")["continuation"]["table"])
    z, zp = "kvzip", "kvzip:plus=True"
    cells = [
        f"{b}: {pk[(z, b)]['correct']}/{pk[(z, b)]['cases']} vs "
        f"{pk[(zp, b)]['correct']}/{pk[(zp, b)]['cases']} passkey, KL "
        f"{ppl[(z, b)]['kl']:.3f} vs {ppl[(zp, b)]['kl']:.3f}"
        for b in (128, 256, 512)
    ]
    return [
        "## KVzip+ (normalised scores) against KVzip",
        "",
        "`kvzip:plus=True` weighs each reconstruction probability by ‖W_o v‖ of "
        "its query head over ‖x‖ of the repeat query's attention input (the "
        "KVzap paper's KVzip+), which makes scores of different layers comparable "
        "before the one global threshold. Same agnostic passkey cases as above, "
        "rerun for both arms at one commit:",
        "",
        meta("passkey_agnostic_kvzip", res),
        "",
        *grid(rows, wilson),
        "",
        *command("veloxpatch eval", res["config"], KEYS),
        "",
        "KVzip against KVzip+ per budget (passkey answers; KL of the continuation "
        "in the next section): " + "; ".join(cells) + ".",
        "",
    ]


def ppl_agnostic() -> list[str]:
    res = load("ppl_agnostic")
    rows = res["continuation"]["table"]
    cfg = res["config"]
    t = _by(rows)
    z, s = t[("kvzip", 256)], t[("snapkv", 256)]
    verdict = "no worse than" if z["kl"] <= s["kl"] else "worse than"
    return [
        "## Continuation after a compressed context (question-agnostic)",
        "",
        f"{cfg['segments']} stretches of evaluation prose: a {cfg['context']:,}-token "
        "context compressed on its own (as `Patch.prefill` does: kvzip by its "
        f"reconstruction pass), then {cfg['continuation']} tokens teacher-forced, "
        "each fed alone. Cells: perplexity / KL(full ‖ arm), mean over stretches.",
        "",
        meta("ppl_agnostic", res),
        "",
        *grid(rows, _kl),
        "",
        "KV MB held at the end:",
        "",
        *grid(rows, lambda r: f"{r['kv_mb']:.1f}"),
        "",
        *command("veloxpatch eval", cfg, KEYS),
        "",
        f"At 256 rows `kvzip` (KL {z['kl']:.3f}, perplexity {z['perplexity']:.2f}, "
        f"{z['kv_mb']:.1f} MB) is {verdict} `snapkv` (KL {s['kl']:.3f}, "
        f"{s['perplexity']:.2f}, {s['kv_mb']:.1f} MB). This run is older than "
        'kvzip\'s `decode="attention"`: its kvzip arms kept the compressed '
        "context as chosen and slid generated tokens through 32 rows (today's "
        "`decode=frozen`); the next section measures both.",
        "",
    ]


def second_text() -> list[str]:
    pk_res, pp_res = load("passkey_agnostic_licenses"), load("ppl_agnostic_licenses")
    pk = _by(pk_res["passkey"]["table"])
    pp = _by(pp_res["continuation"]["table"])
    home = _by(load("ppl_agnostic")["continuation"]["table"])
    full = pp[("full", None)]["perplexity"]
    home_full = home[("full", None)]["perplexity"]

    def rel(t, base):
        return f"{t['perplexity'] / base:.2f}x"

    qf = [f for f, b in pp if b == 256 and f.startswith("qfilters")]
    q_line = "; ".join(f"`{short(f)}` {rel(pp[(f, 256)], full)}" for f in qf)
    stream = pp[("streaming_llm", 256)]["perplexity"]
    behind = all(pp[(f, 256)]["perplexity"] > stream for f in qf)
    home_q = home[
        ("qfilters:filters=scripts/results/smollm2_qfilters.safetensors", 256)
    ]
    why = (
        "Q-Filters is behind `streaming_llm` here whichever text its filters "
        "come from, and filters calibrated on this kind of text do no better than "
        "the others, so the gap is not the calibration: Q-Filters spends most of "
        "its 256 rows on keys ranked by the filter and protects only the 64 "
        "newest, while `streaming_llm` keeps the 252 newest, which a continuation "
        "rewards. "
        if behind
        else "Q-Filters is not behind `streaming_llm` on this text. "
    )
    return [
        "## A second kind of English: Debian's licence texts",
        "",
        "The same agnostic protocol on `--text licenses-evaluation` (GPL-3, "
        "Apache-2.0, MPL-2.0 and CC0 from `/usr/share/common-licenses`: legal "
        "prose, nothing like the Python reference). Q-Filters calibrated on "
        "`licenses-calibration` (LGPL-2.1, GFDL-1.3, MPL-1.1, Artistic; no "
        "paragraph shared) is `smollm2_qfilters_licenses`; the pydoc-calibrated "
        "file is `smollm2_qfilters`; plain `qfilters` calibrates on the context's "
        "own queries.",
        "",
        meta("passkey_agnostic_licenses", pk_res),
        "",
        *grid(pk_res["passkey"]["table"], wilson),
        "",
        *command("veloxpatch eval", pk_res["config"], KEYS),
        "",
        meta("ppl_agnostic_licenses", pp_res),
        "",
        *grid(pp_res["continuation"]["table"], _kl),
        "",
        *command("veloxpatch eval", pp_res["config"], KEYS),
        "",
        f"Perplexity over `full` at 256 rows on this text: {q_line}; "
        f"`streaming_llm` {rel(pp[('streaming_llm', 256)], full)}, `kvzip` "
        f"{rel(pp[('kvzip', 256)], full)}, `snapkv` {rel(pp[('snapkv', 256)], full)}. "
        f"On pydoc: `streaming_llm` {rel(home[('streaming_llm', 256)], home_full)}, "
        f"`qfilters` (pydoc filters) {rel(home_q, home_full)}, "
        f"`kvzip` {rel(home[('kvzip', 256)], home_full)}. "
        + why
        + "Passkey at 256: `kvzip` "
        f"{pk[('kvzip', 256)]['correct']}/{pk[('kvzip', 256)]['cases']}, `snapkv` "
        f"{pk[('snapkv', 256)]['correct']}/{pk[('snapkv', 256)]['cases']}, full "
        f"{pk[('full', None)]['correct']}/{pk[('full', None)]['cases']}.",
        "",
    ]
