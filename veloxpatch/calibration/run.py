"""`calibrate`: one calibration run of any kind (`veloxpatch.calibrate`,
`veloxpatch calibrate`) on the calibration half of the built-in prose or a
file, each kind's work and file in its own module; `Progress`, the lines it
reports its progress and remaining time in."""

from __future__ import annotations

import sys
import time

from model_adapters.base import fingerprint

from ..caches.calibration_files import home_for_writing
from ..errors import CalibrationError
from ..prose import prose_tokens
from .a2ats import calibrate_codebook, save_codebook
from .kvzap import calibrate_scorer, save_scorer
from .qfilters import calibrate_filters, save_filters

ALGOS = ("qfilters", "a2ats", "kvzap")


def check_algo(algo: str) -> None:
    if algo not in ALGOS:
        raise CalibrationError(
            f"calibration exists for {', '.join(ALGOS)} only, not {algo!r}"
        )


class Progress:
    """A calibration's progress as lines on `stream` (default stderr): tokens
    read, then layers fitted, each with the stage's time so far and the time
    left at its rate so far; at most one line per `every` seconds, and each
    stage's last. `read` and `fitted` are `calibrate`'s `tick`, `fit_tick`."""

    def __init__(self, algo: str, tokens: int, layers: int, stream=None, every=2.0):
        self.algo, self.stream, self.every = algo, stream, every
        self.totals = {"tokens read": tokens, "layers fitted": layers}
        self.done = dict.fromkeys(self.totals, 0)
        self.started: dict[str, float] = {}
        self.mark = time.monotonic()  # the last step's time: a stage starts there
        self.printed = -float("inf")

    def read(self, n: int) -> None:
        self._step("tokens read", n)

    def fitted(self, n: int = 1) -> None:
        self._step("layers fitted", n)

    def say(self, line: str) -> None:
        stream = self.stream or sys.stderr
        print(f"calibrate {self.algo}: {line}", file=stream, flush=True)

    def _step(self, stage: str, n: int) -> None:
        now = time.monotonic()
        start = self.started.setdefault(stage, self.mark)
        self.mark = now
        self.done[stage] += n
        done, total = self.done[stage], self.totals[stage]
        if done < total and now - self.printed < self.every:
            return
        self.printed = now
        spent = now - start
        left = (
            "done"
            if done >= total
            else f"about {spent / done * (total - done):.0f} s left"
        )
        self.say(f"{done:,}/{total:,} {stage}, {spent:.0f} s, {left}")


def calibrate(
    model,
    tokenizer,
    algo="qfilters",
    *,
    tokens=4096,
    text="calibration",
    out=None,
    seed=0,
    tick=None,
    codebook_size=4096,
    far_position=2048,
    kind="linear",
    target="kvzip+",
    fit_tick=None,
    progress=True,
):
    """Calibrate `algo` on `tokens` tokens of calibration prose (the half never
    used for evaluation, or a file), written with the model's fingerprint to
    `out`, or without it to this model's file in the calibration cache
    (`$VELOXPATCH_HOME`, where the options naming no file find it); `out=False`
    writes nothing. qfilters: per layer [Hq, D] query-head filters and the
    queries; a2ats: per layer codebooks and the captured (keys, queries);
    kvzap: per layer surrogates of `kind` predicting `target` scores, and
    their held-out report. Progress and the time left go to stderr
    (`progress`) unless `tick` (tokens read) or `fit_tick` (layers fitted)
    take them."""
    check_algo(algo)
    ids = prose_tokens(tokenizer, tokens, text)
    shown = None
    if progress and tick is None and fit_tick is None:
        shown = Progress(algo, len(ids), len(model.layers))
        tick, fit_tick = shown.read, shown.fitted
    if out is None:
        out = home_for_writing(algo, fingerprint(model))
    info = {"tokens": tokens, "text": str(text), "seed": seed}
    ticks = {"tick": tick, "fit_tick": fit_tick}
    if algo == "kvzap":
        result = calibrate_scorer(
            model, tokenizer, ids, kind, seed=seed, target=target, **ticks
        )
        if out is not False:
            layers, report = result
            save_scorer(out, layers, model, kind, info | report, target=target)
    elif algo == "a2ats":
        result = calibrate_codebook(
            model,
            ids,
            size=codebook_size,
            far_position=far_position,
            seed=seed,
            **ticks,
        )
        if out is not False:
            books, captured = result
            n = next(c for c in captured if c is not None)[0].shape[1]
            info.update(size=codebook_size, vectors=int(n))
            save_codebook(out, books, model, far_position, info)
    else:
        result = calibrate_filters(model, ids, seed=seed, **ticks)
        if out is not False:
            per_head, queries = result
            info["vectors"] = int(next(q for q in queries if q is not None).shape[1])
            save_filters(out, per_head, model, info)
    if shown is not None and out is not False:
        shown.say(f"wrote {out}")
    return result
