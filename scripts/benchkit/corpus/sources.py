"""What the corpus builder reads and cuts: tracked files at a commit (git), standard-library
modules, their functions, the docs' paragraphs and headings, TOML tables and made-up
records as JSON, and the chat questions and story openings of benchkit/corpus/topics.py."""

from __future__ import annotations

import ast
import random
import re
import subprocess
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchkit.corpus.textops import Function, brace_functions, dedent, shell_blocks
from benchkit.corpus.topics import (
    CHAT_TOPICS,
    DIFFERENCES,
    HOW_TO,
    LANGUAGES,
    RECORD_FIELDS,
    STORY_PARTS,
    STORY_TEMPLATES,
    TIPS,
)

RngOf = Callable[..., random.Random]
LANGUAGE = {".py": "python", ".go": "go", ".rs": "rust", ".js": "javascript",
            ".ts": "typescript", ".sh": "shell"}
STDLIB_MODULES = ("textwrap", "shlex", "fractions", "statistics", "heapq", "bisect",
                  "json/encoder", "json/decoder", "csv", "calendar", "difflib", "string",
                  "colorsys", "glob", "fnmatch", "queue", "sched", "graphlib", "reprlib",
                  "pprint", "getopt", "gettext", "base64", "quopri", "netrc", "html/parser",
                  "zipapp", "wave")
SHORTEST, LONGEST = 12, 45  # a function's lines
LONGEST_LINE = 160
FEWEST_WORDS, MOST_WORDS = 60, 200  # a paragraph's
INTEGER = re.compile(r"(?<![\w.])\d+(?![\w.])")
FENCED = re.compile(r"^```.*?^```[^\n]*$", re.MULTILINE | re.DOTALL)
NOT_PROSE = ("#", "|", "<", ">", "```", "    ", "\t", "[!")


def tracked_files(repo: Path, commit: str) -> dict[str, str]:
    """The sources of the corpus among the files tracked at `commit`, by path."""
    listed = subprocess.run(["git", "-C", str(repo), "ls-tree", "-r", "--name-only", commit],
                            capture_output=True, text=True, check=True).stdout.split("\n")
    wanted = sorted(path for path in listed if path and (
        (path.startswith("clients/") and Path(path).suffix in (".go", ".rs", ".ts", ".js",
                                                                ".py"))
        or (path.startswith("sfcore_daemon/") and path.endswith(".py"))
        or path.endswith((".sh", ".toml"))
        or (path.startswith("docs/") and path.endswith(".md")) or path == "README.md"))
    batch = subprocess.run(["git", "-C", str(repo), "cat-file", "--batch"],
                           input="".join(f"{commit}:{path}\n" for path in wanted).encode(),
                           capture_output=True, check=True).stdout
    files, at = {}, 0
    for path in wanted:
        header_end = batch.index(b"\n", at)
        size = int(batch[at:header_end].split()[2])
        files[path] = batch[header_end + 1:header_end + 1 + size].decode("utf-8")
        at = header_end + 1 + size + 1
    return files


def stdlib_files(stdlib: Path) -> dict[str, str]:
    """STDLIB_MODULES' sources (those this Python has), as "stdlib/<module>.py"."""
    files = {}
    for module in STDLIB_MODULES:
        path = stdlib / f"{module}.py"
        if path.is_file():
            files[f"stdlib/{module}.py"] = path.read_text(encoding="utf-8")
    return files


def python_functions(source: str, text: str) -> list[Function]:
    """Module-level functions and methods (decorators included), SHORTEST to LONGEST
    lines, dedented; not the functions nested in them."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.split("\n")
    found = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                end = child.end_lineno or child.lineno
                if SHORTEST <= end - first + 1 <= LONGEST:
                    found.append(Function("python", source, child.name,
                                          dedent("\n".join(lines[first - 1:end]))))
            elif isinstance(child, ast.ClassDef):
                visit(child)

    visit(tree)
    return found


def functions(files: dict[str, str]) -> list[Function]:
    """Every function of the code files, file by file in path order."""
    found: list[Function] = []
    for path in sorted(files):
        language = LANGUAGE.get(Path(path).suffix)
        if language == "python":
            found += python_functions(path, files[path])
        elif language == "shell":
            whole = files[path].strip("\n")
            if SHORTEST <= whole.count("\n") + 1 <= LONGEST:
                found.append(Function("shell", path, "", whole))
            else:
                found += brace_functions(language, path, files[path], SHORTEST, LONGEST)
                found += shell_blocks(path, files[path], SHORTEST, LONGEST)
        elif language is not None:
            found += brace_functions(language, path, files[path], SHORTEST, LONGEST)
    return [function for function in found
            if max(len(line) for line in function.code.split("\n")) <= LONGEST_LINE]


def markdown(files: dict[str, str]) -> list[str]:
    return [path for path in sorted(files) if path.endswith(".md")]


def paragraphs(files: dict[str, str]) -> list[tuple[str, str]]:
    """(path, paragraph) of the Markdown files' paragraphs of FEWEST_WORDS to MOST_WORDS
    words, as written (line breaks kept); a list item counts, its marker left out."""
    found = []
    for path in markdown(files):
        for block in re.split(r"\n[ \t]*\n", FENCED.sub("", files[path])):
            lines = block.strip("\n").split("\n")
            if re.match(r"\s*([-*]|\d+\.)\s", lines[0]):
                lines[0] = re.sub(r"^\s*([-*]|\d+\.)\s+", "", lines[0])
                if any(re.match(r"\s*([-*]|\d+\.)\s", line) for line in lines[1:]):
                    continue
                lines = [lines[0], *(line.strip() for line in lines[1:])]
            if any(line.lstrip().startswith(NOT_PROSE) for line in lines) \
                    or any(line.startswith(("    ", "\t")) for line in lines):
                continue
            text = "\n".join(line.rstrip() for line in lines)
            if FEWEST_WORDS <= len(text.split()) <= MOST_WORDS:
                found.append((path, text))
    return found


def headings(files: dict[str, str]) -> list[tuple[str, str]]:
    """(path, heading) of the docs' level-2 and level-3 headings that read as a topic:
    two words or more, no code, no figures, not a page's stock heading."""
    stock = {"history", "examples", "errors", "routes", "results", "pages", "requests",
             "what maps to what", "not supported, and why", "what runs", "how it measures"}
    found = []
    for path in markdown(files):
        for line in FENCED.sub("", files[path]).split("\n"):
            match = re.match(r"#{2,3} (.+)$", line)
            if not match:
                continue
            heading = match[1].strip()
            if len(heading.split()) >= 2 and not re.search(r"[`\d:()]", heading) \
                    and heading.lower() not in stock:
                found.append((path, heading))
    return found


# --- JSON ------------------------------------------------------------------------------------


def toml_tables(files: dict[str, str]) -> list[tuple[dict[str, Any], str]]:
    """Every TOML table (nested ones by themselves too) with four keys or more."""
    found = []

    def visit(table: dict[str, Any], source: str) -> None:
        if len(table) >= 4:
            found.append((table, source))
        for value in table.values():
            if isinstance(value, dict):
                visit(value, source)

    for path in sorted(files):
        if path.endswith(".toml"):
            visit(tomllib.loads(files[path]), path)
    return [(json_safe(table), source) for table, source in found if len(str(table)) < 1500]


def json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(key): json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [json_safe(item) for item in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def made_up_record(kind: str, rng: random.Random) -> dict[str, Any]:
    """A record of `kind` with some of RECORD_FIELDS[kind]'s fields, in their order."""
    fields = RECORD_FIELDS[kind]
    keep = sorted(rng.sample(range(len(fields)), rng.randint(max(4, len(fields) - 4),
                                                             len(fields))))
    record: dict[str, Any] = {}
    for index in keep:
        key, make = fields[index]
        record[key] = make(rng)
    return record


def records(files: dict[str, str], count: int,
            rng_of: RngOf) -> list[tuple[dict[str, Any], str]]:
    """`count` JSON objects: the TOML tables, then made-up records, in a shuffled order."""
    found = toml_tables(files)[:count // 3]
    kinds = sorted(RECORD_FIELDS)
    for index in range(count - len(found)):
        kind = kinds[index % len(kinds)]
        found.append((made_up_record(kind, rng_of("record", index)), f"made-up {kind}"))
    rng_of("records").shuffle(found)
    return found


def scalar_paths(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The paths (keys and list indexes) of the value's scalars under an object key."""
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, dict | list):
                yield from scalar_paths(item, (*path, key))
            else:
                yield (*path, key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if isinstance(item, dict):
                yield from scalar_paths(item, (*path, index))


def value_at(value: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        value = value[part]
    return value


def changed_value(old: Any, rng: random.Random) -> Any:
    if isinstance(old, bool):
        return not old
    if isinstance(old, int):
        return rng.choice((old + 1, old * 2 + 1, old + 10))
    if isinstance(old, float):
        return round(old * rng.choice((0.5, 1.5, 2.0)) + 0.25, 2)
    if old is None:
        return "unknown"
    return rng.choice(("updated", "archived", "pending review", "n/a", str(old) + "-v2"))


# --- chat questions and story openings -------------------------------------------------


def chat_prompts(files: dict[str, str], count: int, rng_of: RngOf) -> list[tuple[str, str]]:
    """`count` questions (fewer if the templates run out): one of each template family in
    turn, each family's questions in a shuffled order."""
    families: dict[str, list[tuple[str, str]]] = {
        "docs": [(f"Explain what \"{heading.lower()}\" means for a local LLM inference "
                  "server, in a few paragraphs.", path) for path, heading in headings(files)],
        "explain": [(f"Explain {topic}.", "topics") for topic in CHAT_TOPICS],
        "how": [(f"How do I {task} in {language}?", "topics")
                for task in HOW_TO for language in LANGUAGES],
        "difference": [(f"What is the difference between {a} and {b}?", "topics")
                       for a, b in DIFFERENCES],
        "tips": [(f"Give three tips for {activity}.", "topics") for activity in TIPS],
    }
    for name, family in families.items():
        unique = sorted(set(family))
        rng_of("chat", name).shuffle(unique)
        families[name] = unique
    found: list[tuple[str, str]] = []
    while len(found) < count and any(families.values()):
        for family in families.values():
            if family and len(found) < count:
                found.append(family.pop(0))
    return found


def story_starts(count: int, rng_of: RngOf) -> list[tuple[str, str]]:
    """`count` openings of stories and histories from STORY_TEMPLATES, no two alike."""
    found: list[tuple[str, str]] = []
    seen: set[str] = set()
    attempt = 0
    while len(found) < count and attempt < count * 20:
        rng = rng_of("story", attempt)
        attempt += 1
        template = STORY_TEMPLATES[attempt % len(STORY_TEMPLATES)]
        text = template.format(**{key: rng.choice(values) for key, values
                                  in STORY_PARTS.items()})
        text = text[0].upper() + text[1:]
        if text not in seen:
            seen.add(text)
            found.append((text, "story templates"))
    return found
