"""One rank of the sharded-model test (`test_sharded.py` starts two on loopback
as `mlx.launch -n 2 --backend ring` would).

Every rank builds the same seeded tiny model twice: one stays whole, the other
is split over the ranks (`model.shard()`, heads; `model.model.pipeline()`,
layers). For every algorithm (CONTRACT's small budgets, so that the run evicts
in prefill and in decode) both generate greedily through mlx-lm; the rank
records whether its tokens equal the whole model's and whether each of its
caches keeps, per KV head, exactly the positions the whole model's cache of that
layer keeps for that head. Results go to OUT/rank{r}.json.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
from mlx_lm.generate import batch_generate

sys.path.insert(0, str(Path(__file__).parent))

from helpers import greedy  # noqa: E402
from test_contract import CHUNKED, CONTRACT, HEAD_DIM, QUANTIZED, has_option  # noqa: E402
from tiny import prompt_tokens, resolve_options, tiny_model  # noqa: E402

import veloxpatch  # noqa: E402
from veloxpatch.caches.base import PAD_POSITION, VeloxCache  # noqa: E402
from veloxpatch.errors import VeloxpatchError  # noqa: E402

PROMPT, NEW, STEP = 44, 8, 13  # prompt tokens, generated tokens, prefill chunk
LAYERS = 2  # pipeline: one layer per rank
# kv_bits variants of the algorithms that quantize rows before they evict them
# (those that hold the whole prompt until it ends): eviction leaves holes in
# quantized slots and compaction lays each head's rows out again, which every
# rank must do at the same steps and to the same number of slots
QUANTIZE_FIRST = ("snapkv", "adakv", "qfilters", "expected_attention")


def variants() -> list[tuple[str, str, dict]]:
    """(id, algo, options): every algorithm, kv_bits on those that quantize
    before evicting, the query recipe's rotation (signs drawn for every head of
    a layer) and adaptive head budgets (shared by all heads of a layer)."""
    out = []
    for algo in veloxpatch.algos():
        opts = CONTRACT[algo]
        out.append((algo, algo, opts))
        if algo in QUANTIZE_FIRST:
            assert has_option(algo, "kv_bits")
            out.append((f"{algo}-kv8", algo, {**opts, **QUANTIZED}))
    query = dict(kv_bits=2, kv_residual=4)  # the query recipe, 2 bits' default
    out.append(("snapkv-kv2", "snapkv", {**CONTRACT["snapkv"], **query}))
    out.append(("kivi-2", "kivi", dict(bits=2, residual=4)))
    # cut mid-call every 8 prompt tokens, the heads of every rank sharing rows
    out.append(("adakv-chunks", "adakv", {**CONTRACT["adakv"], **CHUNKED}))
    kvzip = {**CONTRACT["kvzip"], "layerwise": True}  # (pipeline: per layer)
    out.append(("kvzip-layerwise", "kvzip", kvzip))
    kvzap = {**CONTRACT["kvzap"], "layerwise": True}
    out.append(("kvzap-layerwise", "kvzap", kvzap))
    kvzap = {**CONTRACT["kvzap"], "threshold": 0.0, "budget": 16}
    out.append(("kvzap-threshold", "kvzap", kvzap))
    for algo in ("h2o", "expected_attention"):  # adakv is in the registry
        opts = {**CONTRACT[algo], "head_budget": "adaptive"}
        out.append((f"{algo}-headadaptive", algo, opts))
    return out


def held(cache) -> dict | None:
    """What a cache holds: per batch item and KV head the positions (padding
    left out), the bit width, and how many rows are quantized."""
    if not isinstance(cache, VeloxCache):
        return None
    pos = cache.positions_view().tolist()
    store = getattr(cache, "store", None)
    return {
        "kept": [[sorted(p for p in h if p != PAD_POSITION) for h in b] for b in pos],
        "bits": None if store is None else store.bits,
        "quantized": getattr(cache, "quantized", None),
    }


def my_heads(whole: dict, lo: int, n: int) -> dict:
    """The whole model's cache of a layer, restricted to KV heads lo .. lo + n - 1."""
    return {
        "kept": [b[lo : lo + n] for b in whole["kept"]],
        "bits": whole["bits"],
        "quantized": whole["quantized"],
    }


# mlx-lm's batch generation on the split model: its pipeline stages set the
# last layer's cache `keys`, and its batches deep-copy their sequences
BATCHED = (
    ("full", "full", {}),
    ("snapkv-kv8", "snapkv", {**CONTRACT["snapkv"], **QUANTIZED}),
    ("kvzap-layerwise", "kvzap", {**CONTRACT["kvzap"], "layerwise": True}),
)
TOKENIZER = SimpleNamespace(eos_token_ids=[-1], decode=lambda t: "")


def run_batch(model, algo, opts, prompt):
    prompts = [prompt.tolist(), prompt[: PROMPT // 2].tolist()]
    with veloxpatch.patched(model, algo=algo, **opts):
        got = batch_generate(
            model,
            TOKENIZER,
            prompts,
            max_tokens=NEW,
            prefill_step_size=STEP,
            return_token_ids=True,
        )
    return got.token_ids


def run(model, algo, opts, prompt):
    with veloxpatch.patched(model, algo=algo, **opts) as patch:
        caches = patch.make_cache()
        tokens, _ = greedy(
            model, prompt, n=NEW, prefill_step_size=STEP, prompt_cache=caches
        )
        return tokens, [held(c) for c in caches]


def compare(whole, split, shards, heads_per_rank: int) -> dict:
    """Tokens and, per layer this rank holds, what it holds for its heads."""
    tokens_w, held_w = whole
    tokens_s, held_s = split
    lo = shards.rank * heads_per_rank
    bad = []
    for i, mine in enumerate(held_s):
        layer = shards.layer_offset + i
        ref = held_w[layer]
        want = None if ref is None else my_heads(ref, lo, heads_per_rank)
        if mine != want:
            bad.append({"layer": layer, "rank": mine, "whole": want})
    return {
        "tokens": tokens_s,
        "whole_tokens": tokens_w,
        "tokens_equal": tokens_s == tokens_w,
        "kept_equal": not bad,
        "mismatch": bad[:1],
    }


def refusals(group) -> dict:
    """Heads that do not divide, and a model sharded after apply: clear errors."""
    out = {}
    odd = tiny_model("llama", num_attention_heads=6, num_key_value_heads=3, head_dim=16)
    odd.shard(group)
    try:
        veloxpatch.apply(odd, "tova", **CONTRACT["tova"])
        out["uneven"] = None
    except VeloxpatchError as e:
        out["uneven"] = str(e)
    late = tiny_model("llama", head_dim=HEAD_DIM)
    patch = veloxpatch.apply(late, "snapkv", **CONTRACT["snapkv"])
    late.shard(group)
    try:
        patch.make_cache()
        out["sharded_after_apply"] = None
    except VeloxpatchError as e:
        out["sharded_after_apply"] = str(e)
    patch.restore()
    # a kvzap scorer file fitted to another model, read on a split model: every
    # rank refuses it (the whole model's fingerprint, computed together)
    other = tiny_model("llama", seed=5, head_dim=HEAD_DIM)
    opts = resolve_options(other, CONTRACT["kvzap"])
    split = tiny_model("llama", head_dim=HEAD_DIM)
    split.shard(group)
    try:
        veloxpatch.apply(split, "kvzap", **opts)
        out["kvzap_other_model"] = None
    except VeloxpatchError as e:
        out["kvzap_other_model"] = str(e)
    return out


def main(out_dir: str) -> None:
    group = mx.distributed.init()
    rank = group.rank()
    prompt = prompt_tokens(PROMPT)
    result: dict = {"rank": rank, "size": group.size(), "runs": {}}
    # tensor parallel on llama (4 query heads, 2 KV heads: one per rank), and
    # pipeline stages on qwen2 (rank 1 runs layer 0, rank 0 layer 1)
    for split in ("tensor", "pipeline"):
        if split == "tensor":
            config = dict(arch="llama", head_dim=HEAD_DIM)
        else:  # qwen2 has no head_dim option: 4 heads of 32
            config = dict(arch="qwen2", hidden_size=4 * HEAD_DIM)
        whole = tiny_model(**config, num_hidden_layers=LAYERS)
        model = tiny_model(**config, num_hidden_layers=LAYERS)
        if split == "tensor":
            model.shard(group)
        else:
            model.model.pipeline(group)
        from model_adapters import adapter_for

        shards = adapter_for(model).shards(model)
        kv_here = model.layers[0].self_attn.n_kv_heads
        for name, algo, opts in variants():
            if split == "pipeline" and name in ("kvzip", "kvzap"):
                continue  # one choice over all layers: refused on a stage
            if algo == "kvzap":  # the scorer file is fitted to the whole model
                opts = resolve_options(whole, opts)
            start = time.perf_counter()
            try:
                got = compare(
                    run(whole, algo, opts, prompt),
                    run(model, algo, opts, prompt),
                    shards,
                    kv_here,
                )
            except Exception:
                got = {"error": traceback.format_exc()}
            got["seconds"] = round(time.perf_counter() - start, 2)
            result["runs"][f"{split}/{name}"] = got
        for name, algo, opts in BATCHED:
            opts = resolve_options(whole, opts)
            try:
                tokens = [run_batch(m, algo, opts, prompt) for m in (whole, model)]
                got = {
                    "tokens": tokens[1],
                    "whole_tokens": tokens[0],
                    "tokens_equal": tokens[1] == tokens[0],
                    "kept_equal": True,  # (the batch's caches are not returned)
                }
            except Exception:
                got = {"error": traceback.format_exc()}
            result["runs"][f"{split}/batch-{name}"] = got
    result["refusals"] = refusals(group)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
