"""Every adapter target still exists in the installed mlx-lm, with the call
signature and source the adapter was written against: an upgrade fails loudly."""

import inspect

import mlx_lm
import pytest

from model_adapters import ADAPTERS, supported_model_types
from model_adapters.base import call_source_sha256
from veloxpatch import patcher

TARGETS = sorted({t for a in ADAPTERS for t in a.targets}, key=lambda t: t.key)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.key)
def test_target_matches_installed_mlx_lm(target):
    cls = target.resolve()
    call = cls.__dict__["__call__"]
    assert str(inspect.signature(call)) == target.signature
    assert call_source_sha256(cls) == target.source_sha256, (
        f"{target.key}.__call__ changed in mlx-lm {mlx_lm.__version__}: re-check the "
        "adapter against the new source, then update its hash"
    )
    assert patcher.check_target(target) is cls


def test_supported_types():
    expected = {"llama", "mistral", "ministral3", "mistral3"}
    expected |= {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe"}
    assert set(supported_model_types()) == expected


def test_pinned_minor_version():
    major, minor = (int(x) for x in mlx_lm.__version__.split(".")[:2])
    assert (major, minor) == (0, 32)
