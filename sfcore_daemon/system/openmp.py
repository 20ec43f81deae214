"""The OpenMP runtime llama.cpp's CPU backend really runs on, and its spin window.

llama-cpp-python builds ggml with OpenMP, so the barrier ggml puts after every graph
node (hundreds a token) is `#pragma omp barrier`: with GNU libgomp a waiting thread
spins `GOMP_SPINCOUNT` times (300,000 by default: milliseconds) before it sleeps on a
futex. Beside another busy process that window is the problem: when the scheduler
preempts one decode thread, its partner spins out the whole window, and three busy
threads share two cores. libgomp shortens the spin only when the process itself runs
more threads than its CPU mask holds; an outside process never counts. ggml's own
`KMP_BLOCKTIME=200` is read by LLVM's libomp only, never by libgomp.

So the daemon sets a short window before llama.cpp loads (`SPIN_DEFAULT`, the user's
own environment wins), and says at start-up which runtime is mapped into the process
and which window is in force: a build against libomp, or one without OpenMP (ggml's
own barrier, which spins and never sleeps), is not helped by `GOMP_SPINCOUNT`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from pathlib import Path

# libgomp's spin count at a barrier before it sleeps: short beside a busy neighbour, long
# enough that a request after a pause does not sleep at its barriers (sharing-the-machine.md).
SPIN_DEFAULT = "30000"
# libgomp's own values when GOMP_SPINCOUNT is unset (OMP_WAIT_POLICY decides).
_LIBGOMP_SPIN = {"": 300_000, "active": 30_000_000_000, "passive": 0}

# Shared-object names of the OpenMP runtimes, as they appear in /proc/self/maps.
_RUNTIMES = (("libgomp", "GNU libgomp"), ("libiomp", "Intel libiomp"),
             ("libomp", "LLVM libomp"))


def set_spin_default(environ: MutableMapping[str, str]) -> None:
    """GOMP_SPINCOUNT = SPIN_DEFAULT unless the user set it (or OMP_WAIT_POLICY, whose
    own spin count libgomp then uses). Before libgomp loads: it reads it once."""
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ["GOMP_SPINCOUNT"] = SPIN_DEFAULT


def runtime_in(mapped_paths: Iterable[str]) -> str | None:
    """The OpenMP runtime among the mapped files' paths, or None."""
    for path in mapped_paths:
        name = path.rsplit("/", 1)[-1]
        for prefix, label in _RUNTIMES:
            if name.startswith(prefix + ".so") or name.startswith(prefix + "5.so"):
                return label
    return None


def mapped_paths(maps: Path = Path("/proc/self/maps")) -> list[str]:
    """The files mapped into this process (empty where /proc is not there)."""
    try:
        text = maps.read_text()
    except OSError:
        return []
    fields = (line.split(None, 5) for line in text.splitlines())
    return [parts[5] for parts in fields if len(parts) == 6]


def spin_window(environ: Mapping[str, str]) -> str:
    """libgomp's spin window in force, as the start-up line says it."""
    spin = environ.get("GOMP_SPINCOUNT")
    if spin is not None:
        return f"GOMP_SPINCOUNT={spin}"
    policy = environ.get("OMP_WAIT_POLICY", "").strip().lower()
    count = _LIBGOMP_SPIN.get(policy, _LIBGOMP_SPIN[""])
    return f"GOMP_SPINCOUNT unset ({count:,} spins, OMP_WAIT_POLICY={policy or 'unset'})"


def describe(environ: Mapping[str, str], paths: Iterable[str]) -> str:
    """One start-up line: the runtime and, for libgomp, its spin window."""
    runtime = runtime_in(paths)
    if runtime is None:
        return ("OpenMP: none mapped (ggml's own thread pool: its barrier spins and never "
                "sleeps; GOMP_SPINCOUNT has no effect)")
    if runtime == "GNU libgomp":
        return f"OpenMP: {runtime}, {spin_window(environ)}"
    return (f"OpenMP: {runtime} (GOMP_SPINCOUNT has no effect; KMP_BLOCKTIME="
            f"{environ.get('KMP_BLOCKTIME', 'unset')})")
