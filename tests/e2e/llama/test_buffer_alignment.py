"""The llama.cpp the daemon loads places CPU-buffer tensors on cache lines.

scripts/llama-patches/cpu-buffer-cache-line.patch: the CPU buffer type (compute
buffers, the KV cache, weights read into memory) aligns to 64 bytes, so a kernel's
64-byte vector loads never straddle two lines wherever ggml-alloc put a tensor; a buffer
over memory-mapped file data keeps 32, the alignment of a GGUF file's tensor data.
Asked of the installed wheel's own libggml-base through ggml's public backend API.
"""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def ggml_base() -> ctypes.CDLL:
    spec = importlib.util.find_spec("llama_cpp")
    assert spec is not None and spec.submodule_search_locations
    library = Path(next(iter(spec.submodule_search_locations))) / "lib" / "libggml-base.so"
    lib = ctypes.CDLL(str(library))
    lib.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    lib.ggml_backend_buft_get_alignment.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_buft_get_alignment.restype = ctypes.c_size_t
    lib.ggml_backend_cpu_buffer_from_ptr.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.ggml_backend_cpu_buffer_from_ptr.restype = ctypes.c_void_p
    lib.ggml_backend_buffer_get_alignment.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_buffer_get_alignment.restype = ctypes.c_size_t
    lib.ggml_backend_buffer_free.argtypes = [ctypes.c_void_p]
    return lib


def test_the_cpu_buffer_type_aligns_tensors_to_a_cache_line(ggml_base: ctypes.CDLL) -> None:
    assert ggml_base.ggml_backend_buft_get_alignment(
        ggml_base.ggml_backend_cpu_buffer_type()) == 64


def test_a_buffer_over_mapped_data_keeps_the_gguf_alignment(ggml_base: ctypes.CDLL) -> None:
    # 32-byte aligned memory, as a mapped GGUF's tensor data is.
    raw = ctypes.create_string_buffer(4096 + 64)
    address = (ctypes.addressof(raw) + 63) // 64 * 64 + 32
    buffer = ggml_base.ggml_backend_cpu_buffer_from_ptr(address, 4096)
    assert buffer
    try:
        assert ggml_base.ggml_backend_buffer_get_alignment(buffer) == 32
    finally:
        ggml_base.ggml_backend_buffer_free(buffer)
