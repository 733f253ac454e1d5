"""kvzip's defaults for `floor` and `recent`: swept on the second prose,
checked on the evaluation prose (continuation KL) and on the agnostic passkey
cases, against the defaults they replaced."""

from __future__ import annotations

from results_markdown import by_key, command, grid, load, meta, wilson

from .continuation import KEYS, profile_rows

NEW_256 = "kvzip:budget=256,floor=0.5,recent=64"  # the defaults at 256 rows


def _verdict(a: float, b: float) -> str:
    return "below" if a < b else ("equal to" if a == b else "above")


def kvzip_defaults() -> list[str]:
    lic, ev = load("ppl_kvzip_choice_licenses"), load("ppl_kvzip_choice")
    pk_res, old_res = load("passkey_kvzip_choice"), load("passkey_agnostic_kvzip")
    lic_at = by_key(lic["continuation"]["table"])
    ev_at = by_key(ev["continuation"]["table"])
    old = [
        r
        for r in old_res["passkey"]["table"]
        if r["arm"] == "full" or r["family"] == "kvzip"
    ]
    pk = old + pk_res["passkey"]["table"]
    pk_at = by_key(pk)
    snap_l, snap_e = lic_at["snapkv:budget=256"], ev_at["snapkv:budget=256"]
    z_l, z_e = lic_at[NEW_256], ev_at[NEW_256]
    old_l = lic_at["kvzip:budget=256"]
    old_e = by_key(load("ppl_agnostic_decode")["continuation"]["table"])[
        "kvzip:budget=256"
    ]

    def pk_cell(b, new):
        n, o = pk_at[new], pk_at[f"kvzip:budget={b}"]
        return f"{b}: {n['correct']}/{n['cases']} (was {o['correct']}/{o['cases']})"

    news = {128: "kvzip:budget=128,floor=0.5,recent=32", 256: NEW_256}
    news[512] = "kvzip:budget=512,floor=0.5,recent=64"
    return [
        "## kvzip's floor and recent rows",
        "",
        "The KL by position above shows where kvzip lost to snapkv: the first "
        "64 generated tokens, which read the context's last tokens in every "
        "layer. Two options decide what those layers hold after compression: "
        "`floor` (each head's best floor x budget rows are kept before the one "
        "threshold over the model) and `recent` (the context's newest rows kept "
        "in every head). They were swept on the second prose (Debian's licence "
        "texts), the best checked on the evaluation prose and on the agnostic "
        "passkey cases. Since these runs kvzip's defaults are `floor` 0.5 and "
        "`recent` a quarter of the budget, at most 64 (before: 0.1 and 0); "
        "every `kvzip` row elsewhere in this file that names neither was "
        "measured with the old ones.",
        "",
        meta("ppl_kvzip_choice_licenses", lic),
        "",
        *profile_rows(lic["continuation"]["table"]),
        "",
        *command("veloxpatch eval", lic["config"], KEYS),
        "",
        meta("ppl_kvzip_choice", ev),
        "",
        *profile_rows(ev["continuation"]["table"]),
        "",
        *command("veloxpatch eval", ev["config"], KEYS),
        "",
        "Agnostic passkey, the same 10 contexts x 2 questions as above (seed 0); "
        "`kvzip:budget=N` rows are the old defaults, from "
        "`passkey_agnostic_kvzip.json`:",
        "",
        meta("passkey_kvzip_choice", pk_res),
        "",
        *grid(pk, wilson),
        "",
        *command("veloxpatch eval", pk_res["config"], KEYS),
        "",
        f"- Continuation KL at 256 rows, new defaults: {z_e['kl']:.4f} on the "
        f"evaluation prose, **{_verdict(z_e['kl'], snap_e['kl'])}** `snapkv`'s "
        f"{snap_e['kl']:.4f} (old defaults {old_e['kl']:.4f}); {z_l['kl']:.3f} on "
        f"the licence texts, {_verdict(z_l['kl'], snap_l['kl'])} `snapkv`'s "
        f"{snap_l['kl']:.3f} (old {old_l['kl']:.3f}). KV held at the end: "
        f"{z_e['kv_mb']:.2f} MB against `snapkv`'s {snap_e['kv_mb']:.2f} MB.",
        "- Agnostic passkey, new defaults (old): "
        + "; ".join(pk_cell(b, n) for b, n in news.items())
        + ".",
        "",
    ]
