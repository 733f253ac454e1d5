"""Mistral's newer families: `ministral3` and the `mistral3` wrapper.

Ministral 3 passes `attn_scale` positionally and multiplies the rotated queries
by it (a position-dependent query scale), so the adapter hands it to the cache.
`mistral3` holds a text model that is either ministral3 or llama; `mistral4`
(MLA attention) is not supported.
"""

from veloxpatch.errors import UnsupportedModelError
from veloxpatch.mlx_lm_internals import llama_4_attn_scale

from . import llama
from .base import Adapter, AttentionTarget, project_plain


def ministral3_query_scale(attn, L: int, offset: int, call: dict):
    scale = call.get("attn_scale")
    if scale is None:  # mlx-lm computes it itself when the caller passes none
        scale = llama_4_attn_scale(
            L, offset, attn.scaling_beta, attn.original_max_position_embeddings
        )
    return scale


MINISTRAL3_ATTENTION = AttentionTarget(
    module="mlx_lm.models.ministral3",
    cls="Attention",
    signature=(
        "(self, x: mlx.core.array, attn_scale: Optional[mlx.core.array] = None, "
        "mask: Optional[mlx.core.array] = None, cache: Optional[Any] = None) "
        "-> mlx.core.array"
    ),
    source_sha256="dc931792a5813d574a3c595cdb21d6a5099aacd54dd7c914f8048e415268f380",
    project=project_plain,
    params=("attn_scale", "mask", "cache"),
    query_scale=ministral3_query_scale,
)


class MistralAdapter(Adapter):
    name = "mistral"
    model_types = ("ministral3", "mistral3")
    targets = (MINISTRAL3_ATTENTION, llama.ATTENTION)

    def target_for(self, model):
        if getattr(model, "model_type", None) != "mistral3":
            return MINISTRAL3_ATTENTION
        text_type = model.args.text_config.get("model_type")
        if text_type == "ministral3":
            return MINISTRAL3_ATTENTION
        if text_type == "mistral4":
            raise UnsupportedModelError(
                "mistral3 with a mistral4 text model (MLA attention) is not "
                "supported by veloxpatch"
            )
        return llama.ATTENTION
