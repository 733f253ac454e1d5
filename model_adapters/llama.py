"""mlx-lm's `llama` module: model types llama and mistral.

Llama-3 rope scaling lives in the module's own `rope`, which the patched forward
calls, so it needs nothing here. Sliding-window layers (`layer.use_sliding`, layer
types) keep mlx-lm's RotatingKVCache and run the original code.
"""

from .base import Adapter, AttentionTarget, project_plain

ATTENTION = AttentionTarget(
    module="mlx_lm.models.llama",
    cls="Attention",
    signature=(
        "(self, x: mlx.core.array, mask: Optional[mlx.core.array] = None, "
        "cache: Optional[Any] = None) -> mlx.core.array"
    ),
    source_sha256="3b9b8774b647f7a435d298ba29679f50d7add1ba9f062b4b8b3d5907be82de72",
    project=project_plain,
)


class LlamaAdapter(Adapter):
    name = "llama"
    model_types = ("llama", "mistral")
    targets = (ATTENTION,)
