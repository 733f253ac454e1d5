"""`algo="auto"`: a memory target in, the best measured configuration out.

A target is bytes ("24MB") or a ratio of the full cache ("20%": of each
prompt's full KV, what mlx-lm's own cache holds for it in the model's dtype).
It bounds what is held once the prompt is read: a configuration's rows are the
most whose decode-time bytes (`kv_budget.bound_bytes`) fit it.
"""

from __future__ import annotations

from .errors import OptionError


def full_bytes(model, n_tokens: int) -> int:
    """Bytes mlx-lm's own cache holds for `n_tokens` tokens on `model` (keys
    and values in the model's dtype, every layer veloxpatch would patch,
    without the allocation step's padding)."""
    from model_adapters import adapter_for

    from .caches.kv_budget import kv_dtype_size

    dims = adapter_for(model).dims(model)
    size = kv_dtype_size(model)
    layers = zip(dims.kv_heads, dims.head_dims, dims.sliding)
    return sum(h * n_tokens * 2 * d * size for h, d, s in layers if not s)


def held_options(model, algo: str, target_bytes: int, options: dict | None = None):
    """`options` (kv_bits...) with the budget whose bytes held once the prompt
    is read fit `target_bytes` on `model`: the rows `max_kv_bytes` would buy,
    without its bound on the prompt's peak (kvzip's reconstruction). Raises
    OptionError where the target buys too few rows."""
    from .api import make_options

    given = dict(options or {})
    given.pop("budget", None)
    cls, priced = make_options(
        algo, {**given, "max_kv_bytes": int(target_bytes)}, model
    )
    if "budget" not in cls.Options.option_names():
        raise OptionError(f"{algo!r} keeps every token: it has no budget")
    return {**given, "budget": priced.budget}
