"""How mlx-lm has split a model across processes, read off the model itself.

- Tensor parallel (`model.shard(group)`, what `mlx_lm.sharded_load` does): the
  q/k/v projections become sharded linears that hold the group, and each
  attention's `n_heads` / `n_kv_heads` are divided by the group size with `//=`.
  Heads that do not divide are split unevenly and mlx-lm fails later with a
  shape error (or worse); this is refused here, before anything is patched.
- Pipeline (`model.model.pipeline(group)`; qwen2, qwen3_moe and ministral3 have
  it in mlx-lm 0.32, llama, qwen3 and qwen2_moe do not): `model.layers` is this
  rank's run of layers, starting at global layer `start_idx`.
"""

from __future__ import annotations

from veloxpatch.errors import UnsupportedModelError
from veloxpatch.sharding import Shards


def model_shards(model, attentions: list) -> Shards:
    """The `Shards` of `model`, whose attention modules are `attentions`."""
    stage = pipeline_stage(model)
    group = tensor_group(attentions)
    if group is not None:
        check_heads_divide(model, attentions, group.size())
    if stage is None:
        return Shards(group=group)
    total = getattr(stage, "num_hidden_layers", None)
    if total is None:
        raise UnsupportedModelError(
            "pipeline-sharded model without num_hidden_layers: cannot number its "
            "layers globally"
        )
    return Shards(group=group, layer_offset=int(stage.start_idx), num_layers=total)


def pipeline_stage(model):
    """mlx-lm's pipelined inner model (a PipelineMixin split over more than one
    rank), or None."""
    for inner in (
        getattr(model, "model", None),
        getattr(getattr(model, "language_model", None), "model", None),
    ):
        if getattr(inner, "pipeline_size", 1) > 1:
            return inner
    return None


def tensor_group(attentions: list):
    """The group the attention heads are split over (None: not split)."""
    groups = [getattr(attn.q_proj, "group", None) for attn in attentions]
    groups = [g for g in groups if g is not None and g.size() > 1]
    if len({(g.size(), g.rank()) for g in groups}) > 1:
        raise UnsupportedModelError(
            "the attention layers are sharded over different groups"
        )
    return groups[0] if groups else None


def config_heads(model) -> tuple[int, int] | None:
    """(query heads, KV heads) of the whole model, from its config."""
    args = getattr(model, "args", None)
    for cfg in (getattr(args, "__dict__", None), getattr(args, "text_config", None)):
        if isinstance(cfg, dict) and isinstance(cfg.get("num_attention_heads"), int):
            heads = cfg["num_attention_heads"]
            return heads, cfg.get("num_key_value_heads") or heads
    return None


def check_heads_divide(model, attentions: list, ranks: int) -> None:
    """Every layer's query and KV heads split evenly over `ranks`."""
    fix = (
        f"model.shard() over {ranks} ranks splits the heads unevenly (mlx-lm "
        "fails later with a shape error); launch a number of processes that "
        "divides both head counts"
    )
    heads = config_heads(model)
    if heads is not None and (heads[0] % ranks or heads[1] % ranks):
        raise UnsupportedModelError(
            f"this model's {heads[0]} query heads and {heads[1]} KV heads do not "
            f"divide by {ranks}: {fix}"
        )
    for i, attn in enumerate(attentions):
        q_rows = attn.q_proj.weight.shape[0]
        k_rows = attn.k_proj.weight.shape[0]
        nq, nkv = int(attn.n_heads), int(attn.n_kv_heads)
        widths = {q_rows / nq if nq else 0, k_rows / nkv if nkv else 0}
        if getattr(attn, "head_dim", None):
            widths.add(attn.head_dim)
        if len(widths) != 1 or 0 in widths:
            raise UnsupportedModelError(
                f"layer {i} holds {nq} query heads for {q_rows} q_proj rows and "
                f"{nkv} KV heads for {k_rows} k_proj rows on this rank: {fix}"
            )
