"""scripts/llama_wheel.py (issue 48): the build's key holds everything the wheel depends
on, the patches apply, skip or refuse as documented, and the AMX patch compiles to a
tile config that the compiler cannot drop (checked in the object code, on any x86 CPU:
AMX hardware is not needed to read what ldtilecfg will load)."""

from __future__ import annotations

import dataclasses
import importlib.util
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.kit import REPO

PATCHES = REPO / "scripts" / "llama-patches"
PATCH = PATCHES / "amx-tile-config.patch"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("llama_wheel",
                                                  REPO / "scripts" / "llama_wheel.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["llama_wheel"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


lw = _load()

X86_CPUINFO = ("processor\t: 0\nvendor_id\t: GenuineIntel\n"
               "flags\t\t: fpu avx2 avx512f amx_tile amx_int8 avx2\n\n"
               "processor\t: 1\nflags\t\t: fpu\n")


def test_cpu_flags_are_the_first_cpus_sorted_and_unique() -> None:
    assert lw.cpu_flags(X86_CPUINFO) == ["amx_int8", "amx_tile", "avx2", "avx512f", "fpu"]
    assert lw.cpu_flags("processor : 0\nFeatures : fp asimd sve\n") == ["asimd", "fp", "sve"]
    assert lw.cpu_flags("") == []


def test_native_unless_the_arguments_turn_it_off() -> None:
    assert lw.is_native("")
    assert lw.is_native("-DGGML_CUDA=on")
    assert not lw.is_native(lw.cmake_args_for("portable", ""))
    # The user's own -D comes last and wins.
    assert lw.is_native(lw.cmake_args_for("portable", "-DGGML_NATIVE=ON"))
    assert lw.cmake_args_for("cuda", "-DX=1") == "-DGGML_CUDA=on -DX=1"


def _inputs() -> object:
    return lw.BuildInputs(
        requirement="llama-cpp-python==0.3.36", variant="cpu", cmake_args="",
        cudaarchs="", python="cpython-311 linux", compilers=("gcc 12", "g++ 12"),
        machine="x86_64", cpu_flags=("avx2", "avx512f"), patches=(("a.patch", "00"),))


@pytest.mark.parametrize("change", [
    {"cpu_flags": ("avx2", "avx512f", "amx_tile")},
    {"patches": (("a.patch", "01"),)},
    {"patches": ()},
    {"cmake_args": "-DGGML_NATIVE=OFF"},
    {"compilers": ("gcc 13", "g++ 13")},
    {"requirement": "llama-cpp-python==0.3.37"},
    {"python": "cpython-312 linux"},
    {"variant": "cuda"},
    {"cudaarchs": "90"},
])
def test_the_key_changes_with_every_input(change: dict[str, object]) -> None:
    base = _inputs()
    assert dataclasses.replace(base, **change).key() != base.key()  # type: ignore[type-var]
    assert dataclasses.replace(base).key() == base.key()  # type: ignore[type-var]


def test_a_portable_key_does_not_depend_on_the_cpu(tmp_path: Path) -> None:
    python = sys.executable
    portable = lw.gather_inputs(python, "portable", {})
    native = lw.gather_inputs(python, "cpu", {})
    assert portable.cpu_flags == ()
    if Path("/proc/cpuinfo").exists():
        assert native.cpu_flags and native.key() != portable.key()
    assert [name for name, _ in native.patches] == sorted(
        path.name for path in PATCHES.glob("*.patch"))
    assert [name for name, _ in native.patches] == [
        "amx-tile-config.patch", "cpu-abort-in-node.patch", "cpu-buffer-cache-line.patch",
        "cpu-row-invariant.patch",
        "fa-split-kv-balance.patch", "fa-tiled-hidden-tiles.patch", "fa-units-ops.patch",
        "fa-units-plan.patch", "fa-units-tls.patch", "fa-whole-tiles.patch",
        "kv-position-order.patch", "matmul-attention.patch", "repack-row-invariant.patch",
        "swa-window-cells-cpp.patch", "swa-window-cells-graph.patch", "swa-window-cells-h.patch"]


def _patch() -> object:
    return lw.parse_patch(PATCH.name, PATCH.read_text())


def _tree(tmp_path: Path, text: str) -> Path:
    patch = _patch()
    target = tmp_path / patch.target  # type: ignore[attr-defined]
    target.parent.mkdir(parents=True)
    target.write_text(text)
    return target


def test_the_patch_applies_once_then_is_already_there(tmp_path: Path) -> None:
    patch = _patch()
    (hunk,) = patch.hunks  # type: ignore[attr-defined]
    assert patch.bug_marker in hunk.old and patch.bug_marker not in hunk.new  # type: ignore[attr-defined]
    target = _tree(tmp_path, "// before\n" + hunk.old + "// after\n")
    assert lw.apply_patch(patch, tmp_path) == "applied"
    assert target.read_text() == "// before\n" + hunk.new + "// after\n"
    assert lw.apply_patch(patch, tmp_path) == "already applied"
    assert target.read_text() == "// before\n" + hunk.new + "// after\n"


def test_a_release_without_the_bug_drops_the_patch(tmp_path: Path) -> None:
    patch = _patch()
    upstream = "inline void ggml_tile_config_init(void) { /* fixed their own way */ }\n"
    target = _tree(tmp_path, upstream)
    assert lw.apply_patch(patch, tmp_path).startswith("obsolete")
    assert target.read_text() == upstream


def test_a_patch_that_no_longer_fits_the_unfixed_code_stops_the_build(tmp_path: Path) -> None:
    patch = _patch()
    (hunk,) = patch.hunks  # type: ignore[attr-defined]
    moved = hunk.old.replace("static thread_local bool done", "thread_local bool is_done")
    _tree(tmp_path, moved)
    with pytest.raises(lw.BuildError, match="no longer applies"):
        lw.apply_patch(patch, tmp_path)
    with pytest.raises(lw.BuildError, match="not in the sdist"):
        lw.apply_patch(patch, tmp_path / "elsewhere")


@pytest.mark.parametrize("path", sorted(PATCHES.glob("*.patch")), ids=lambda path: path.name)
def test_each_patch_fixes_what_its_marker_names_and_applies_once(path: Path,
                                                                 tmp_path: Path) -> None:
    patch = lw.parse_patch(path.name, path.read_text())
    hunks = patch.hunks
    assert any(patch.bug_marker in hunk.old for hunk in hunks)
    assert not any(patch.bug_marker in hunk.new for hunk in hunks)
    target = tmp_path / patch.target
    target.parent.mkdir(parents=True)
    target.write_text("".join(f"// part {index}\n{hunk.old}" for index, hunk in enumerate(hunks)))
    assert lw.apply_patch(patch, tmp_path) == "applied"
    fixed = "".join(f"// part {index}\n{hunk.new}" for index, hunk in enumerate(hunks))
    assert target.read_text() == fixed
    assert lw.apply_patch(patch, tmp_path) == "already applied"
    assert target.read_text() == fixed


def test_a_patch_without_a_bug_marker_is_refused() -> None:
    text = re.sub(r"^Bug-marker:.*\n", "", PATCH.read_text(), flags=re.MULTILINE)
    with pytest.raises(lw.BuildError, match="Bug-marker"):
        lw.parse_patch("x.patch", text)


# The layout of AMX's 64-byte tile configuration (Intel SDM, LDTILECFG), as mmq.cpp has it.
TILE_CONFIG_T = """
#include <immintrin.h>
#include <cstdint>
struct tile_config_t{
    uint8_t palette_id = 0;
    uint8_t start_row = 0;
    uint8_t reserved_0[14] = {0};
    uint16_t colsb[16] = {0};
    uint8_t rows[16] = {0};
};
"""


def _compiler_with_amx() -> str:
    compiler = shutil.which("g++") or shutil.which("c++")
    if platform.machine() not in ("x86_64", "AMD64") or compiler is None:
        pytest.skip("needs an x86-64 C++ compiler")
    probe = subprocess.run([compiler, "-mamx-tile", "-x", "c++", "-fsyntax-only", "-"],
                           input="", capture_output=True, text=True, timeout=60, check=False)
    if probe.returncode != 0:
        pytest.skip(f"{compiler} has no -mamx-tile")
    return compiler


def test_the_patched_tile_config_is_a_constant_the_compiler_keeps(tmp_path: Path) -> None:
    compiler = _compiler_with_amx()
    (hunk,) = _patch().hunks  # type: ignore[attr-defined]
    start = hunk.new.index("inline void ggml_tile_config_init(void) {")
    end = hunk.new.index("\n}\n", start) + 3
    source = tmp_path / "tile.cpp"
    # In an anonymous namespace, as in mmq.cpp.
    source.write_text(TILE_CONFIG_T + "namespace {\n" + hunk.new[start:end] + "}\n"
                      + 'extern "C" void configure() { ggml_tile_config_init(); }\n')
    objfile = tmp_path / "tile.o"
    subprocess.run([compiler, "-std=c++17", "-O3", "-march=sapphirerapids", "-c",
                    str(source), "-o", str(objfile)], check=True, timeout=120)
    disassembly = subprocess.run(["objdump", "-dr", "--no-show-raw-insn", str(objfile)],
                                 capture_output=True, text=True, check=True,
                                 timeout=60).stdout
    # ldtilecfg reads the config from .rodata, not from a stack slot filled just before.
    load = re.search(r"ldtilecfg\s+(\S+)[^\n]*\n\s*\S+\s+R_X86_64_PC32\s+(\S+)", disassembly)
    assert load is not None, disassembly
    assert load.group(1).endswith("(%rip)") and load.group(2).startswith((".rodata", "_ZZ"))
    symbols = subprocess.run(["objdump", "-t", str(objfile)], capture_output=True, text=True,
                             check=True, timeout=60).stdout
    config = re.search(r"^([0-9a-f]+) [lu]\s+O (\.rodata\S*)\s+0+40 \S+E2tc$", symbols,
                       re.MULTILINE)
    assert config is not None, symbols
    rodata = tmp_path / "rodata.bin"
    subprocess.run(["objcopy", "-O", "binary", f"--only-section={config.group(2)}",
                    str(objfile), str(rodata)], check=True, timeout=60)
    offset = int(config.group(1), 16)
    data = rodata.read_bytes()[offset:offset + 64]
    colsb = [int.from_bytes(data[16 + 2 * tile:18 + 2 * tile], "little") for tile in range(8)]
    assert data[0] == 1  # palette 1
    assert colsb == [64, 64, 32, 32, 64, 64, 64, 64]
    assert list(data[48:56]) == [8, 8, 16, 16, 16, 16, 16, 16]
