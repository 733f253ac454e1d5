"""Damaged saved caches and calibration files: one clear error each, never a
crash, never a raw mlx/json/KeyError. "Re-signed" files carry a valid checksum
over bad content, as a buggy writer would make them: only the format checks
can catch those."""

import json
import re

import mlx.core as mx
import numpy as np
import pytest
from tiny import dims_of, prompt_tokens, tiny_model

import veloxpatch
from veloxpatch.caches.calibration_files import load_codebook, load_filters
from veloxpatch.calibration.a2ats import calibrate_codebook, save_codebook
from veloxpatch.calibration.qfilters import (
    capture_queries,
    query_filters,
    save_filters,
)
from veloxpatch.checked_io import CHECKSUM_KEY, save_checked
from veloxpatch.errors import CacheFileError, CalibrationError, FileFormatError
from veloxpatch.loading.safetensors_header import check_safetensors

KINDS = ["filters", "book", "cache"]
ERROR = {"filters": CalibrationError, "book": CalibrationError, "cache": CacheFileError}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def files(tmp_path_factory, model):
    d = tmp_path_factory.mktemp("files")
    queries = capture_queries(model, prompt_tokens(96, seed=5).tolist(), chunk=32)
    save_filters(d / "filters", [query_filters(q) for q in queries], model)
    ids = prompt_tokens(400, seed=4).tolist()
    books, _ = calibrate_codebook(model, ids, size=16, far_position=2048)
    save_codebook(d / "book", books, model, 2048)
    swa = tiny_model("mistral_swa")  # mlx-lm RotatingKVCache layers as well
    with veloxpatch.patched(swa, "streaming_llm", budget=16) as patch:
        caches = patch.make_cache()
        swa(prompt_tokens(40)[None], cache=caches)
        veloxpatch.save_cache(d / "cache", caches, {"note": "x"})
    return d


def load(kind, path, model):
    if kind == "filters":
        return load_filters(path, dims_of(model))
    if kind == "book":
        return load_codebook(path, 2048, dims_of(model))
    return veloxpatch.load_cache(path)


def fails(kind, path, model, match=None):
    with pytest.raises(ERROR[kind]) as info:
        load(kind, path, model)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg, msg
    assert match is None or re.search(match, msg), msg
    return msg


def header_end(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


def resign(files, kind, tmp_path, meta=None, arrays=None):
    """A copy of `kind` with edited metadata/arrays and a valid checksum."""
    a, m = mx.load(str(files / kind), format="safetensors", return_metadata=True)
    m.pop(CHECKSUM_KEY)
    m.update(meta or {})
    m = {k: v for k, v in m.items() if v is not None}
    for name, edit in (arrays or {}).items():
        a[name] = edit(a[name])
        if a[name] is None:
            del a[name]
    path = tmp_path / f"{kind}.resigned"
    save_checked(path, a, m, RuntimeError)
    return path


@pytest.mark.parametrize("kind", KINDS)
def test_intact_files_load_from_the_exact_path(files, kind, model):
    assert not list(files.glob("*.safetensors"))  # no suffix appended
    assert load(kind, files / kind, model)
    assert load(kind, str(files / kind), model)


@pytest.mark.parametrize("kind", KINDS)
def test_truncated_files(files, kind, model, tmp_path):
    data = (files / kind).read_bytes()
    end = header_end(data)
    for cut in (0, 4, 8, 9, end // 2, end - 1, end, end + 3, len(data) - 1):
        path = tmp_path / f"cut{cut}"
        path.write_bytes(data[:cut])
        fails(kind, path, model)


@pytest.mark.parametrize("kind", KINDS)
def test_every_header_bit_flip_and_sampled_data_flips(files, kind, model, tmp_path):
    data = (files / kind).read_bytes()
    end = header_end(data)
    path = tmp_path / "flipped"
    flips = [(i, 0x01) for i in range(end)] + [(i, 0x80) for i in range(0, end, 7)]
    flips += [(int(i), 0xFF) for i in np.linspace(end, len(data) - 1, 40)]
    for i, mask in flips:
        path.write_bytes(data[:i] + bytes([data[i] ^ mask]) + data[i + 1 :])
        fails(kind, path, model)


@pytest.mark.parametrize("kind", KINDS)
def test_header_length_overwritten(files, kind, model, tmp_path):
    data = (files / kind).read_bytes()
    for n in (0, 1, len(data) - 7, 2**63, 2**64 - 1):
        path = tmp_path / f"len{n}"
        path.write_bytes(n.to_bytes(8, "little") + data[8:])
        fails(kind, path, model, "header length")


@pytest.mark.parametrize("kind", KINDS)
def test_missing_empty_directory_foreign(files, kind, model, tmp_path):
    fails(kind, tmp_path / "missing", model, "not found")
    fails(kind, tmp_path, model, "not a regular file")
    (tmp_path / "empty").write_bytes(b"")
    fails(kind, tmp_path / "empty", model, "too short")
    (tmp_path / "text").write_text("not a file at all")
    fails(kind, tmp_path / "text", model)
    other = "book" if kind != "book" else "filters"
    fails(kind, files / other, model, "not a veloxpatch")


@pytest.mark.parametrize("kind", KINDS)
def test_a_file_without_checksum_is_refused(files, kind, model, tmp_path):
    a, m = mx.load(str(files / kind), format="safetensors", return_metadata=True)
    del m[CHECKSUM_KEY]
    mx.save_safetensors(str(tmp_path / "old.safetensors"), a, m)
    fails(kind, tmp_path / "old.safetensors", model, "no checksum")


def scale(s):
    return lambda x: x * s


def zero(x):
    return mx.zeros_like(x)


def drop(x):
    return None


FINITE_DAMAGE = {
    "filters": [
        ({"fingerprint": "[]"}, {}, "fingerprint"),
        ({"fingerprint": "null"}, {}, "fingerprint"),
        ({"fingerprint": "{"}, {}, "fingerprint"),
        ({"fingerprint": None}, {}, "fingerprint"),
        ({}, {"layer.1.kv_heads": zero}, "unit"),
        ({}, {"layer.1.query_heads": zero, "layer.1.kv_heads": zero}, "unit"),
        ({}, {"layer.0.kv_heads": scale(1e30), "layer.0.query_heads": scale(1e30)}, ""),
        ({}, {"layer.2.kv_heads": scale(2.0)}, "unit"),
        ({}, {"layer.2.kv_heads": scale(0.5)}, "group means"),
        ({}, {"layer.0.query_heads": scale(1.5), "layer.0.kv_heads": scale(1.5)}, ""),
        ({}, {"layer.0.kv_heads": lambda x: x[::-1]}, "group means"),
        ({}, {"layer.0.kv_heads": lambda x: x * mx.nan}, "not finite"),
        ({}, {"layer.1.query_heads": drop}, "missing"),
        ({}, {"layer.1.kv_heads": lambda x: x[:, :8]}, "missing"),
    ],
    "book": [
        ({"far_position": "abc"}, {}, "not a number"),
        ({"far_position": ""}, {}, "not a number"),
        ({"far_position": "-5"}, {}, "not a number"),
        ({"far_position": "2048.0"}, {}, "not a number"),
        ({"far_position": None}, {}, "not a number"),
        ({"far_position": "1024"}, {}, "calibrated with far_position 1024"),
        ({"fingerprint": "[]"}, {}, "fingerprint"),
        ({}, {"layer.0.transform": zero}, "Cholesky"),
        ({}, {"layer.0.transform": scale(1e30)}, "Cholesky"),
        ({}, {"layer.0.transform": lambda x: x + 0.1}, "Cholesky"),
        ({}, {"layer.0.transform": lambda x: x * -1}, "Cholesky"),
        ({}, {"layer.1.centroids": scale(1e30)}, "overflow"),
        ({}, {"layer.1.centroids": scale(1e30), "layer.1.tcentroids": scale(1e30)}, ""),
        ({}, {"layer.1.tcentroids": scale(2.0)}, "disagree"),
        ({}, {"layer.2.centroids": zero, "layer.2.tcentroids": zero}, "coincide"),
        ({}, {"layer.2.centroids": lambda x: x * mx.inf}, "not finite"),
        ({}, {"layer.2.tcentroids": drop}, "missing"),
        ({}, {"layer.2.centroids": lambda x: x[:, :3]}, "shapes"),
    ],
}


@pytest.mark.parametrize(
    "kind,meta,arrays,match",
    [(k, *case) for k, cases in FINITE_DAMAGE.items() for case in cases],
)
def test_resigned_calibration_damage(files, model, tmp_path, kind, meta, arrays, match):
    fails(kind, resign(files, kind, tmp_path, meta, arrays), model, match)


def test_resigned_zero_filters_are_refused_before_patching(files, model, tmp_path):
    path = resign(files, "filters", tmp_path, arrays={"layer.1.kv_heads": zero})
    with pytest.raises(CalibrationError, match="unit"):
        veloxpatch.apply(model, "qfilters", budget=12, window=2, filters=str(path))
    assert veloxpatch.api.patch_of(model) is None and "make_cache" not in vars(model)


INDEX_DAMAGE = [
    ("not json", "not JSON"),
    ("[]", "format"),
    ('{"format": 1, "caches": [], "metadata": {}}', "format 1"),
    ('{"format": 2, "metadata": {}}', "no cache list"),
    ('{"format": 2, "caches": {}, "metadata": {}}', "no cache list"),
    ('{"format": 2, "caches": [], "metadata": []}', "no cache list"),
    ('{"format": 2, "caches": [1], "metadata": {}}', "layer 0"),
]


def entry_edit(layer, **changes):
    def edit(caches):
        for key, value in changes.items():
            if value is None:
                caches[layer].pop(key, None)
            else:
                caches[layer][key] = value

    return edit


ENTRY_DAMAGE = [
    (entry_edit(1, kind="other"), "layer 1"),
    (entry_edit(1, arrays=None), "layer 1"),
    (entry_edit(1, arrays="keys"), "layer 1"),
    (entry_edit(1, scalars=[]), "layer 1"),
    (entry_edit(1, algo="nope"), "unknown algorithm 'nope'"),
    (entry_edit(1, meta=[]), "layer 1 meta state"),
    (entry_edit(0, **{"class": "mx"}), "unknown mlx-lm cache 'mx'"),
    (entry_edit(0, **{"class": "load_prompt_cache"}), "unknown mlx-lm cache"),
    (entry_edit(0, meta={"a": 1}), "layer 0 meta state"),
    (entry_edit(1, arrays=["keys", "nothing"]), "lacks arrays"),
    (entry_edit(1, meta={"options": "{"}), "does not load"),
    (entry_edit(1, meta={"options": "{}"}), "does not load"),
    (entry_edit(0, scalars={}), "does not load"),
]


@pytest.mark.parametrize("index,match", INDEX_DAMAGE)
def test_resigned_cache_index_damage(files, model, tmp_path, index, match):
    fails(
        "cache", resign(files, "cache", tmp_path, {"veloxpatch": index}), model, match
    )


@pytest.mark.parametrize("edit,match", ENTRY_DAMAGE)
def test_resigned_cache_entry_damage(files, model, tmp_path, edit, match):
    _, m = mx.load(str(files / "cache"), format="safetensors", return_metadata=True)
    info = json.loads(m["veloxpatch"])
    edit(info["caches"])
    index = json.dumps(info)
    fails(
        "cache", resign(files, "cache", tmp_path, {"veloxpatch": index}), model, match
    )


def test_missing_index_key_and_dropped_array(files, model, tmp_path):
    fails("cache", resign(files, "cache", tmp_path, {"veloxpatch": None}), model)
    a, _ = mx.load(str(files / "cache"), format="safetensors", return_metadata=True)
    name = next(k for k in a if k.startswith("1/"))
    path = resign(files, "cache", tmp_path, arrays={name: drop})
    fails("cache", path, model, "lacks arrays")


def test_save_writes_exactly_the_path_and_whole(files, tmp_path):
    caches = veloxpatch.load_cache(files / "cache")
    veloxpatch.save_cache(tmp_path / "noext", caches)
    veloxpatch.save_cache(tmp_path / "c.safetensors", caches)
    veloxpatch.save_cache(tmp_path / "c.safetensors", caches)  # over an older one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors", "noext"]
    assert len(veloxpatch.load_cache(str(tmp_path / "noext"))) == len(caches)
    with pytest.raises(CacheFileError, match="cannot write"):
        veloxpatch.save_cache(tmp_path / "missing" / "c", caches)
    with pytest.raises(CacheFileError, match="cannot write"):
        veloxpatch.save_cache(tmp_path, caches)  # a directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors", "noext"]


def test_check_safetensors_reads_the_header_only(files):
    header = check_safetensors(files / "book")
    assert header["__metadata__"]["format"] == "veloxpatch-a2ats/1"
    assert all(
        isinstance(CacheFileError("x"), c) for c in (FileFormatError, ValueError)
    )
