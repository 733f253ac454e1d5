"""Per-architecture adapters: which mlx-lm attention classes to wrap and how to
read q, k and v out of them. One file per family, same shape in each."""

from .base import Adapter, AttentionTarget, LayerSite, model_type
from .llama import LlamaAdapter
from .mistral import MistralAdapter
from .qwen import QwenAdapter

ADAPTERS: tuple[Adapter, ...] = (LlamaAdapter(), MistralAdapter(), QwenAdapter())
BY_MODEL_TYPE = {t: a for a in ADAPTERS for t in a.model_types}


def supported_model_types() -> list[str]:
    return sorted(BY_MODEL_TYPE)


def adapter_for(model) -> Adapter:
    from veloxpatch.errors import UnsupportedModelError

    mt = model_type(model)
    if mt not in BY_MODEL_TYPE:
        raise UnsupportedModelError(
            f"unsupported model type {mt!r}; supported: "
            + ", ".join(supported_model_types())
        )
    return BY_MODEL_TYPE[mt]


__all__ = [
    "ADAPTERS",
    "Adapter",
    "AttentionTarget",
    "LayerSite",
    "adapter_for",
    "model_type",
    "supported_model_types",
]
