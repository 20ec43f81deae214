"""What the tests and the scripts share lies in one package, the test kit (tests/kit/):
no test file imports another, and scripts/ (the benches) import the kit, never a test.

Read from the source with `ast` (nothing is imported).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.kit import REPO

KIT = "tests.kit"
ROOTS = ("tests", "scripts")


def _dotted(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def _imported(source: str, package: str) -> Iterator[tuple[int, str]]:
    """(line, module) of every import in a module of `package`, at any depth: a relative
    import resolved against the package, `from A import B` as A.B, and
    importlib.import_module("A") with a literal name as A."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            yield from ((node.lineno, f"{base}.{alias.name}") for alias in node.names)
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) or getattr(node.func, "id", None))
              == "import_module"):
            yield node.lineno, node.args[0].value


def _is_test_tree(module: str) -> bool:
    return module == "tests" or module.startswith("tests.")


def _in_kit(module: str) -> bool:
    return module == KIT or module.startswith(KIT + ".")


def test_only_the_kit_is_imported_across_test_files_and_by_the_scripts() -> None:
    files = [path for root in ROOTS for path in sorted((REPO / root).rglob("*.py"))]
    assert len(files) > 100, files  # the walk found the suite
    offending, kit_users = [], 0
    for path in files:
        package = _dotted(path).rsplit(".", 1)[0]
        for line, module in _imported(path.read_text(), package):
            if not _is_test_tree(module):
                continue
            kit_users += _in_kit(module)
            # `from tests import kit` names the kit too; nothing else of tests/ is shared.
            if not _in_kit(module):
                offending.append(f"{path.relative_to(REPO)}:{line}: {module}")
    assert not offending, "import the shared parts from tests/kit instead:\n" + "\n".join(
        offending)
    assert kit_users > 100, kit_users  # the imports were read


def test_the_check_sees_each_kind_of_import() -> None:
    """The reader above catches a plain, a from, a relative and an importlib import."""
    source = ("import tests.e2e.ndjson.test_cache\n"
              "from tests.unit.openai import test_openai_mapping\n"
              "from .test_cache import PREFIX\n"
              "def f():\n"
              "    from tests.kit.prompts import PREFIX\n"
              "    importlib.import_module('tests.lifecycle.test_config')\n")
    found = sorted(_imported(source, "tests.e2e.ndjson"))
    assert found == [(1, "tests.e2e.ndjson.test_cache"),
                     (2, "tests.unit.openai.test_openai_mapping"),
                     (3, "tests.e2e.ndjson.test_cache.PREFIX"),
                     (5, "tests.kit.prompts.PREFIX"),
                     (6, "tests.lifecycle.test_config")], found
    assert [_in_kit(name) for _, name in found] == [False, False, False, True, False]
