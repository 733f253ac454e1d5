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

import wrapt

from .attention import patched_forward
from .errors import UnsupportedModelError


@dataclass
class _ClassPatch:
    owner: type
    original: object  # the function object found in cls.__dict__
    instances: set = field(default_factory=set)


_CLASSES: dict[type, _ClassPatch] = {}
_INSTANCES: dict[int, tuple[weakref.ref, object]] = {}  # id -> (ref, LayerSite)


def _dispatch(wrapped, instance, args, kwargs):
    entry = _INSTANCES.get(id(instance))
    if entry is None or entry[0]() is not instance:
        return wrapped(*args, **kwargs)
    return patched_forward(entry[1], wrapped, instance, args, kwargs, entry[2])


def check_target(target) -> type:
    """The class still exists with the call signature the adapter was written for."""
    try:
        cls = target.resolve()
    except (ImportError, AttributeError) as e:
        raise UnsupportedModelError(f"{target.key} not found in mlx-lm: {e}") from None
    call = cls.__dict__.get("__call__")
    if call is None or not inspect.isfunction(getattr(call, "__wrapped__", call)):
        raise UnsupportedModelError(f"{target.key}.__call__ is not a plain function")
    sig = str(inspect.signature(getattr(call, "__wrapped__", call)))
    if sig != target.signature:
        raise UnsupportedModelError(
            f"{target.key}.__call__ signature changed to {sig}; this veloxpatch "
            f"adapter was written against mlx-lm 0.32 ({target.signature})"
        )
    return cls


def _wrap_class(cls: type, target) -> _ClassPatch:
    cp = _CLASSES.get(cls)
    if cp is None:
        original = cls.__dict__["__call__"]
        module = importlib.import_module(target.module)
        wrapt.wrap_function_wrapper(module, f"{target.cls}.__call__", _dispatch)
        cp = _CLASSES[cls] = _ClassPatch(cls, original)
    return cp


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
            attn = site.attention
            cls = type(attn)
            key = id(attn)
            if key in _INSTANCES:
                raise RuntimeError(f"attention of layer {site.index} already patched")
            cp = _wrap_class(cls, site.target)

            def _gone(_ref, key=key, cls=cls):
                if _INSTANCES is None:  # module globals already torn down at exit
                    return
                _INSTANCES.pop(key, None)
                _release(cls, key)

            _INSTANCES[key] = (weakref.ref(attn, _gone), site, owner)
            cp.instances.add(key)
            done.append(key)
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


def is_registered(attn) -> bool:
    entry = _INSTANCES.get(id(attn))
    return entry is not None and entry[0]() is attn


def wrapped_classes() -> list[type]:
    return list(_CLASSES)
