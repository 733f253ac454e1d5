"""`veloxpatch bench`: prefill and decode speed, KV bytes and peak memory of any
arms at several context lengths, against unpatched mlx-lm in the same run.

Every arm prefills for real (no replay: prefill speed is what is measured)
through mlx-lm's generate_step; repeats interleave the arms in a rotating order
and the tables report medians, and the median of per-repeat ratios.

Peak memory is measured per phase: mlx's peak during the prefill (to the first
token) and during the decode, each above the memory in use before the prompt
(the weights), with the prefill chunk size (`prefill_step_size`) recorded; the
prefill's peak depends on it (one chunk's activations against the whole
context) and the decode's on the KV held.
"""

from __future__ import annotations

import gc
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

from ..memory import kv_bytes
from ..prose import check_length, prose_length, prose_tokens
from . import peers
from .arms import Arm, bind_to, chosen
from .sessions import arm_caches, mlx_kind

BASELINE = Arm("unpatched")
# medians in the table: KV held at the end; mlx's peak during the prefill and
# during the decode, above what was in use before the prompt; the whole peak
PEAK_KEYS = ("kv_bytes", "prefill_peak_bytes", "decode_peak_bytes")
PEAK_KEYS += ("peak_memory_bytes",)


def status_mb(field: str) -> float | None:
    """A /proc/self/status field in MB (VmRSS, VmHWM), None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_rss_peak() -> bool:
    """Reset the process's VmHWM to its current resident set (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def watch_kv_peak(caches):
    """A function giving the most KV bytes the caches held at once so far: our
    caches are read after every attention call, before any cut back (mlx-lm's
    only grow, or hold a window: their peak is at the end)."""
    peak = 0

    def watched(cache):
        inner = cache.after_attend

        def after_attend(q, new_rows):
            nonlocal peak
            peak = max(peak, kv_bytes(caches))
            inner(q, new_rows)

        cache.after_attend = after_attend  # on the instance: gone with it

    for c in caches:
        if hasattr(c, "after_attend"):
            watched(c)
    return lambda: peak


def measure(model, arm: Arm, ids, decode_tokens: int, step: int, rss=False) -> dict:
    """One generation through mlx-lm's generate_step: prefill tok/s (to the first
    token), decode tok/s after it, KV bytes held at the end, and mlx's peak
    memory during the prefill and during the decode apart, each above what was
    in use before the prompt (the weights and the empty caches); the most KV
    bytes held at once (`kv_peak_bytes`).

    The prefill runs from the prompt to the first token out (every prompt
    chunk of `step` tokens, the last prompt token's step, and the step of the
    second token, which mlx-lm issues before handing out the first); then mlx is
    synchronized and its peak reset, and the decode's peak covers the rest.
    `peak_memory_bytes` is the whole generation's peak, weights included.

    `rss=True` (a process of its own, Linux): also the process's peak resident
    set (VmHWM, reset through /proc/self/clear_refs) per phase, mlx's buffer
    cache emptied before each phase so that freed buffers are not counted."""
    kind = mlx_kind(arm)
    # mlx.quantized: mlx-lm itself converts the caches (kv_bits, start 0)
    extra = peers.generation_kwargs(kind, arm.options) if kind else {}
    with arm_caches(model, arm, [], None, step) as (caches, _):
        mx.eval([c.state for c in caches if getattr(c, "keys", None) is not None])
        kv_peak = watch_kv_peak(caches)
        gc.collect()  # an earlier arm's arrays, freed later, would count against it
        mx.synchronize()
        rss_out = {}
        if rss:
            mx.clear_cache()
            reset_rss_peak()
            rss_out["rss_before_mb"] = status_mb("VmRSS")
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        steps = generate_step(
            mx.array(ids),
            model,
            max_tokens=decode_tokens + 1,
            prompt_cache=caches,
            prefill_step_size=step,
            **extra,
        )
        next(steps)
        mx.synchronize()  # the second token's step, issued already, is done
        t1 = time.perf_counter()
        prefill_peak = mx.get_peak_memory()
        kv_prefill = kv_bytes(caches)
        if rss:
            rss_out["peak_rss_prefill_mb"] = status_mb("VmHWM")
            mx.clear_cache()
            reset_rss_peak()
            rss_out["rss_decode_start_mb"] = status_mb("VmRSS")
        mx.reset_peak_memory()
        t2 = time.perf_counter()
        n = sum(1 for _ in steps)
        mx.synchronize()
        t3 = time.perf_counter()
        decode_peak = mx.get_peak_memory()
        if rss:
            rss_out["peak_rss_decode_mb"] = status_mb("VmHWM")
        return {
            "prefill_tok_per_s": len(ids) / (t1 - t0),
            "prefill_seconds": t1 - t0,
            "decode_tok_per_s": n / (t3 - t2) if n else float("nan"),
            "decoded": n,
            "kv_bytes": kv_bytes(caches),
            "kv_bytes_prefill_end": kv_prefill,
            "kv_peak_bytes": max(kv_peak(), kv_prefill, kv_bytes(caches)),
            "active_before_bytes": before,
            "prefill_peak_bytes": prefill_peak - before,
            "decode_peak_bytes": decode_peak - before,
            "peak_memory_bytes": max(prefill_peak, decode_peak),
            **rss_out,
        }


def run(
    model,
    tokenizer,
    arms,
    contexts,
    *,
    repeats=3,
    decode_tokens=32,
    step=2048,
    text="evaluation",
    tick=lambda: None,
):
    """Raw measurements and the per (context, arm) table of medians and ratios.
    A text too short for the longest context, or an arm whose options do not
    fit the model, is refused before anything runs."""
    check_length(prose_length(tokenizer, text), max(contexts, default=0), text)
    bind_to(model, arms)
    arms = [BASELINE] + [a for a in arms if a.label != BASELINE.label]
    raw = []
    for context in contexts:
        ids = prose_tokens(tokenizer, context, text)
        # auto's pick for this prompt, as mlx-lm's generate would make it: once
        uses = {arm.label: chosen(model, arm, len(ids)) for arm in arms}
        for r in range(repeats):
            order = arms[r % len(arms) :] + arms[: r % len(arms)]
            for arm in order:
                use = uses[arm.label]
                m = measure(model, use, ids, decode_tokens, step)
                raw.append(
                    {
                        "context": context,
                        "repeat": r,
                        "arm": arm.label,
                        **({} if use is arm else {"chose": use.label}),
                        "prefill_step_size": step,
                        **m,
                    }
                )
            tick()
    return raw, summarize(raw, arms, contexts)


def summarize(raw, arms, contexts) -> list[dict]:
    table = []
    for context in contexts:
        base = {
            r["repeat"]: r
            for r in raw
            if r["context"] == context and r["arm"] == BASELINE.label
        }
        for arm in arms:
            mine = [r for r in raw if r["context"] == context and r["arm"] == arm.label]
            row = {
                "context": context,
                "arm": arm.label,
                "algo": arm.algo,
                "budget": arm.options.get("budget"),
            }
            for key in ("prefill_tok_per_s", "decode_tok_per_s"):
                row[key] = statistics.median(m[key] for m in mine)
                row[key.replace("tok_per_s", "ratio")] = statistics.median(
                    m[key] / base[m["repeat"]][key] for m in mine
                )
            for key in PEAK_KEYS:
                row[key] = statistics.median(m[key] for m in mine)
            row["prefill_step_size"] = mine[0].get("prefill_step_size")
            table.append(row)
    return table


def format_table(table) -> str:
    """The table `veloxpatch bench` prints: speeds, their ratios to unpatched,
    KV held, the prefill and decode peaks above the memory in use before the
    prompt, and the whole peak (weights included), with the chunk size."""
    steps = sorted(
        {t["prefill_step_size"] for t in table if t.get("prefill_step_size")}
    )
    lines = []
    if steps:
        lines.append(
            f"prefill chunk {', '.join(map(str, steps))} tokens; prefill pk and "
            "decode pk: mlx's peak above the memory in use before the prompt"
        )
    lines.append(
        f"{'ctx':>6} {'arm':<34} {'prefill':>8} {'ratio':>6} {'decode':>7} "
        f"{'ratio':>6} {'KV MB':>8} {'prefill pk':>10} {'decode pk':>9} "
        f"{'peak MB':>8}"
    )
    for t in table:
        lines.append(
            f"{t['context']:>6} {t['arm']:<34} {t['prefill_tok_per_s']:8.1f} "
            f"{t['prefill_ratio']:6.2f} {t['decode_tok_per_s']:7.2f} "
            f"{t['decode_ratio']:6.2f} {t['kv_bytes'] / 1e6:8.1f} "
            f"{t['prefill_peak_bytes'] / 1e6:10.1f} "
            f"{t['decode_peak_bytes'] / 1e6:9.1f} "
            f"{t['peak_memory_bytes'] / 1e6:8.1f}"
        )
    return "\n".join(lines)
