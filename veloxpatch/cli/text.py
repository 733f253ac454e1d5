"""Text the CLI reads from the user (--prompt, stdin, --context): strict UTF-8,
one line naming the byte where it is not."""

from __future__ import annotations

import sys

from .checks import UserError


def _utf8(text: str, where: str) -> str:
    """`text` from argv (undecodable bytes arrive as lone surrogates) as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        byte = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code < 0xDD00 else "text"
        raise UserError(
            f"{where} is not valid UTF-8 ({byte} at character {e.start})"
        ) from None
    return text


def decode_utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        byte = f"byte 0x{data[e.start]:02x} at offset {e.start}"
        raise UserError(f"{where} is not valid UTF-8 ({byte})") from None


def read_prompt(prompt: str | None) -> str:
    """The prompt from --prompt, or stdin read as bytes and decoded as UTF-8."""
    if prompt is not None:
        text = _utf8(prompt, "--prompt")
    else:
        if sys.stdin is None or sys.stdin.isatty():
            raise UserError("no prompt: give --prompt or pipe text on stdin")
        binary = getattr(sys.stdin, "buffer", None)
        if binary is None:  # a text stream (already decoded, perhaps lossily)
            text = _utf8(sys.stdin.read(), "stdin")
        else:
            text = decode_utf8(binary.read(), "stdin")
    if not text.strip():
        raise UserError("empty prompt: give --prompt or pipe text on stdin")
    return text
