"""kvzap's calibration: the model's own KVzip+ scores of calibration text, and
the per-layer surrogates fitted to them (KVzap, Jegou et al. 2026).
`target="kvzip"` fits KVzip's own scores instead (the maximum repeat
probability, without KVzip+'s ||W_o v|| / ||x|| weights).

The text is cut into segments (about 1,000 tokens, as KVzap's training texts,
so softmax denominators stay comparable). Each segment is prefilled into
`kvzip` caches with `plus=True`, the hidden state entering each layer's
attention kept (through the probe seam) at a seeded sample of positions past
the sinks, then kvzip's reconstruction pass scores every pair; the target of a
position is log(KVzip+ score) in each KV head. Per layer the surrogate is
fitted by ridge regression in closed form, its strength chosen by generalised
cross-validation (`linear`), or as a 2-layer GELU MLP
trained with mlx (`mlp`). Every fifth segment (or the last, with fewer than
five) is held out: R^2 and the rank correlation of predicted against true
scores on it are reported and stored with the file.
"""

from __future__ import annotations

import math
import time

import mlx.core as mx
import numpy as np

from model_adapters.base import fingerprint

from .. import api
from ..caches.calibration_files import KVZAP_FORMAT, SCORER_TARGETS, write
from ..caches.kvzap import surrogate_scores
from ..caches.kvzip import KVzipCache
from ..errors import CalibrationError
from ..probe import rows_at

SEGMENT = 1024  # tokens per calibration text
PER_SEGMENT = 512  # positions sampled per segment
SINKS = 4  # positions never sampled: kvzap keeps its sinks anyway
LOG_FLOOR = 1e-12  # scores that underflow to 0 are clipped before the log
RIDGES = (1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)  # relative strengths
MLP_HIDDEN = 128
MLP_EPOCHS = 15
MLP_LR = 5e-3
MLP_BATCH = 512


def segments_of(n_tokens: int, segment: int = SEGMENT) -> list[tuple[int, int]]:
    """(start, end) of at least two segments of about `segment` tokens."""
    count = max(2, n_tokens // segment)
    size = n_tokens // count
    return [(i * size, (i + 1) * size) for i in range(count)]


def held_out(count: int) -> list[bool]:
    """Which of `count` segments are held out: every fifth, or the last."""
    if count < 5:
        return [i == count - 1 for i in range(count)]
    return [i % 5 == 4 for i in range(count)]


# ---- scores and hidden states --------------------------------------------------
def collect(
    model,
    tokenizer,
    ids,
    *,
    segment=SEGMENT,
    per_segment=PER_SEGMENT,
    seed=0,
    chunk=512,
    tick=None,
    target="kvzip+",
):
    """Per segment (X, Y): per layer X [n, hidden] hidden states entering
    attention and Y [n, Hkv] log `target` scores (KVzip+ or KVzip) at n
    sampled positions (None for sliding-window layers)."""
    if api.patch_of(model) is not None:
        raise CalibrationError("kvzap calibration patches the model itself; restore it")
    rng = np.random.default_rng(seed)
    out = []
    plus = target == "kvzip+"
    with api.patched(model, "kvzip", plus=plus, budget=SINKS + 1) as patch:
        for a, b in segments_of(len(ids), segment):
            seg = list(ids[a:b])
            n = min(per_segment, len(seg) - SINKS)
            wanted = np.sort(rng.choice(np.arange(SINKS, len(seg)), n, replace=False))
            xs: dict[int, list] = {}
            watching = [True]

            def keep(seen, wanted=wanted, xs=xs, watching=watching):
                if not watching[0] or seen.x is None:
                    return
                idx = rows_at(wanted, seen)
                if idx is not None:
                    piece = seen.x[0][idx].astype(mx.float32)
                    mx.eval(piece)
                    xs.setdefault(seen.layer, []).append(piece)

            caches = patch.make_cache(probe=keep)
            for c in range(0, len(seg), chunk):
                mx.eval(model(mx.array(seg[c : c + chunk])[None], cache=caches))
            watching[0] = False
            KVzipCache.finish_context(model, caches, seg, tokenizer)
            X, Y = [], []
            for i, cache in enumerate(caches):
                if not isinstance(cache, KVzipCache):
                    X.append(None)
                    Y.append(None)
                    continue
                z = cache.row_scores()[0][:, mx.array(wanted)]  # [Hkv, n]
                X.append(np.array(mx.concatenate(xs[i], axis=0)))
                Y.append(np.log(np.maximum(np.array(z.T), LOG_FLOOR)))
            out.append((X, Y))
            if tick is not None:
                tick(b - a)
    return out


# ---- fits ------------------------------------------------------------------------
def fit_ridge(X: np.ndarray, Y: np.ndarray, ridge: float | None = None) -> dict:
    """{w1 [D, H], b1 [H]} minimising |Y - X w1 - b1|^2 + lam |w1|^2 in closed
    form (float64, Xc = X centred). lam = ridge x trace(Xc^T Xc) / D; with
    `ridge` None it is chosen from RIDGES by generalised cross-validation, which
    needs no split of the data (Golub, Heath and Wahba, 1979)."""
    X, Y = X.astype(np.float64), Y.astype(np.float64)
    mean_x, mean_y = X.mean(0), Y.mean(0)
    Xc, Yc = X - mean_x, Y - mean_y
    u, s, vt = np.linalg.svd(Xc, full_matrices=False)
    mean_eig = (s**2).sum() / X.shape[1]
    uy = u.T @ Yc
    if ridge is None:
        ridge = min(RIDGES, key=lambda r: _gcv(s, uy, Yc, r * mean_eig))
    shrink = s / (s**2 + ridge * mean_eig)  # [k]
    w = vt.T @ (shrink[:, None] * uy)
    return {"w1": w, "b1": mean_y - mean_x @ w}


def _gcv(s, uy, Yc, lam) -> float:
    """n |Y - Y_hat|^2 / (n - degrees of freedom)^2 of the ridge fit at lam."""
    f = s**2 / (s**2 + lam)
    resid = (Yc**2).sum() - ((2 * f - f**2)[:, None] * uy**2).sum()
    n = Yc.shape[0]
    return n * resid / max(n - f.sum(), 1e-9) ** 2


def fit_mlp(
    X: np.ndarray,
    Y: np.ndarray,
    *,
    hidden=MLP_HIDDEN,
    epochs=MLP_EPOCHS,
    lr=MLP_LR,
    batch=MLP_BATCH,
    seed=0,
    standardize=False,
    weight_decay=0.0,
) -> dict:
    """{w1, b1, w2, b2}: GELU(X w1 + b1) w2 + b2 trained with Adam on the
    mean squared error, `epochs` passes over shuffled batches. `standardize`:
    trained on X scaled to zero mean and unit variance per feature, the scaling
    folded into w1 and b1 afterwards (so the file's forward is unchanged);
    `weight_decay`: AdamW's decoupled decay (0: Adam)."""
    import mlx.optimizers as optim

    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    mean = X.mean(0) if standardize else np.zeros(X.shape[1])
    std = X.std(0) + 1e-6 if standardize else np.ones(X.shape[1])
    X = (X - mean) / std
    d, h = X.shape[1], Y.shape[1]
    bound1, bound2 = 1 / math.sqrt(d), 1 / math.sqrt(hidden)
    params = {
        "w1": mx.random.uniform(-bound1, bound1, (d, hidden)),
        "b1": mx.zeros((hidden,)),
        "w2": mx.random.uniform(-bound2, bound2, (hidden, h)),
        "b2": mx.array(Y.mean(0), mx.float32),  # start at the mean score
    }
    Xa, Ya = mx.array(X, mx.float32), mx.array(Y, mx.float32)

    def loss(p, x, y):
        return ((surrogate_scores(p, x[None])[0].T - y) ** 2).mean()

    step = mx.value_and_grad(loss)
    opt = optim.AdamW(learning_rate=lr, weight_decay=weight_decay)  # 0: Adam
    for _ in range(epochs):
        order = rng.permutation(len(X))
        for a in range(0, len(X), batch):
            idx = mx.array(order[a : a + batch])
            _, grads = step(params, Xa[idx], Ya[idx])
            params = opt.apply_gradients(grads, params)
            mx.eval(params, opt.state)
    out = {k: np.array(v) for k, v in params.items()}
    # GELU((x - mean) / std w1 + b1) = GELU(x (w1 / std) + b1 - (mean / std) w1)
    out["b1"] = (out["b1"] - (mean / std) @ out["w1"]).astype(np.float32)
    out["w1"] = (out["w1"] / std[:, None]).astype(np.float32)
    return out


def predict(weights: dict, X: np.ndarray) -> np.ndarray:
    """[n, H] the surrogate's scores of X [n, D] (the cache's own forward)."""
    w = {k: mx.array(v, mx.float32) for k, v in weights.items()}
    return np.array(surrogate_scores(w, mx.array(X, mx.float32)[None])[0].T)


def fit_quality(pred: np.ndarray, Y: np.ndarray) -> dict:
    """R^2 over every (position, head) and Spearman's rank correlation per
    head, averaged over heads."""
    sst = ((Y - Y.mean(0)) ** 2).sum()
    r2 = 1 - ((Y - pred) ** 2).sum() / sst if sst > 0 else 0.0
    rho = [_spearman(pred[:, h], Y[:, h]) for h in range(Y.shape[1])]
    return {"r2": round(float(r2), 4), "spearman": round(float(np.mean(rho)), 4)}


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


# ---- the whole job -----------------------------------------------------------------
def summary(report: list) -> dict:
    """Held-out quality over the layers of a `fit_layers` report: mean R^2,
    mean and worst rank correlation."""
    quality = [r for r in report if r is not None]
    rho = [r["spearman"] for r in quality]
    return {
        "mean_r2": round(float(np.mean([r["r2"] for r in quality])), 4),
        "mean_spearman": round(float(np.mean(rho)), 4),
        "min_spearman": round(float(min(rho)), 4),
    }


def fit_layers(data, fit, tick=None) -> tuple[list, list]:
    """(per layer weights `fit(X, Y)` of the segments not held out, None for
    sliding-window layers; per layer held-out quality) from `collect`'s data;
    `tick(1)` after each layer."""
    mask = held_out(len(data))
    train = [d for d, out in zip(data, mask) if not out]
    test = [d for d, out in zip(data, mask) if out]
    layers, report = [], []
    for i in range(len(data[0][0])):
        w = quality = None
        if data[0][0][i] is not None:
            w = fit(
                np.concatenate([d[0][i] for d in train]),
                np.concatenate([d[1][i] for d in train]),
            )
            Xt = np.concatenate([d[0][i] for d in test])
            Yt = np.concatenate([d[1][i] for d in test])
            quality = {"layer": i, **fit_quality(predict(w, Xt), Yt)}
        layers.append(w)
        report.append(quality)
        if tick is not None:
            tick(1)
    return layers, report


def calibrate_scorer(
    model,
    tokenizer,
    ids,
    kind="linear",
    *,
    seed=0,
    tick=None,
    segment=SEGMENT,
    target="kvzip+",
    fit_tick=None,
):
    """(per layer surrogate weights as mlx arrays, None for sliding-window
    layers; report) from `target` scores of `ids`, fitted on the segments not
    held out, judged on those held out. `tick(n)`: n more tokens scored;
    `fit_tick(1)`: one more layer fitted."""
    if kind not in ("linear", "mlp"):
        raise CalibrationError(f"kvzap surrogates are linear or mlp, not {kind!r}")
    if target not in SCORER_TARGETS:
        raise CalibrationError(
            f"kvzap surrogates predict {SCORER_TARGETS}, not {target!r}"
        )
    start = time.perf_counter()
    data = collect(
        model, tokenizer, ids, segment=segment, seed=seed, tick=tick, target=target
    )
    scored = time.perf_counter() - start
    mask = held_out(len(data))
    fit = fit_ridge if kind == "linear" else (lambda X, Y: fit_mlp(X, Y, seed=seed))
    weights, report = fit_layers(data, fit, fit_tick)
    layers = [
        None if w is None else {k: mx.array(v, mx.float32) for k, v in w.items()}
        for w in weights
    ]
    quality = [r for r in report if r is not None]
    info = {
        "kind": kind,
        "target": target,
        "segments": len(data),
        "segment_tokens": segments_of(len(ids), segment)[0][1],
        "held_out_segments": int(sum(mask)),
        "samples_per_segment": next(len(y) for y in data[0][1] if y is not None),
        "held_out": quality,
        **{k: v for k, v in summary(report).items() if k != "min_spearman"},
        "scoring_seconds": round(scored, 1),
        "fit_seconds": round(time.perf_counter() - start - scored, 1),
    }
    return layers, info


def save_scorer(path, layers: list, model, kind: str, info=None, target="kvzip+"):
    """Write per-layer kvzap surrogates ({w1, b1[, w2, b2]}, None for
    sliding-window layers) of `kind` ("linear" or "mlp"), predicting `target`
    scores ("kvzip+" or "kvzip"), with the model's fingerprint."""
    arrays = {
        f"layer.{i}.{k}": v.astype(mx.float32)
        for i, w in enumerate(layers)
        if w is not None
        for k, v in w.items()
    }
    fp = fingerprint(model)
    write(path, arrays, fp, KVZAP_FORMAT, "kvzap", info, kind=kind, target=target)
