"""What an adapter pins for an attention class, ready to paste into its
AttentionTarget, and whether the project's pin (if any) still matches.

    python -m model_adapters.check mlx_lm.models.llama.Attention

Exit status: 0 (the pin matches, or there is none), 1 (it differs), 2 (bad input).
"""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import textwrap

from . import ADAPTERS
from .base import call_source_sha256


def resolve(path: str) -> type:
    """The class at `module.Class`, with a `__call__` of its own (the patcher
    wraps that one); LookupError says what is wrong."""
    module, _, name = path.rpartition(".")
    if not module or not name:
        raise LookupError(f"expected module.Class, got {path!r}")
    try:
        found = importlib.import_module(module)
    except Exception as e:  # importing runs the module's code: any failure is bad input
        raise LookupError(f"cannot import {module}: {e}") from None
    cls = getattr(found, name, None)
    if not isinstance(cls, type):
        raise LookupError(f"module {module} has no class {name}")
    if not inspect.isfunction(cls.__dict__.get("__call__")):
        raise LookupError(f"{path} defines no __call__ of its own")
    return cls


def pin_lines(signature: str, sha: str) -> list[str]:
    # wrapped at spaces, which stay, so the pieces concatenate to the exact string
    pieces = textwrap.wrap(signature, 70, drop_whitespace=False, expand_tabs=False)
    if "".join(pieces) != signature:
        pieces = [signature]
    quoted = [f"        {json.dumps(p)}" for p in pieces]
    return ["    signature=(", *quoted, "    ),", f'    source_sha256="{sha}",']


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if len(args) != 1:
            raise LookupError("usage: python -m model_adapters.check module.Class")
        cls = resolve(args[0])
    except LookupError as e:
        print(f"model_adapters.check: {e}", file=sys.stderr)
        return 2
    signature = str(inspect.signature(cls.__dict__["__call__"]))
    sha = call_source_sha256(cls)
    print("\n".join(pin_lines(signature, sha)))
    pin = next((t for a in ADAPTERS for t in a.targets if t.key == args[0]), None)
    if pin is None:
        print("# not pinned by any adapter")
        return 0
    users = ", ".join(a.name for a in ADAPTERS if pin in a.targets)
    now = {"signature": signature, "source_sha256": sha}
    stale = [k for k, v in now.items() if getattr(pin, k) != v]
    verdict = f"differs in {', '.join(stale)}" if stale else "matches"
    print(f"# pinned by adapter(s) {users}: {verdict}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
