"""Q5_0 tensors rewritten as Q8_0 (llama/repack.py): the values, the file around them,
what a damaged header does, and the cache's rules, on small GGUF files made here. The
default model's own copy is checked in tests/e2e/llama/test_repack_model.py."""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sfcore_daemon.llama import repack

F32 = 0


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def make_gguf(tensors: list[tuple[bytes, tuple[int, ...], int, bytes]],
              alignment: int = 32, extra_kv: tuple[bytes, ...] = ()) -> bytes:
    """A GGUF v3 file: a string, a string array, a u32 array and the alignment as KV
    pairs (and `extra_kv`); `tensors` as (name, dims, ggml type, data)."""
    kv = [*extra_kv,
        _string(b"general.name") + struct.pack("<I", 8) + _string(b"tiny"),
        _string(b"tokenizer.tokens") + struct.pack("<IIQ", 9, 8, 3)
        + b"".join(_string(t) for t in (b"a", b"bc", b"\xe2\x82\xac")),
        _string(b"some.ids") + struct.pack("<IIQ", 9, 4, 2) + struct.pack("<II", 7, 9),
        _string(b"general.alignment") + struct.pack("<II", 4, alignment),
    ]
    infos, blobs, offset = [], [], 0
    for name, dims, ggml_type, data in tensors:
        infos.append(_string(name) + struct.pack("<I", len(dims))
                     + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", ggml_type, offset))
        padded = data + b"\0" * (-len(data) % alignment)
        blobs.append(padded)
        offset += len(padded)
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)) + b"".join(kv) + b"".join(infos)
    return head + b"\0" * (-len(head) % alignment) + b"".join(blobs)


def q5_0_values(block: bytes) -> list[int]:
    """ggml's dequantize_row_q5_0 for one block, as integers (the scale left out)."""
    qh = int.from_bytes(block[2:6], "little")
    qs = block[6:22]
    first = [((qs[j] & 0x0F) | (((qh >> j) << 4) & 0x10)) - 16 for j in range(16)]
    second = [((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)) - 16 for j in range(16)]
    return first + second


def q8_0_values(block: bytes) -> list[int]:
    return list(np.frombuffer(block[2:34], dtype=np.int8))


@given(st.lists(st.binary(min_size=22, max_size=22), min_size=1, max_size=40))
def test_every_q5_0_block_becomes_the_q8_0_block_of_the_same_numbers(blocks: list[bytes]) -> None:
    q8 = repack.q5_0_to_q8_0(np.frombuffer(b"".join(blocks), np.uint8).reshape(-1, 22))
    assert q8.shape == (len(blocks), 34)
    for q5_block, q8_row in zip(blocks, q8, strict=True):
        raw = q8_row.tobytes()
        assert raw[:2] == q5_block[:2]  # the same half-float scale, bit for bit
        assert q8_0_values(raw) == q5_0_values(q5_block)


def _tiny(rng: np.random.Generator) -> tuple[bytes, bytes, bytes]:
    q5 = rng.integers(0, 256, size=4 * 2 * 22, dtype=np.uint8).tobytes()  # 2 rows of 128
    f32 = rng.standard_normal(7, dtype=np.float32).tobytes()
    other = rng.integers(0, 256, size=3 * 34, dtype=np.uint8).tobytes()
    data = make_gguf([(b"norm", (7,), F32, f32), (b"q5", (128, 2), repack.GGML_Q5_0, q5),
                      (b"q8", (96,), repack.GGML_Q8_0, other)])
    return data, q5, f32


def test_the_rewritten_file_holds_the_same_tensors_with_q5_0_as_q8_0(tmp_path: Path) -> None:
    data, q5, f32 = _tiny(np.random.default_rng(5))
    layout = repack.read_layout(data)
    out = tmp_path / "out.gguf"
    assert repack.write_repacked(data, layout, out) == 1
    written = out.read_bytes()
    new = repack.read_layout(written)
    assert new.kv == layout.kv and new.n_kv == 4 and new.alignment == 32
    assert [(t.name, t.dims) for t in new.tensors] == [(t.name, t.dims) for t in layout.tensors]
    assert [t.ggml_type for t in new.tensors] == [F32, repack.GGML_Q8_0, repack.GGML_Q8_0]
    by_name = {t.name: t for t in new.tensors}
    assert all(t.offset % 32 == 0 for t in new.tensors)

    def tensor_bytes(name: bytes, size: int) -> bytes:
        start = new.data_start + by_name[name].offset
        return written[start:start + size]

    assert tensor_bytes(b"norm", len(f32)) == f32
    q8 = tensor_bytes(b"q5", 8 * 34)
    for i in range(8):
        assert q8[i * 34:i * 34 + 2] == q5[i * 22:i * 22 + 2]
        assert q8_0_values(q8[i * 34:(i + 1) * 34]) == q5_0_values(q5[i * 22:(i + 1) * 22])
    start = layout.data_start + {t.name: t for t in layout.tensors}[b"q8"].offset
    assert tensor_bytes(b"q8", 3 * 34) == data[start:start + 3 * 34]


def _cut_or_flip(data: bytes, cut: int, flips: list[tuple[int, int]]) -> bytes:
    damaged = bytearray(data[:cut])
    for at, value in flips:
        if damaged:
            damaged[at % len(damaged)] = value
    return bytes(damaged)


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 2000),
       flips=st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 255)), max_size=4))
def test_a_damaged_header_is_a_gguf_error_and_the_file_is_loaded_as_it_is(
        tmp_path: Path, cut: int, flips: list[tuple[int, int]]) -> None:
    data, _, _ = _tiny(np.random.default_rng(1))
    damaged = _cut_or_flip(data, cut, flips)
    try:
        layout = repack.read_layout(damaged)
    except repack.GgufError:
        layout = None
    source = tmp_path / f"m{cut}.gguf"
    source.write_bytes(damaged)
    try:
        result = repack.prepare(str(source), "on", tmp_path / "cache")
    finally:
        source.unlink()
    if layout is None or not any(t.ggml_type == repack.GGML_Q5_0 for t in layout.tensors):
        assert result == repack.Repacked(str(source), False)


def _source(tmp_path: Path, tensors: list[tuple[bytes, tuple[int, ...], int, bytes]]) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(make_gguf(tensors))
    return path


def test_auto_rewrites_fallback_tensors_once_and_reuses_the_copy(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    source = _source(tmp_path, [
        (b"big", (256, 8), F32, rng.standard_normal(2048, dtype=np.float32).tobytes()),
        (b"q5", (64,), repack.GGML_Q5_0, rng.integers(0, 256, 44, np.uint8).tobytes())])
    cache = tmp_path / "cache"
    first = repack.prepare(str(source), "auto", cache)
    assert first.rewritten and Path(first.path).parent == cache
    written = os.stat(first.path).st_mtime_ns
    assert repack.prepare(str(source), "auto", cache) == first
    assert os.stat(first.path).st_mtime_ns == written
    assert repack.prepare(str(source), "off", cache) == repack.Repacked(str(source), False)

    # A changed source gets a new copy, and the old one goes.
    os.utime(source, ns=(written + 10**9, written + 10**9))
    second = repack.prepare(str(source), "auto", cache)
    assert second.rewritten and second.path != first.path
    assert sorted(p.name for p in cache.iterdir()) == [Path(second.path).name]


def test_auto_leaves_a_mostly_q5_0_file_unless_the_cpu_has_amx(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    source = _source(tmp_path, [
        (b"q5", (256, 4), repack.GGML_Q5_0, rng.integers(0, 256, 32 * 22, np.uint8).tobytes()),
        (b"norm", (4,), F32, b"\0" * 16)])
    cache = tmp_path / "cache"
    assert repack.prepare(str(source), "auto", cache) == repack.Repacked(str(source), False)
    assert not cache.exists()  # no mark: on a CPU with AMX the same file is rewritten
    assert repack.prepare(str(source), "auto", cache, amx=True).rewritten
    assert repack.prepare(str(source), "on", cache).rewritten


def test_a_file_without_q5_0_is_marked_and_not_read_again(tmp_path: Path) -> None:
    source = _source(tmp_path, [(b"norm", (4,), F32, b"\0" * 16)])
    cache = tmp_path / "cache"
    assert repack.prepare(str(source), "auto", cache) == repack.Repacked(str(source), False)
    marks = list(cache.iterdir())
    assert [p.suffix for p in marks] == [".none"]
    source.write_bytes(source.read_bytes())  # same size; the mark is keyed by mtime too
    os.utime(source, ns=(1, 1))
    assert repack.prepare(str(source), "auto", cache) == repack.Repacked(str(source), False)


def test_an_unwritable_cache_loads_the_source_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(4)
    source = _source(tmp_path, [
        (b"big", (512,), F32, rng.standard_normal(512, dtype=np.float32).tobytes()),
        (b"q5", (32,), repack.GGML_Q5_0, rng.integers(0, 256, 22, np.uint8).tobytes())])
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    with caplog.at_level(logging.WARNING, logger="sfcore_daemon.llama.repack"):
        result = repack.prepare(str(source), "auto", not_a_folder / "cache")
    assert result == repack.Repacked(str(source), False)
    assert "loading it as it is" in caplog.text


def test_a_split_model_is_loaded_as_it_is(tmp_path: Path) -> None:
    """llama.cpp finds a split model's other parts by its first file's name."""
    rng = np.random.default_rng(6)
    split = _string(b"split.count") + struct.pack("<IH", 2, 3)
    source = tmp_path / "model-00001-of-00003.gguf"
    source.write_bytes(make_gguf(
        [(b"q5", (32,), repack.GGML_Q5_0, rng.integers(0, 256, 22, np.uint8).tobytes())],
        extra_kv=(split,)))
    assert repack.prepare(str(source), "on", tmp_path / "cache") == \
        repack.Repacked(str(source), False)
