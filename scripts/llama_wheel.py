#!/usr/bin/env python3
"""Build (once) the llama-cpp-python wheel for this machine and print its path.

Standard library only: it runs before anything is installed. Called by
scripts/bootstrap.sh and scripts/install-service.sh:

    python3 scripts/llama_wheel.py --python .venv/bin/python [--gpu cpu|cuda] [--portable]
    python3 scripts/llama_wheel.py --python python3 --apply-to EXTRACTED_SDIST

Why not pip's wheel cache: pip keys a wheel built from an sdist by the sdist's link
alone. A `-march=native` build depends on much more: the build arguments, the patches
in scripts/llama-patches/, the compiler, and the CPU it was built on. Handed to another
CPU (a shared home directory, a copied cache, a container image) such a wheel can die
of an illegal instruction at the first batched decode. So the wheel goes into a folder
of its own, `~/.cache/sfcore-ai/wheels/<variant>-<key>/`, whose key hashes every one
of those inputs (`build.json` beside the wheel lists them), and is built with
`--no-cache-dir` so that pip's cache never holds it.

Patches: each `scripts/llama-patches/*.patch` is a unified diff against the sdist's
root, with a header that names its upstream reference and a `Bug-marker:` line, text
of the file that only the unfixed code has. A patch whose hunks are already there is
skipped, and so is one whose marker is gone from the file (the pinned release fixed it
its own way): moving the pin drops it without an edit. A patch that neither applies nor
is obsolete stops the build with one line naming it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "scripts" / "llama-patches"
# Bumped when this script builds differently for the same inputs.
RECIPE = 1
# A portable build: llama.cpp's generic x86-64 set (AVX2, FMA, F16C) instead of
# -march=native; no AVX-512, no AMX. Any CPU of the last ten years runs it.
PORTABLE_ARGS = "-DGGML_NATIVE=OFF"


class BuildError(Exception):
    """One line for the user: what failed and what to do."""


# --- the key -------------------------------------------------------------------------------


def pinned_requirement(pyproject: Path) -> str:
    """`llama-cpp-python==X.Y.Z` from pyproject.toml, its one source."""
    match = re.search(r'"(llama-cpp-python==[^"]+)"', pyproject.read_text())
    if match is None:
        raise BuildError(f"no llama-cpp-python==VERSION pin in {pyproject}")
    return match.group(1)


def cpu_flags(cpuinfo: str) -> list[str]:
    """The instruction-set flags of the first CPU in /proc/cpuinfo text (x86 `flags`,
    Arm `Features`), sorted: what a -march=native build may use."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return sorted(set(value.split()))
    return []


def compiler_version(command: str) -> str:
    try:
        result = subprocess.run([command, "--version"], capture_output=True, text=True,
                                timeout=30, check=False)
    except OSError:
        return f"{command}: not found"
    return result.stdout.splitlines()[0] if result.stdout else f"{command}: no version"


@dataclass(frozen=True)
class BuildInputs:
    requirement: str
    variant: str  # "cpu", "portable" or "cuda"
    cmake_args: str
    cudaarchs: str
    python: str
    compilers: tuple[str, ...]
    machine: str
    cpu_flags: tuple[str, ...]
    patches: tuple[tuple[str, str], ...]  # (file name, sha256)

    def key(self) -> str:
        document = json.dumps(self.as_json(), sort_keys=True).encode()
        return hashlib.sha256(document).hexdigest()[:16]

    def as_json(self) -> dict[str, object]:
        return {"recipe": RECIPE, "requirement": self.requirement, "variant": self.variant,
                "cmake_args": self.cmake_args, "cudaarchs": self.cudaarchs,
                "python": self.python, "compilers": list(self.compilers),
                "machine": self.machine, "cpu_flags": list(self.cpu_flags),
                "patches": [list(patch) for patch in self.patches]}


def cmake_args_for(variant: str, user_args: str) -> str:
    """CMAKE_ARGS for `variant`, the user's own last so that a -D of theirs wins."""
    base = {"cpu": "", "portable": PORTABLE_ARGS, "cuda": "-DGGML_CUDA=on"}[variant]
    return " ".join(part for part in (base, user_args) if part)


def is_native(cmake_args: str) -> bool:
    """Whether the build targets the CPU it runs on (llama.cpp's default)."""
    native = True
    for match in re.finditer(r"-DGGML_NATIVE(?::BOOL)?=(\S+)", cmake_args):
        native = match.group(1).upper() not in ("OFF", "0", "FALSE", "NO")
    return native


def gather_inputs(python: str, variant: str, environ: dict[str, str]) -> BuildInputs:
    requirement = pinned_requirement(REPO / "pyproject.toml")
    cmake_args = cmake_args_for(variant, environ.get("CMAKE_ARGS", "").strip())
    version = subprocess.run(
        [python, "-c", "import sys; print(sys.implementation.cache_tag, sys.platform)"],
        capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    flags: list[str] = []
    if is_native(cmake_args):
        try:
            flags = cpu_flags(Path("/proc/cpuinfo").read_text())
        except OSError:
            flags = ["cpuinfo unreadable"]
    patches = tuple((path.name, hashlib.sha256(path.read_bytes()).hexdigest())
                    for path in sorted(PATCHES.glob("*.patch")))
    return BuildInputs(
        requirement=requirement, variant=variant, cmake_args=cmake_args,
        cudaarchs=environ.get("CUDAARCHS", "") if variant == "cuda" else "",
        python=version,
        compilers=(compiler_version(environ.get("CC", "cc")),
                   compiler_version(environ.get("CXX", "c++"))),
        machine=platform.machine(), cpu_flags=tuple(flags), patches=patches)


# --- the patches ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Hunk:
    old: str
    new: str


@dataclass(frozen=True)
class Patch:
    name: str
    target: str  # path inside the sdist
    bug_marker: str
    hunks: tuple[Hunk, ...]


def parse_patch(name: str, text: str) -> Patch:
    """A one-file unified diff with a `Bug-marker:` header line (see the module doc)."""
    marker = re.search(r"^Bug-marker: (.+)$", text, re.MULTILINE)
    target = re.search(r"^\+\+\+ b/(\S+)", text, re.MULTILINE)
    if marker is None or target is None:
        raise BuildError(f"{name}: needs a 'Bug-marker:' line and a '+++ b/PATH' line")
    hunks: list[Hunk] = []
    old: list[str] | None = None
    new: list[str] = []
    for line in text[target.end():].splitlines()[1:]:
        if line.startswith("@@"):
            if old is not None:
                hunks.append(Hunk("".join(old), "".join(new)))
            old, new = [], []
        elif old is not None and line[:1] in (" ", "-", "+"):
            body = line[1:] + "\n"
            if line[0] != "+":
                old.append(body)
            if line[0] != "-":
                new.append(body)
        elif old is not None and line == "":
            old.append("\n")
            new.append("\n")
    if old is not None:
        hunks.append(Hunk("".join(old), "".join(new)))
    if not hunks:
        raise BuildError(f"{name}: no hunks")
    return Patch(name, target.group(1), marker.group(1), tuple(hunks))


def apply_patch(patch: Patch, root: Path) -> str:
    """Apply `patch` under `root`; say what was done ("applied", "already applied",
    "obsolete"). BuildError when it neither applies nor is obsolete."""
    path = root / patch.target
    if not path.is_file():
        raise BuildError(f"{patch.name}: {patch.target} is not in the sdist; "
                         "update or remove the patch")
    text = path.read_text()
    if all(hunk.new in text for hunk in patch.hunks):
        return "already applied"
    if patch.bug_marker not in text:
        return "obsolete (the code it fixes is gone from this release)"
    for hunk in patch.hunks:
        if text.count(hunk.old) != 1:
            raise BuildError(f"{patch.name} no longer applies to {patch.target}, and the "
                             "code it fixes is still there: update scripts/llama-patches/")
        text = text.replace(hunk.old, hunk.new)
    path.write_text(text)
    return "applied"


# --- the build -----------------------------------------------------------------------------


def cache_root(environ: dict[str, str]) -> Path:
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sfcore-ai" / "wheels"


def say(message: str) -> None:
    print(f"llama_wheel: {message}", file=sys.stderr, flush=True)


def build(inputs: BuildInputs, python: str, destination: Path, environ: dict[str, str]) -> Path:
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sfcore-llama-build-") as work_dir:
        work = Path(work_dir)
        say(f"downloading the {inputs.requirement} sdist")
        subprocess.run([python, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--no-binary", "llama-cpp-python", "-d", str(work),
                        inputs.requirement], check=True, timeout=1800)
        sdists = list(work.glob("llama_cpp_python-*.tar.gz"))
        if len(sdists) != 1:
            raise BuildError(f"pip download gave {len(sdists)} sdists for {inputs.requirement}")
        with tarfile.open(sdists[0]) as archive:
            extract_filter = getattr(tarfile, "data_filter", None)
            if extract_filter is not None:
                archive.extractall(work / "src", filter=extract_filter)
            else:  # Python 3.11 before 3.11.4
                archive.extractall(work / "src")
        (source,) = (work / "src").iterdir()
        for path in sorted(PATCHES.glob("*.patch")):
            outcome = apply_patch(parse_patch(path.name, path.read_text()), source)
            say(f"{path.name}: {outcome}")
        say(f"building with CMAKE_ARGS=\"{inputs.cmake_args}\" (several minutes on 2 cores)")
        env = dict(environ)
        env["CMAKE_ARGS"] = inputs.cmake_args
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        env.pop("PIP_NO_CACHE_DIR", None)
        out = work / "wheel"
        subprocess.run([python, "-m", "pip", "wheel", "--quiet", "--no-deps",
                        "--no-cache-dir", "-w", str(out), str(source)],
                       check=True, env=env, timeout=7200)
        (wheel,) = out.glob("llama_cpp_python-*.whl")
        # Whole or absent: a build cut short never leaves a folder that looks finished.
        staged = Path(tempfile.mkdtemp(prefix=destination.name + ".partial.",
                                       dir=destination.parent))
        shutil.copy2(wheel, staged / wheel.name)
        (staged / "build.json").write_text(json.dumps(inputs.as_json(), indent=2) + "\n")
        try:
            staged.rename(destination)
        except OSError:  # built meanwhile by another run: keep that one
            shutil.rmtree(staged)
    return find_wheel(destination)


def find_wheel(folder: Path) -> Path:
    wheels = sorted(folder.glob("llama_cpp_python-*.whl"))
    if len(wheels) != 1:
        raise BuildError(f"{folder} holds {len(wheels)} wheels; remove the folder")
    return wheels[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", required=True, help="the venv's python (builds with it)")
    parser.add_argument("--gpu", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--portable", action="store_true",
                        help="no -march=native: a wheel any x86-64-v3 CPU runs")
    parser.add_argument("--key", action="store_true",
                        help="print the wheel's folder without building")
    parser.add_argument("--apply-to", metavar="SDIST_DIR",
                        help="only apply the patches to an extracted sdist (for the peers "
                             "that docs/performance.md builds from the same source)")
    args = parser.parse_args(argv)
    if args.apply_to:
        try:
            for path in sorted(PATCHES.glob("*.patch")):
                outcome = apply_patch(parse_patch(path.name, path.read_text()),
                                      Path(args.apply_to))
                say(f"{path.name}: {outcome}")
        except BuildError as exc:
            say(str(exc))
            return 1
        return 0
    environ = dict(os.environ)
    variant = "cuda" if args.gpu == "cuda" else "portable" if args.portable else "cpu"
    try:
        inputs = gather_inputs(args.python, variant, environ)
        folder = cache_root(environ) / f"{variant}-{inputs.key()}"
        if args.key:
            print(folder)
            return 0
        wheel = find_wheel(folder) if folder.is_dir() else build(inputs, args.python,
                                                                  folder, environ)
    except BuildError as exc:
        say(str(exc))
        return 1
    except subprocess.CalledProcessError as exc:
        say(f"{exc.cmd[:4]} failed with exit {exc.returncode} (see above)")
        return 1
    print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
