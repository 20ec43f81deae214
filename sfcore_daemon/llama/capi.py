"""llama-cpp-python's ctypes bindings, without the rest of the package.

`import llama_cpp` runs the package's `__init__`, which imports the high-level
`Llama` class and with it numpy, jinja2 and the chat formats: start-up time and
resident memory the daemon never uses (docs/performance/design.md). The bindings
module itself only needs the package to exist, so this registers the package
without executing its `__init__`; the first attribute read from `llama_cpp`
(someone else's `from llama_cpp import Llama` in the same process) runs it then.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any


def _register_lazy_package() -> None:
    if "llama_cpp" in sys.modules:
        return
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.loader is None:
        raise ImportError("llama-cpp-python is not installed")
    package = importlib.util.module_from_spec(spec)
    loader = spec.loader

    def finish_import(name: str) -> Any:
        del package.__getattr__  # run __init__ once
        loader.exec_module(package)
        return getattr(package, name)

    package.__getattr__ = finish_import  # type: ignore[method-assign]
    sys.modules["llama_cpp"] = package


_register_lazy_package()

import llama_cpp.llama_cpp as C  # noqa: E402  (needs the package registered first)

__all__ = ["C"]
