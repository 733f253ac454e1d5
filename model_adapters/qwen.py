"""Qwen: `qwen2` (q/k/v biases, inside the Linear layers), `qwen3` (per-head
q_norm/k_norm before RoPE), and the attention of the MoE variants, which is the
same computation in its own class."""

from .base import Adapter, AttentionTarget, project_plain, project_qk_norm

_SIGNATURE = (
    "(self, x: mlx.core.array, mask: Optional[mlx.core.array] = None, "
    "cache: Optional[Any] = None) -> mlx.core.array"
)
_QWEN2_SHA = "0d02f6cbda3a89f1227b0b1aaa4494e10fbf00ad3cde2e658aeddbd8c2409207"

QWEN2 = AttentionTarget(
    "mlx_lm.models.qwen2", "Attention", _SIGNATURE, _QWEN2_SHA, project_plain
)
QWEN2_MOE = AttentionTarget(
    "mlx_lm.models.qwen2_moe", "Attention", _SIGNATURE, _QWEN2_SHA, project_plain
)
QWEN3 = AttentionTarget(
    "mlx_lm.models.qwen3",
    "Attention",
    _SIGNATURE,
    "789af9d8868081c15ebcd8afbb603a57739aefb6e1a17d4817d660a08b34033e",
    project_qk_norm,
)
QWEN3_MOE = AttentionTarget(
    "mlx_lm.models.qwen3_moe",
    "Attention",
    _SIGNATURE,
    "9107ca69f9dfb65c3611e0286e424230a6f3f9951aab972c9088d1c7ad49b452",
    project_qk_norm,
)

_BY_TYPE = {
    "qwen2": QWEN2,
    "qwen2_moe": QWEN2_MOE,
    "qwen3": QWEN3,
    "qwen3_moe": QWEN3_MOE,
}


class QwenAdapter(Adapter):
    name = "qwen"
    model_types = tuple(_BY_TYPE)
    targets = tuple(_BY_TYPE.values())

    def target_for(self, model):
        return _BY_TYPE[model.model_type]
