"""Where the model's layers go: the default of `[model] n_gpu_layers` and the load's
one log line about it.

`n_gpu_layers = "auto"` (the default) offloads every layer when the llama.cpp build has
a GPU backend that finds a device (`llama_supports_gpu_offload`), and none otherwise,
so one config serves a CPU build and a CUDA build alike; a number is used as given.
The bindings expose no ggml device functions, so the backends and devices are read
through the library handle (libllama's dependencies export them), with llama.cpp's
system-info string as the fallback where a build lacks them.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any, Literal

from sfcore_daemon.llama.capi import C

# enum ggml_backend_dev_type: CPU=0, GPU=1, IGPU=2 (integrated), ACCEL=3, META=4.
_GPU_TYPES = (1, 2)


def resolve_gpu_layers(setting: int | Literal["auto"], gpu_offload: bool) -> int:
    """`n_gpu_layers` as llama.cpp takes it: "auto" is -1 (every layer) where the build
    can offload, else 0; an explicit number stays."""
    if setting == "auto":
        return -1 if gpu_offload else 0
    return setting


@functools.cache
def gpu_offload_supported() -> bool:
    """True when this llama.cpp build has a GPU backend and it found a device."""
    return bool(C.llama_supports_gpu_offload())


def gpu_layers(setting: int | Literal["auto"]) -> int:
    return resolve_gpu_layers(setting, gpu_offload_supported())


@dataclass(frozen=True, slots=True)
class Placement:
    """What the load did with the layers, as far as the library says."""

    gpu_layers: int  # as passed to llama.cpp: -1 all, 0 none
    n_layers: int  # llama.cpp's count: the blocks plus the output layer
    backends: tuple[str, ...]  # e.g. ("CUDA", "CPU"); empty when unknown
    gpus: tuple[str, ...]  # e.g. ("CUDA0 (NVIDIA H200)",)

    @property
    def offloaded(self) -> int:
        if not self.gpus:
            return 0
        if self.gpu_layers < 0:
            return self.n_layers
        return min(self.gpu_layers, self.n_layers)

    def line(self) -> str:
        """One log line, e.g. "model: 19/19 layers on CUDA0 (NVIDIA H200)"."""
        offloaded, total = self.offloaded, self.n_layers
        if offloaded:
            where = " and ".join(self.gpus)
            rest = "" if offloaded == total else f", the other {total - offloaded} on the CPU"
            return f"model: {offloaded}/{total} layers on {where}{rest}"
        gpu_backends = [b for b in self.backends if b not in ("CPU", "BLAS", "RPC")]
        if self.gpus:
            why = f"n_gpu_layers = 0; unused: {', '.join(self.gpus)}"
        elif gpu_backends:
            why = f"the build has {', '.join(gpu_backends)} but found no GPU device"
        elif self.backends:
            why = "this llama.cpp build has no GPU backend"
        else:
            why = "no GPU device found"
        return f"model: {total}/{total} layers on the CPU ({why})"


def placement(model: Any, n_gpu_layers: int) -> Placement:
    """Where `model`'s layers went when loaded with `n_gpu_layers` (resolved)."""
    n_layers = C.llama_model_n_layer(model) + C.llama_model_n_layer_nextn(model) + 1
    try:
        backends, gpus = _registry()
    except AttributeError:  # a build that does not export the ggml registry
        backends = ()
        gpus = ("a GPU",) if gpu_offload_supported() else ()
    return Placement(gpu_layers=n_gpu_layers, n_layers=n_layers, backends=backends,
                     gpus=gpus)


def _function(name: str, restype: Any, *argtypes: Any) -> Any:
    function = getattr(C._lib, name)
    function.restype = restype
    function.argtypes = list(argtypes)
    return function


def _text(value: bytes | None) -> str:
    return value.decode(errors="replace") if value else "?"


def _registry() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The registered backends' names and the GPU devices as "NAME (description)"."""
    size, ptr, text = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_char_p
    reg_count = _function("ggml_backend_reg_count", size)
    reg_get = _function("ggml_backend_reg_get", ptr, size)
    reg_name = _function("ggml_backend_reg_name", text, ptr)
    dev_count = _function("ggml_backend_dev_count", size)
    dev_get = _function("ggml_backend_dev_get", ptr, size)
    dev_name = _function("ggml_backend_dev_name", text, ptr)
    dev_description = _function("ggml_backend_dev_description", text, ptr)
    dev_type = _function("ggml_backend_dev_type", ctypes.c_int, ptr)
    backends = tuple(_text(reg_name(reg_get(i))) for i in range(reg_count()))
    gpus = []
    for i in range(dev_count()):
        dev = dev_get(i)
        if dev_type(dev) in _GPU_TYPES:
            gpus.append(f"{_text(dev_name(dev))} ({_text(dev_description(dev))})")
    return backends, tuple(gpus)
