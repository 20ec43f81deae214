"""The package's layout holds: subpackages in layers, no import circle, nothing too big.

Read from the source with `ast` (nothing is imported), so a change that breaks the
layout fails here at once, before anyone reads it in a review.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "sfcore_daemon"
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300
# Each package may import from its own modules and from packages of a lower layer only,
# so packages of one layer know nothing of each other: store and structured; the core
# and tune (a command of its own beside serving); the NDJSON front end and the HTTP
# listener; the HTTP APIs, each a front end of its own on the listener.
LAYERS: dict[str, int] = {
    "config": 0,
    "system": 1,
    "llama": 2,
    "store": 3, "structured": 3,
    "engine": 4,
    "core": 5, "tune": 5,
    "ndjson": 6, "httpd": 6,
    "openai": 7, "responses": 7, "anthropic": 7, "ollama": 7,
    "cli": 8, "__main__": 8, "__init__": 8,
}
FRONT_ENDS = ("ndjson", "httpd", "openai", "responses", "anthropic", "ollama")
# Other libraries' public names that start with an underscore: NamedTuple's methods,
# the ctypes library handle of llama-cpp-python's bindings.
FOREIGN_PRIVATE = {"_replace", "_asdict", "_fields", "_lib"}


def _modules() -> dict[str, Path]:
    """Dotted module name (below sfcore_daemon) -> file."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module of the package `name` imports, anywhere in it (functions and
    TYPE_CHECKING blocks included)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name.rsplit(".", 1)[0] if "." in name else ""
    if path.name == "__init__.py":
        package = name.removesuffix(".__init__")
    found: set[str] = set()

    def add(dotted: str) -> None:
        dotted = dotted.removeprefix("sfcore_daemon").removeprefix(".")
        if dotted in known:
            found.add(dotted)
        elif f"{dotted}.__init__" in known:
            found.add(f"{dotted}.__init__")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("sfcore_daemon"):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                module = ".".join([*base, *(node.module.split(".") if node.module else [])])
                module = "sfcore_daemon." + module if module else "sfcore_daemon"
            elif node.module and node.module.startswith("sfcore_daemon"):
                module = node.module
            else:
                continue
            add(module)
            for alias in node.names:  # `from sfcore_daemon.llama import model`
                add(f"{module}.{alias.name}")
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _layer(module: str) -> tuple[str, int]:
    """A module's package ("" for the top-level modules) and its layer."""
    top = module.split(".", 1)[0]
    assert top in LAYERS, f"{module}: its package has no layer in tests/repo/test_layout.py"
    return ("" if "." not in module else top), LAYERS[top]


def test_every_import_goes_down_the_layers() -> None:
    upward = []
    for module, targets in _graph().items():
        package, layer = _layer(module)
        for target in sorted(targets):
            target_package, target_layer = _layer(target)
            if target_package != package and target_layer >= layer:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that do not go down the layers:\n" + "\n".join(upward)


def test_no_import_circle() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []
    circles: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circles.append(" -> ".join([*path[path.index(target):], target]))
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_no_module_or_class_too_big() -> None:
    too_big = []
    for name, path in _modules().items():
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            too_big.append(f"module {name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    too_big.append(f"class {name}.{node.name}: {size} lines")
    assert not too_big, "past the limits (module 600, class 300):\n" + "\n".join(too_big)


def test_each_package_says_what_it_owns_in_two_lines() -> None:
    packages = sorted(path for path in PACKAGE.iterdir() if (path / "__init__.py").is_file())
    assert {path.name for path in packages} == {
        name for name in LAYERS if name not in ("config", "cli", "__main__", "__init__")}
    for package in packages:
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert doc is not None and len(doc.splitlines()) == 2, package.name
    flat = sorted(path.stem for path in PACKAGE.glob("*.py"))
    assert flat == ["__init__", "__main__", "cli", "config"], flat


def test_the_core_imports_no_front_end() -> None:
    graph = _graph()
    leaks = [f"{module} -> {target}" for module, targets in graph.items()
             if module.split(".", 1)[0] in ("core", "engine")
             for target in sorted(targets) if target.split(".", 1)[0] in FRONT_ENDS]
    assert not leaks, leaks


def _private_names(package: str) -> set[str]:
    """Every `_name` a package defines: functions, classes, module names, attributes
    its code assigns (`self._x = ...`), and __slots__ entries."""
    names: set[str] = set()
    for name, path in _modules().items():
        if name.split(".", 1)[0] != package and (package or "." in name):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)  # __slots__ entries
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def test_no_private_name_is_used_across_packages() -> None:
    """`obj._name` and `from x import _name` only where the package defines `_name`:
    one package reaches another only through its public names."""
    own: dict[str, set[str]] = {}
    crossing = []
    for name, path in _modules().items():
        package = name.split(".", 1)[0] if "." in name else ""
        defined = own.setdefault(package, _private_names(package))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                if node.attr not in defined and node.attr not in FOREIGN_PRIVATE:
                    crossing.append(f"{name}:{node.lineno}: .{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module \
                    and node.module.startswith("sfcore_daemon"):
                crossing += [f"{name}:{node.lineno}: import {alias.name}"
                             for alias in node.names
                             if alias.name.startswith("_") and not alias.name.startswith("__")
                             and alias.name not in defined]
    assert not crossing, "private names used across packages:\n" + "\n".join(crossing)


# --- the two threads and the one crossing (docs/architecture.md) -----------------------

# What engine/ shows the packages above it: the Engine, the crossing's frozen records and
# its channel (whose loop side they use), and what start-up, adaptive threads' loop side
# and the step costs' drift check (plain figures the decode thread writes) need. The
# decode thread's own objects (its Job, Seq, the step loop, the rows...)
# are imported by no module outside engine/.
ENGINE_PUBLIC: dict[str, set[str]] = {
    "engine.thread": {"Engine"},
    "engine.crossing": {"JobSpec", "Placement", "Channel", "JobEnd", "NOT_RUN", "EndReason",
                        "CacheSource"},
    "engine.threadpolicy": {"ThreadPolicy", "ThreadLimits"},
    "engine.costdrift": {"CostDrift", "DRIFT"},
    "engine.speculative": {"draft_settings"},
}
CROSSING = "engine.crossing"
# The crossing's state both threads touch: only crossing.py assigns it (the loop's one
# write, the stop flag, through Channel.stop).
SHARED_SLOTS = {"pieces", "numbers", "stopped", "_wake_pending"}


def _engine_imports(name: str, path: Path) -> list[tuple[int, str, str | None]]:
    """(line, engine module, imported name or None for the module itself) for each
    import of engine/ in `name`."""
    package = name.rsplit(".", 1)[0] if "." in name else ""
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.removeprefix("sfcore_daemon."), None)
                      for alias in node.names
                      if alias.name.startswith("sfcore_daemon.engine")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and node.module.startswith("sfcore_daemon"):
                module = node.module.removeprefix("sfcore_daemon").removeprefix(".")
            else:
                continue
            if module == "engine":  # `from sfcore_daemon.engine import thread`
                found += [(node.lineno, f"engine.{alias.name}", None) for alias in node.names]
            elif module.startswith("engine."):
                found += [(node.lineno, module, alias.name) for alias in node.names]
    return found


def test_outside_engine_only_its_public_names_are_imported() -> None:
    wrong = []
    for name, path in _modules().items():
        if name.split(".", 1)[0] == "engine":
            continue
        for line, module, imported in _engine_imports(name, path):
            if imported is None or imported not in ENGINE_PUBLIC.get(module, set()):
                wrong.append(f"{name}:{line}: {module}.{imported or '*'}")
    assert not wrong, ("engine/ names imported outside engine/ that are not its public "
                       "ones (ENGINE_PUBLIC):\n" + "\n".join(wrong))


def test_the_crossing_is_the_one_place_both_threads_touch() -> None:
    """The decode thread calls into the loop only through the channel's wake-up; only
    crossing.py writes the channel's shared state; what crosses besides is frozen."""
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        if name == CROSSING:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if name.startswith("engine.") and isinstance(node, ast.Attribute) \
                    and node.attr == "call_soon_threadsafe":
                wrong.append(f"{name}:{node.lineno}: call_soon_threadsafe (crossing.py's)")
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            for target in targets:
                for part in ast.walk(target):
                    if isinstance(part, ast.Attribute) and part.attr in SHARED_SLOTS \
                            and not (isinstance(part.value, ast.Name)
                                     and part.value.id == "self"):
                        wrong.append(f"{name}:{part.lineno}: writes .{part.attr}")
    tree = ast.parse(modules[CROSSING].read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    for frozen in ("JobSpec", "JobEnd"):
        keywords = {kw.arg: kw.value for kw in classes[frozen].keywords}
        value = keywords.get("frozen")
        if not (isinstance(value, ast.Constant) and value.value is True):
            wrong.append(f"{CROSSING}.{frozen} is not frozen=True")
    if not any(isinstance(base, ast.Name) and base.id == "NamedTuple"
               for base in classes["Placement"].bases):
        wrong.append(f"{CROSSING}.Placement is not a NamedTuple")
    assert not wrong, "outside the one crossing:\n" + "\n".join(wrong)


def test_the_crossing_checks_each_sides_thread_when_asked() -> None:
    """SFCORE_CHECK_THREADS=1 (the harness's daemons run with it): the channel's
    decode-side methods refuse the loop's thread and its loop side any other; the
    records refuse writes. In a child process, which reads the variable as it starts."""
    script = """
import threading
from sfcore_daemon.engine.crossing import Channel, JobEnd, JobSpec, Placement
from sfcore_daemon.llama.sampling import Sampling

def refused(call, error=AssertionError):
    try:
        call()
    except error:
        return
    raise SystemExit(f"not refused: {call}")

channel = Channel(None, lambda: None, lambda end: None)
refused(lambda: channel.put(b"x", 0, []))
refused(lambda: channel.put_numbers(None))
refused(lambda: channel.end(JobEnd("stop")))
channel.stop()
failed = []
thread = threading.Thread(target=lambda: refused(channel.stop) or
                          channel.put(b"x", 0, failed))
thread.start()
thread.join()
assert channel.stopped and list(channel.pieces) == [(b"x", 0)] and failed == [channel]
spec = JobSpec([1], Sampling(0.0, 40, 1.0, 0.0, 1.0, None), 8, True)
refused(lambda: setattr(spec, "max_tokens", 9), AttributeError)
refused(lambda: setattr(JobEnd("stop"), "n_cached", 1), AttributeError)
refused(lambda: setattr(Placement(0), "slot", 1), AttributeError)
print("ok")
"""
    env = {"SFCORE_CHECK_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=PACKAGE.parent,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr
