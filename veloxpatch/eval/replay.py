"""Prefill once, derive every arm.

When a prompt fits in one prefill chunk, every layer of every algorithm sees the
same q/k/v for that chunk (eviction is deferred, so the chunk attends densely),
and each cache's state after it depends only on that layer's inputs. So: run the
prompt once through capturing caches that record each layer's pre-RoPE q, k, v
(with its rope, scale and query scale), then build any algorithm's caches by
replaying those calls into fresh caches. The result is the same state a direct
run produces (tested), at the cost of the attention alone.

Arms that differ only in `budget` share even that: a single-call prefill attends
the same way whatever the budget (eviction is deferred to `after_attend`), so
the attended state is computed once and each arm runs `after_attend` on a copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from .. import api
from ..caches.phase import share_phase
from ..probe import run_probe


@dataclass
class Captured:
    calls: list  # per layer: list of (q, k, v, rope, scale, query_scale, x)
    tokens: list[int]  # the tokens processed
    o_projs: list  # per layer: its output projection (kvzap's KVzip+ weights)
    # (algo, options but budget) -> per layer (cache before after_attend, its q)
    attended: dict = field(default_factory=dict)

    def caches(self, algo: str, options: dict | None = None, chunks=None, bound=None):
        """Fresh caches of `algo` in the state a direct run over `tokens` leaves
        (exact when the captured run processed them in one call)."""
        # `bound`: the patch's options for `options` (loaded calibration files)
        opts = bound or api.make_options(algo, options)[1]
        cls = api.algorithm(algo).for_options(opts)
        n = len(self.calls)
        # caches that cut inside a call (compress="chunks") attend it whole here,
        # which is not what a direct run gives (sessions.arm_caches prefills them)
        cuts = getattr(opts, "prompt_chunk", lambda: None)() is not None
        if chunks or cuts or any(len(calls) != 1 for calls in self.calls):
            caches = [cls(opts, layer, n) for layer in range(n)]
            # one phase from the start: the last layer to attend a call sees
            # every layer's rows (kvzap's model-wide choice), as in a direct run
            share_phase(caches)
            for cache, calls, o_proj in zip(caches, self.calls, self.o_projs):
                for q, k, v, rope, scale, query_scale, x in _split(calls, chunks):
                    cache.layer_input = (x, o_proj)  # as the patched layer hands it
                    cache.attend(
                        q, k, v, rope=rope, scale=scale, query_scale=query_scale
                    )
                    cache.layer_input = None
                _ = cache.state  # as mlx-lm does after each prefill chunk
        else:
            rest = {k: v for k, v in (options or {}).items() if k != "budget"}
            key = (algo, repr(sorted(rest.items())))
            if key not in self.attended:
                self.attended[key] = self._attend_once(cls, opts)
            caches = []
            for base, q in self.attended[key]:
                cache = base.clone()
                cache.options = opts
                cache.after_attend(q, q.shape[2])
                _ = cache.state
                caches.append(cache)
            share_phase(caches)  # as make_cache: model-wide choices see every layer
        caches[0].phase.record(0, self.tokens)  # as the patch records a prompt
        mx.eval([c.arrays() for c in caches])
        return caches

    def _attend_once(self, cls, opts):
        """Per layer, a cache that attended the single captured call but has not
        run `after_attend` yet, with the (roped, scaled) queries it would get."""
        out = []
        for layer, ((q, k, v, rope, scale, query_scale, x),) in enumerate(self.calls):
            cache, seen = cls(opts, layer, len(self.calls)), []
            cache.after_attend = lambda q, new_rows, seen=seen: seen.append(q)
            cache.layer_input = (x, self.o_projs[layer])
            cache.attend(q, k, v, rope=rope, scale=scale, query_scale=query_scale)
            cache.layer_input = None
            del cache.after_attend  # the class hook again
            mx.eval(cache.arrays(), seen)
            out.append((cache, seen[0]))
        return out


def _split(calls, chunks):
    """Optionally re-cut one recorded call into chunks (for benchmarks only: the
    q/k/v of later chunks would differ in a direct run once rows are evicted)."""
    if not chunks or len(calls) != 1:
        yield from calls
        return
    q, k, v, rope, scale, query_scale, x = calls[0]
    start = 0
    for L in chunks:
        sl = slice(start, start + L)
        qs = query_scale[..., sl, :] if query_scale is not None else None
        yield q[:, :, sl], k[:, :, sl], v[:, :, sl], rope, scale, qs, x[:, sl]
        start += L


def capture_prefill(model, tokens) -> Captured:
    """Run `tokens` through the model in one call and record every layer."""
    if api.patch_of(model) is not None:
        raise RuntimeError("capture_prefill needs an unpatched model")
    calls = [[] for _ in model.layers]
    o_projs = [None] * len(model.layers)

    def record(seen):
        call = (seen.q_pre, seen.k_pre, seen.v, seen.rope, seen.scale)
        calls[seen.layer].append((*call, seen.query_scale, seen.x))
        o_projs[seen.layer] = seen.o_proj

    run_probe(model, list(tokens), record, chunk=max(1, len(tokens)))
    if not all(calls):
        raise RuntimeError("replay needs veloxpatch caches on every layer")
    mx.eval([[(q, k, v, x) for q, k, v, *_, x in layer] for layer in calls])
    return Captured(calls, list(tokens), o_projs)
