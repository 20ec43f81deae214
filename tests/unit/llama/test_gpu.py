"""`[model] n_gpu_layers`: "auto" by default, resolved against the build; the start-up
log says where the layers went (unit tests of the pure parts, and the real daemon on
this machine's build, which in CI has no GPU backend).

This file holds the tests that need no daemon and no model; those against the real
daemon in tests/e2e/ndjson/test_gpu.py.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import tomli_w
from hypothesis import given, settings
from hypothesis import strategies as st

from sfcore_daemon.cli import set_library_defaults
from sfcore_daemon.config import Config, ConfigError, load_config
from sfcore_daemon.llama.gpu import Placement, resolve_gpu_layers

H200 = ("CUDA0 (NVIDIA H200)",)


def _load(tmp_path: Path, value: str) -> Config:
    path = tmp_path / "c.toml"
    path.write_text(f"[model]\nn_gpu_layers = {value}\n")
    return load_config(path)


def test_the_default_is_auto_and_resolves_by_the_build() -> None:
    assert Config().model.n_gpu_layers == "auto"
    assert resolve_gpu_layers("auto", gpu_offload=True) == -1
    assert resolve_gpu_layers("auto", gpu_offload=False) == 0


@pytest.mark.parametrize("value", [-1, 0, 1, 7, 99])
@pytest.mark.parametrize("gpu_offload", [True, False])
def test_an_explicit_number_is_kept_whatever_the_build(value: int, gpu_offload: bool) -> None:
    assert resolve_gpu_layers(value, gpu_offload) == value


def test_the_config_file_takes_auto_or_a_layer_count(tmp_path: Path) -> None:
    assert _load(tmp_path, '"auto"').model.n_gpu_layers == "auto"
    assert _load(tmp_path, "-1").model.n_gpu_layers == -1
    assert _load(tmp_path, "12").model.n_gpu_layers == 12


@pytest.mark.parametrize("value", ['"all"', "-2", "1.5", "true", '""'])
def test_anything_else_is_a_config_error_naming_the_key(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match=r"`model\.n_gpu_layers`"):
        _load(tmp_path, value)


@settings(max_examples=60, deadline=None)
@given(value=st.one_of(st.integers(min_value=-(2**40), max_value=2**40), st.text(max_size=8),
                       st.floats(allow_nan=False), st.booleans()))
def test_any_value_is_a_layer_count_or_auto_or_refused(value: object) -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "c.toml"
        path.write_text(tomli_w.dumps({"model": {"n_gpu_layers": value}}))
        try:
            decoded = load_config(path).model.n_gpu_layers
        except ConfigError as exc:
            assert "`model.n_gpu_layers`" in str(exc)
            accepted = value == "auto" or (type(value) is int and -1 <= value <= 2**31 - 1)
            assert not accepted
            return
    assert decoded == value
    assert type(decoded) is type(value)
    assert resolve_gpu_layers(decoded, gpu_offload=True) == (-1 if value == "auto" else value)


def test_the_placement_line_names_the_device_or_why_the_cpu() -> None:
    assert Placement(-1, 19, ("CUDA", "CPU"), H200).line() == \
        "model: 19/19 layers on CUDA0 (NVIDIA H200)"
    assert Placement(40, 19, ("CUDA", "CPU"), H200).offloaded == 19
    assert Placement(10, 19, ("CUDA", "CPU"), H200).line() == \
        "model: 10/19 layers on CUDA0 (NVIDIA H200), the other 9 on the CPU"
    assert Placement(0, 19, ("CUDA", "CPU"), H200).line() == \
        "model: 19/19 layers on the CPU (n_gpu_layers = 0; unused: CUDA0 (NVIDIA H200))"
    assert Placement(-1, 19, ("CUDA", "CPU"), ()).line() == \
        "model: 19/19 layers on the CPU (the build has CUDA but found no GPU device)"
    assert Placement(-1, 19, ("CPU",), ()).line() == \
        "model: 19/19 layers on the CPU (this llama.cpp build has no GPU backend)"


def test_library_defaults_choose_f32_cublas_and_keep_the_users_own() -> None:
    # f16 cuBLAS kernels abort a CUDA build under concurrent speculation (docs/gpu.md,
    # "The crash"); a variable the user set stays as set.
    environ: dict[str, str] = {}
    set_library_defaults(environ)
    assert environ["GGML_CUDA_CUBLAS_COMPUTE_TYPE"] == "f32"
    assert environ["OPENBLAS_NUM_THREADS"] == "1"
    environ = {"GGML_CUDA_CUBLAS_COMPUTE_TYPE": "f16", "OPENBLAS_NUM_THREADS": "4",
               "GOMP_SPINCOUNT": "300000"}
    set_library_defaults(environ)
    assert environ == {"GGML_CUDA_CUBLAS_COMPUTE_TYPE": "f16", "OPENBLAS_NUM_THREADS": "4",
                       "GOMP_SPINCOUNT": "300000"}
