"""`keyformer` (Adnan et al., 2024): H2O with a Gumbel-perturbed, tempered score.

Each query adds softmax((logits + g) / tau) to the keys' accumulated scores,
g ~ Gumbel(0, 1) redrawn every call from a seeded generator; tau rises linearly
from `tau_init` to `tau_end` over `tau_steps` decode steps (the paper anneals
over the generation; prefill uses `tau_init`). Kept: sinks, the `recent`
newest rows and the best accumulated scores. Positions are never renumbered.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from .h2o import H2OCache, H2OOptions
from .options import check_int, check_number, option


@dataclasses.dataclass
class KeyformerOptions(H2OOptions):
    """`tau_init`, `tau_end`: temperature schedule (paper: 1 to 2);
    `tau_steps`: decode steps to anneal over; `seed`: Gumbel noise seed."""

    tau_init: float = option(1.0, check_number, 0, lo_open=True)
    tau_end: float = option(2.0, check_number, 0, lo_open=True)
    tau_steps: int = option(256, check_int, 1)
    seed: int = option(0, check_int, 0, 2**31 - 1)  # mixed into a uint64 key


class KeyformerCache(H2OCache):
    name = "keyformer"
    batchable = True  # one cache per sequence (caches/batch.py)
    summary = "accumulated Gumbel-perturbed, tempered attention + recent"
    Options = KeyformerOptions

    def __init__(self, options=None, layer=0, num_layers=1):
        super().__init__(options, layer, num_layers)
        self.calls = 0
        self.decode_steps = 0

    def tau(self) -> float:
        o = self.options
        frac = min(1.0, self.decode_steps / o.tau_steps)
        return o.tau_init + (o.tau_end - o.tau_init) * frac

    def weights(self, logits, probs, queries=None):
        """Tempered Gumbel softmax of one tile of a call of `queries` (a prompt
        call when more than one) queries; every tile draws its own noise."""
        o = self.options
        key = mx.random.key(o.seed * 1_000_003 + self.layer * 7_919 + self.calls)
        # drawn for every KV head of the layer, so a sharded model's ranks get
        # the noise of their own heads, as unsharded
        B, Hkv, *rest = logits.shape
        every = mx.random.gumbel((B, Hkv * self.shards.size, *rest), key=key)
        noise = self.shards.my_heads(every)
        prompt = (queries or logits.shape[3]) > 1
        tau = o.tau_init if prompt else self.tau()
        self.calls += 1
        self.decode_steps += not prompt
        return mx.softmax((logits + noise) / tau, axis=-1)

    def extra_meta(self):
        return {"calls": self.calls, "decode_steps": self.decode_steps}

    def load_extra_meta(self, m):
        self.calls, self.decode_steps = int(m["calls"]), int(m["decode_steps"])
