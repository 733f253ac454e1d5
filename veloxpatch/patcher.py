"""The seam: a class-level wrapt wrapper with a per-instance switch.

mlx looks `__call__` up on the class, so each attention class is wrapped once
(where the name lives, with wrapt) and the wrapper asks a registry whether this
instance is patched. Unregistered instances run the original code untouched.
mlx modules are unhashable dicts, so the registry is keyed by `id()` and cleaned
by weakref callbacks. When the last patched instance of a class goes, the very
same original function object is put back on the class.
"""

from __future__ import annotations

import importlib
import inspect
import weakref
from dataclasses import dataclass, field

import mlx_lm
import wrapt

from .attention import patched_forward
from .errors import MlxLmChangedError, UnsupportedModelError
from .mlx_lm_internals import CHECKED_WITH, source_sha256


@dataclass
class _ClassPatch:
    owner: type
    original: object  # the function object found in cls.__dict__
    instances: set = field(default_factory=set)


_CLASSES: dict[type, _ClassPatch] = {}
# id -> (ref, forward): forward(wrapped, instance, args, kwargs) runs instead
_INSTANCES: dict[int, tuple[weakref.ref, object]] = {}


def _dispatch(wrapped, instance, args, kwargs):
    entry = _INSTANCES.get(id(instance))
    if entry is None or entry[0]() is not instance:
        return wrapped(*args, **kwargs)
    return entry[1](wrapped, instance, args, kwargs)


# target -> the __call__ found to match it (checked once per function object)
_CHECKED: dict = {}


def check_target(target) -> type:
    """The class still exists with the call signature and source the adapter
    was written for (its pins)."""
    try:
        cls = target.resolve()
    except (ImportError, AttributeError) as e:
        raise UnsupportedModelError(f"{target.key} not found in mlx-lm: {e}") from None
    call = cls.__dict__.get("__call__")
    call = getattr(call, "__wrapped__", call)  # a class already wrapped by us
    if call is None or not inspect.isfunction(call):
        raise UnsupportedModelError(f"{target.key}.__call__ is not a plain function")
    if _CHECKED.get(target) is call:
        return cls
    changed = []
    sig = str(inspect.signature(call))
    if sig != target.signature:
        changed.append(f"signature is now {sig}, was {target.signature}")
    if source_sha256(call) != target.source_sha256:
        changed.append("source changed")
    if changed:
        raise MlxLmChangedError(
            f"{target.key}.__call__ in mlx-lm {mlx_lm.__version__} differs from "
            f"{CHECKED_WITH}, the version this veloxpatch adapter was written "
            f"against: {', '.join(changed)}. Re-check the adapter against the new "
            "source and update its pins (python -m model_adapters.check "
            f"{target.key})"
        )
    _CHECKED[target] = call
    return cls


def _wrap_class(cls: type, module: str, name: str) -> _ClassPatch:
    cp = _CLASSES.get(cls)
    if cp is None:
        original = cls.__dict__["__call__"]
        where = importlib.import_module(module)
        wrapt.wrap_function_wrapper(where, f"{name}.__call__", _dispatch)
        cp = _CLASSES[cls] = _ClassPatch(cls, original)
    return cp


def _add(instance, cls: type, module: str, name: str, forward) -> int:
    """Route `instance`'s calls to `forward`; released when it is collected."""
    key = id(instance)
    if key in _INSTANCES:
        raise RuntimeError(f"{type(instance).__name__} already patched")
    cp = _wrap_class(cls, module, name)

    def _gone(_ref, key=key, cls=cls):
        if _INSTANCES is None:  # module globals already torn down at exit
            return
        _INSTANCES.pop(key, None)
        _release(cls, key)

    _INSTANCES[key] = (weakref.ref(instance, _gone), forward)
    cp.instances.add(key)
    return key


def _release(cls: type, key: int) -> None:
    cp = _CLASSES.get(cls)
    if cp is None:
        return
    cp.instances.discard(key)
    if not cp.instances:
        cls.__call__ = cp.original
        del _CLASSES[cls]


def register(sites, owner=None) -> list[int]:
    """Switch the given layer sites to the patched forward. All or nothing."""
    done: list[int] = []
    try:
        for site in sites:
            attn, target = site.attention, site.target

            def forward(wrapped, instance, args, kwargs, site=site):
                return patched_forward(site, wrapped, instance, args, kwargs, owner)

            if id(attn) in _INSTANCES:
                raise RuntimeError(f"attention of layer {site.index} already patched")
            done.append(_add(attn, type(attn), target.module, target.cls, forward))
    except BaseException:
        unregister(sites[: len(done)])
        raise
    return done


def unregister(sites) -> None:
    for site in sites:
        key = id(site.attention)
        entry = _INSTANCES.get(key)
        if entry is not None and entry[0]() is site.attention:
            del _INSTANCES[key]
            _release(type(site.attention), key)


def register_model(model, forward) -> None:
    """Route calls of the whole `model` to `forward(wrapped, model, args,
    kwargs)` (the patch sees each call's token ids and caller: kvzip's
    reconstruction, speculative decoding's verify calls)."""
    cls = type(model)
    if "__call__" not in cls.__dict__:
        raise RuntimeError(f"{cls.__name__} defines no __call__ of its own")
    _add(model, cls, cls.__module__, cls.__qualname__, forward)


def unregister_model(model) -> None:
    entry = _INSTANCES.get(id(model))
    if entry is not None and entry[0]() is model:
        del _INSTANCES[id(model)]
        _release(type(model), id(model))


def is_registered(attn) -> bool:
    entry = _INSTANCES.get(id(attn))
    return entry is not None and entry[0]() is attn


def wrapped_classes() -> list[type]:
    return list(_CLASSES)
