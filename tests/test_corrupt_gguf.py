"""Damaged model files (GGUF; a model directory's safetensors): one clear
one-line error each, never a crash.

mx.load trusts a GGUF header and dies with SIGSEGV/SIGFPE on a damaged one, so
every case is loaded in a subprocess: a crash fails that case instead of the
suite. One runner process takes all the tiny-file cases in turn and is
restarted after the case that killed it, if any.
"""

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import smollm

from veloxpatch.loading.fileformat import check_gguf

ROOT = Path(__file__).resolve().parents[1]
STRING, ARRAY, UINT32, FLOAT32, FLOAT64 = 8, 9, 4, 6, 12
F32, Q4_1 = 0, 3


# ---- a tiny GGUF writer ------------------------------------------------------------
def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _array(etype, items) -> bytes:
    fmt = {UINT32: "<I", FLOAT32: "<f", FLOAT64: "<d"}
    body = b"".join(
        _str(x) if etype == STRING else struct.pack(fmt[etype], x) for x in items
    )
    return struct.pack("<IQ", etype, len(items)) + body


def gguf(kvs, tensors, alignment=32):
    """(bytes, {field: offset}) of a GGUF v3 file; tensors are (name, dims in
    GGML order, type, data)."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)))
    at = {"version": 4, "tensor count": 8, "kv count": 16}
    for key, vtype, payload in kvs:
        at[f"key {key}"] = len(out)
        out += _str(key) + struct.pack("<I", vtype)
        at[f"value {key}"] = len(out)
        out += payload
    data, offsets = bytearray(), []
    for _, _, _, blob in tensors:
        data += b"\0" * (-len(data) % alignment)
        offsets.append(len(data))
        data += blob
    for (name, dims, ttype, _), offset in zip(tensors, offsets):
        at[f"name {name}"] = len(out)
        out += _str(name)
        at[f"n_dims {name}"] = len(out)
        out += struct.pack("<I", len(dims))
        at[f"dims {name}"] = len(out)
        out += b"".join(struct.pack("<Q", d) for d in dims)
        at[f"type {name}"] = len(out)
        out += struct.pack("<I", ttype)
        at[f"offset {name}"] = len(out)
        out += struct.pack("<Q", offset)
    out += b"\0" * (-len(out) % alignment)
    at["data"] = len(out)
    return bytes(out + data), at


KVS = [
    ("general.architecture", STRING, _str("llama")),
    ("general.alignment", UINT32, struct.pack("<I", 32)),
    ("tokenizer.ggml.tokens", ARRAY, _array(STRING, ["a", "bc", "<|im_end|>"])),
    ("tokenizer.ggml.scores", ARRAY, _array(FLOAT32, [0.0, 1.0, 2.0])),
]
TENSORS = [
    ("token_embd.weight", [32, 3], F32, struct.pack("<96f", *range(96))),
    ("blk.0.attn_q.weight", [32, 2], Q4_1, bytes(range(40))),
]
VALID, AT = gguf(KVS, TENSORS)


def put(fmt, field, value, delta=0, base=VALID):
    b = bytearray(base)
    struct.pack_into(fmt, b, AT[field] + delta, value)
    return bytes(b)


CASES = {
    **{f"truncated at {n}": VALID[:n] for n in (0, 3, 12, 23, 40)},
    "truncated in the token strings": VALID[: AT["value tokenizer.ggml.tokens"] + 30],
    "truncated in the tensor table": VALID[: AT["dims blk.0.attn_q.weight"] + 3],
    "truncated before the data": VALID[: AT["data"]],
    "truncated by one byte": VALID[:-1],
    "magic": b"GGUG" + VALID[4:],
    "version 1": put("<I", "version", 1),
    "version 65535": put("<I", "version", 65535),
    "tensor count 2**63": put("<Q", "tensor count", 2**63),
    "tensor count + 1": put("<Q", "tensor count", 3),
    "kv count 2**64-1": put("<Q", "kv count", 2**64 - 1),
    "kv count + 1": put("<Q", "kv count", 5),
    "key length 2**40": put("<Q", "key general.architecture", 2**40),
    "string length 2**62": put("<Q", "value general.architecture", 2**62),
    "string length + 1": put("<Q", "value general.architecture", 6),
    "array length 2**62": put("<Q", "value tokenizer.ggml.tokens", 2**62, 4),
    "array length 2**31": put("<Q", "value tokenizer.ggml.scores", 2**31, 4),
    "array element type 99": put("<I", "value tokenizer.ggml.tokens", 99),
    "token string length 2**50": put("<Q", "value tokenizer.ggml.tokens", 2**50, 12),
    "value type 13": put("<I", "value general.alignment", 13, -4),
    "alignment 0": put("<I", "value general.alignment", 0),
    "alignment 3": put("<I", "value general.alignment", 3),
    "alignment 2**31": put("<I", "value general.alignment", 2**31),
    "n_dims 9": put("<I", "n_dims token_embd.weight", 9),
    "n_dims 2**31": put("<I", "n_dims token_embd.weight", 2**31),
    "dim 2**40": put("<Q", "dims token_embd.weight", 2**40),
    "dim 2**31": put("<Q", "dims blk.0.attn_q.weight", 2**31, 8),
    "dim 2**63 and a zero dim": put(
        "<Q", "dims token_embd.weight", 0, 8, put("<Q", "dims token_embd.weight", 2**63)
    ),
    "Q4_1 rows of 31": put("<Q", "dims blk.0.attn_q.weight", 31),
    "tensor type 4 (removed)": put("<I", "type token_embd.weight", 4),
    "tensor type 5 (removed)": put("<I", "type blk.0.attn_q.weight", 5),
    "tensor type 2**31": put("<I", "type token_embd.weight", 2**31),
    "tensor offset 2**60": put("<Q", "offset blk.0.attn_q.weight", 2**60),
    "tensor offset past the end": put("<Q", "offset blk.0.attn_q.weight", 416),
    "tensor offset misaligned": put("<Q", "offset blk.0.attn_q.weight", 388),
    "float64 metadata": gguf(KVS + [("x", FLOAT64, struct.pack("<d", 1.5))], TENSORS)[
        0
    ],
    "float64 array": gguf(KVS + [("x", ARRAY, _array(FLOAT64, [1.0, 2.0]))], TENSORS)[
        0
    ],
    "nested array": gguf(
        KVS + [("x", ARRAY, struct.pack("<IQ", ARRAY, 1) + _array(UINT32, [1]))],
        TENSORS,
    )[0],
    "duplicate key": gguf(KVS + KVS[:1], TENSORS)[0],
    "not UTF-8 key": VALID.replace(b"general.architecture", b"general.\xffrchitecture"),
}
# Every header byte, flipped: each must load or fail cleanly.
SWEEP = {
    f"byte {i} ^ {mask:#x}": VALID[:i] + bytes([VALID[i] ^ mask]) + VALID[i + 1 :]
    for i in range(AT["data"])
    for mask in (0x01, 0x80, 0xFF)
}

RUNNER = """
import json, sys
from veloxpatch.errors import VeloxpatchError
from veloxpatch.loading.gguf import read_gguf
paths = json.load(open(sys.argv[1]))
for i in range(int(sys.argv[2]), len(paths)):
    print(json.dumps({"i": i, "started": True}), flush=True)
    try:
        read_gguf(paths[i])
        out = {"ok": True}
    except VeloxpatchError as e:
        out = {"error": [c.__name__ for c in type(e).__mro__], "message": str(e)}
    except Exception as e:
        out = {"raw": f"{type(e).__name__}: {e}"}
    print(json.dumps({"i": i, **out}), flush=True)
"""


def run_all(paths, tmp_path) -> list[dict]:
    """Each path's result in the runner; a case that killed it gets its signal."""
    listing = tmp_path / "paths.json"
    listing.write_text(json.dumps([str(p) for p in paths]))
    results, start = [None] * len(paths), 0
    while start < len(paths):
        proc = subprocess.run(
            [sys.executable, "-c", RUNNER, str(listing), str(start)],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        last = start
        for line in proc.stdout.splitlines():
            r = json.loads(line)
            last = r["i"]
            if not r.get("started"):
                results[last] = r
        if proc.returncode == 0:
            break
        results[last] = {"rc": proc.returncode, "stderr": proc.stderr[-500:]}
        start = last + 1
    return results


def write(tmp_path, cases) -> list[Path]:
    paths = []
    for i, data in enumerate(cases.values()):
        paths.append(tmp_path / f"case{i}.gguf")
        paths[-1].write_bytes(data)
    return paths


def test_the_tiny_file_is_valid(tmp_path):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(VALID)
    info = check_gguf(path)
    assert (info.tensors, info.keys, info.data_offset) == (2, 4, AT["data"])
    assert run_all([path], tmp_path) == [{"i": 0, "ok": True}]


def test_damaged_headers_give_one_clear_error(tmp_path):
    paths = write(tmp_path, CASES)
    results = run_all(paths, tmp_path)
    for (name, _), path, r in zip(CASES.items(), paths, results):
        assert "rc" not in r, f"{name}: the loader crashed: {r}"
        assert "ModelFileError" in r.get("error", []), f"{name}: {r}"
        assert "\n" not in r["message"] and str(path) in r["message"], name


def test_every_flipped_header_byte_loads_or_fails_cleanly(tmp_path):
    paths = write(tmp_path, SWEEP)
    results = run_all(paths, tmp_path)
    crashed = {n: r for n, r in zip(SWEEP, results) if "rc" in r}
    raw = {n: r for n, r in zip(SWEEP, results) if "raw" in r}
    assert not crashed and not raw, (list(crashed.items())[:3], list(raw.items())[:3])
    errors = [r for r in results if "error" in r]
    assert all("VeloxpatchError" in r["error"] for r in errors)
    assert all("\n" not in r["message"] for r in errors)
    assert len(errors) > len(SWEEP) // 3  # most flips are caught


# ---- the embedded model: a copy of its header, sparse beyond -----------------------
def _cli(path):
    script = "import sys; from veloxpatch.cli import main; main()"
    return subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "generate",
            "--model",
            str(path),
            "--prompt",
            "hi",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


@smollm
def test_the_embedded_models_header_damaged(tmp_path):
    from veloxpatch.loading.models import embedded_model_path

    real = embedded_model_path()
    info = check_gguf(real)
    size = real.stat().st_size
    with open(real, "rb") as f:
        header = f.read(info.data_offset)
    tokens = header.find(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens")
    first_tensor = header.find(b"token_embd.weight") - 8

    def sparse(name, data, length=size):
        path = tmp_path / f"{name}.gguf"
        with open(path, "wb") as f:
            f.write(data)
            f.truncate(length)  # the tensor data read as zeros, never copied
        return path

    # The fields overwritten below are where the test thinks they are.
    assert struct.unpack_from("<II", header, tokens) == (ARRAY, STRING)
    assert struct.unpack_from("<Q", header, first_tensor) == (17,)

    def at(offset, fmt, value):
        b = bytearray(header)
        struct.pack_into(fmt, b, offset, value)
        return bytes(b)

    cases = {
        "header only": sparse("header", header, info.data_offset),
        "cut in the tokenizer": sparse("cut", header[:tokens], tokens),
        "tensor count 2**62": sparse("tensors", at(8, "<Q", 2**62)),
        "kv count 2**62": sparse("kvs", at(16, "<Q", 2**62)),
        "token count 2**40": sparse("tokens", at(tokens + 8, "<Q", 2**40)),
        "first token length 2**40": sparse("token", at(tokens + 16, "<Q", 2**40)),
        "tensor name length 2**40": sparse("name", at(first_tensor, "<Q", 2**40)),
    }
    assert check_gguf(sparse("intact", header)).data_offset == info.data_offset
    for name, path in cases.items():
        res = _cli(path)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2, (
            f"{name}: exit {res.returncode}: {res.stderr[-500:]}"
        )
        assert len(lines) == 1 and str(path) in lines[0], f"{name}: {res.stderr}"
        assert "damaged or unreadable GGUF" in lines[0], name


def test_a_model_directory_with_a_damaged_shard(tmp_path):
    from veloxpatch.loading.models import ModelFileError, load

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "model.safetensors").write_bytes(b"\x10" + bytes(7) + b"{}")
    with pytest.raises(ModelFileError, match="model.safetensors: damaged"):
        load(tmp_path)


def test_missing_or_unreadable_paths(tmp_path):
    from veloxpatch.loading.gguf import ModelFileError, read_gguf

    with pytest.raises(ModelFileError, match="not found"):
        read_gguf(tmp_path / "missing.gguf")
    with pytest.raises(ModelFileError, match="cannot read"):
        read_gguf(tmp_path)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelFileError, match="no GGUF header"):
        read_gguf(tmp_path / "empty.gguf")
