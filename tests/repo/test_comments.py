"""Comments in sfcore_daemon/ say why, briefly; measurements live in docs/.

A comment states a reason, an invariant or a hazard in at most two lines. A benchmark
figure, a history or a sitting's numbers belong in docs/performance/ (or docs/operations.md,
docs/configuration.md), and the comment links the page.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
PACKAGE = REPO / "sfcore_daemon"

MAX_RUN = 2

# A measurement: a number followed by %, ms, us, µs, tok/s or tokens/s, or a ratio like 1.23x.
FIGURE = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?(?:\s*(?:%|ms\b|us\b|µs\b|tok/s\b|tokens/s\b)|x\b)"
)

# (file, fragment of the comment) pairs whose figure explains a constant's unit rather than
# reporting a measurement. Keep this tiny: a new entry needs the same justification.
ALLOWED_FIGURES: frozenset[tuple[str, str]] = frozenset()


def swept_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def comments(path: Path) -> list[tuple[int, int, str, bool]]:
    """(line, column, text, alone) for each comment; alone: no code shares its line."""
    code_lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER}
    tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    for token in tokens:
        if token.type not in skip:
            code_lines.update(range(token.start[0], token.end[0] + 1))
    return [(token.start[0], token.start[1], token.string, token.start[0] not in code_lines)
            for token in tokens if token.type == tokenize.COMMENT]


def comment_runs(path: Path) -> list[tuple[int, int]]:
    """(first line, length) of each run of comment lines.

    A run is a block of consecutive comment-only lines. A comment trailing code starts a
    run of its own, which the comment-only lines directly below it join only when their
    `#` stands in the trailing comment's column (a continuation of it); a comment-only
    line elsewhere starts a new run. Blank lines, code and docstrings end a run.
    """
    runs: list[tuple[int, int]] = []
    previous = 0
    trailing_column: int | None = None
    for line, column, _, alone in comments(path):
        continues = alone and runs and line == previous + 1 and (
            trailing_column is None or column == trailing_column)
        if continues:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((line, 1))
            trailing_column = None if alone else column
        previous = line
    return runs


def test_no_comment_runs_over_two_lines() -> None:
    long = [f"{path.relative_to(REPO)}:{first} ({length} lines)"
            for path in swept_files() for first, length in comment_runs(path) if length > MAX_RUN]
    assert not long, "comments over two lines; say why in two, link docs/ for the rest:\n" + \
        "\n".join(long)


def test_no_comment_states_a_figure() -> None:
    figures = []
    for path in swept_files():
        rel = path.relative_to(REPO).as_posix()
        for line, _, text, _ in comments(path):
            if FIGURE.search(text) and not any(
                    rel == file and fragment in text for file, fragment in ALLOWED_FIGURES):
                figures.append(f"{rel}:{line}: {text}")
    assert not figures, "figures belong in docs/performance/, linked from the comment:\n" + \
        "\n".join(figures)


def test_no_docstring_states_a_figure() -> None:
    figures = []
    for path in swept_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node) or ""
                figures += [f"{path.relative_to(REPO)}: {getattr(node, 'name', 'module')}: "
                            f"{match.group(0)!r}" for match in FIGURE.finditer(doc)]
    assert not figures, "figures belong in docs/performance/, linked from the docstring:\n" + \
        "\n".join(figures)


def test_the_run_rule_counts_blocks_and_continued_trailing_comments(tmp_path: Path) -> None:
    source = tmp_path / "sample.py"
    source.write_text(
        "# one\n# two\nx = 1  # a trailing comment\n"  # 2, then 1: code ends a run
        "y = 2  # a trailing comment\n       # continued in its column\n"  # 2
        "# a block about z, not a continuation\nz = 3\n"  # 1
        "\n# three\n# lines\n# here\n")  # 3
    assert comment_runs(source) == [(1, 2), (3, 1), (4, 2), (6, 1), (9, 3)]
    assert FIGURE.search("# took 12 ms") and FIGURE.search("# 1.23x faster")
    assert FIGURE.search("# 7% slower") and FIGURE.search("# 98 tok/s")
    assert not FIGURE.search("# 0x1F, 2 MiB pages, n_ctx 8192")


def test_every_allowed_figure_is_still_there() -> None:
    texts = {(path.relative_to(REPO).as_posix(), text)
             for path in swept_files() for _, _, text, _ in comments(path)}
    stale = [entry for entry in ALLOWED_FIGURES
             if not any(file == entry[0] and entry[1] in text for file, text in texts)]
    assert not stale, f"drop these from ALLOWED_FIGURES: {stale}"
