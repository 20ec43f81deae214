"""Pure text helpers of the corpus builder: the edits its prompts ask for (a rename, a
naming style, typos to correct, indentation to fix) and the pieces it cuts from sources
(functions, paragraphs, sentences). Deterministic given the `random.Random` passed in."""

from __future__ import annotations

import random
import re
from collections import Counter
from typing import NamedTuple

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
WORD_CHAR = "A-Za-z0-9_"


def whole_word(word: str) -> re.Pattern[str]:
    return re.compile(rf"(?<![{WORD_CHAR}]){re.escape(word)}(?![{WORD_CHAR}])")


def rename_word(text: str, old: str, new: str) -> str:
    """`text` with every whole-word occurrence of `old` (not inside a longer identifier)
    replaced by `new`, and nothing else changed."""
    return whole_word(old).sub(lambda _: new, text)


def count_word(text: str, word: str) -> int:
    return len(whole_word(word).findall(text))


def to_camel(name: str) -> str:
    """snake_case to camelCase (leading underscores kept)."""
    stripped = name.lstrip("_")
    head, *rest = stripped.split("_")
    return name[:len(name) - len(stripped)] + head + "".join(
        part[:1].upper() + part[1:] for part in rest if part)


def to_snake(name: str) -> str:
    """camelCase or PascalCase to snake_case."""
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def inject_typos(text: str, count: int, rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    """`text` with two adjacent, different letters swapped inside each of `count` words
    (lower-case words of five letters or more, never the first letter), fewer if the
    text has fewer such words; and the (word, misspelt word) pairs. Only letters move:
    the length and every other character stay where they were."""
    candidates = [match for match in re.finditer(r"(?<![\w`/.-])[a-z]{5,}(?![\w`/.-])", text)
                  if any(a != b for a, b in zip(match[0][1:], match[0][2:], strict=False))]
    chosen = sorted(rng.sample(candidates, min(count, len(candidates))), key=lambda m: m.start())
    chars = list(text)
    pairs = []
    for match in chosen:
        word = match[0]
        places = [i for i in range(1, len(word) - 1) if word[i] != word[i + 1]]
        i = rng.choice(places)
        typo = word[:i] + word[i + 1] + word[i] + word[i + 2:]
        chars[match.start():match.end()] = typo
        pairs.append((word, typo))
    return "".join(chars), pairs


def indentation(line: str) -> str:
    return line[:len(line) - len(line.lstrip(" \t"))]


def perturb_indentation(code: str, rng: random.Random) -> str | None:
    """`code` with the indentation of a run of two to five consecutive indented lines
    halved or made deeper (by a tab where it is tabs, else three spaces); None if it
    has no such run. Only leading whitespace changes: every line's text after it stays."""
    lines = code.split("\n")
    runs = [i for i in range(1, len(lines) - 2)
            if all(lines[j].strip() and indentation(lines[j]) for j in (i, i + 1))]
    if not runs:
        return None
    start = rng.choice(runs)
    end = start + 1
    while end + 1 < len(lines) and end - start < 4 and lines[end + 1].strip() \
            and indentation(lines[end + 1]) and rng.random() < 0.6:
        end += 1
    deeper = rng.random() < 0.5
    for j in range(start, end + 1):
        indent = indentation(lines[j])
        extra = "\t" if indent.startswith("\t") else "   "
        new = indent + extra if deeper else indent[:len(indent) // 2]
        lines[j] = new + lines[j][len(indent):]
    return "\n".join(lines)


def sentences(paragraph: str) -> list[str]:
    """The paragraph's sentences: split after '.', '?' or '!' and a space before an
    upper-case letter or a backtick."""
    return re.split(r"(?<=[.?!])\s+(?=[A-Z`(])", paragraph)


class Function(NamedTuple):
    language: str
    source: str
    name: str
    code: str


JS_FUNCTION = (r"(export\s+)?(async\s+)?function\b"
               r"|(async\s+)?(static\s+)?#?[A-Za-z_]\w*\s*\([^;]*\)\s*\{\s*$"
               r"|(export\s+)?(const|let)\s+\w+\s*=\s*(async\s*)?\([^)]*\)\s*=>\s*\{\s*$"
               r"|test\(.*=>\s*\{\s*$")
BRACE_STARTS = {
    "go": re.compile(r"^func\s"),
    "rust": re.compile(r"^\s*(pub(\([a-z]+\))?\s+)?(async\s+)?fn\s"),
    "javascript": re.compile(rf"^\s*({JS_FUNCTION})"),
    "typescript": re.compile(rf"^\s*({JS_FUNCTION}|export\s+(interface|declare\s+class)\s)"),
    "shell": re.compile(r"^\s*(function\s+)?[A-Za-z_][\w-]*\s*\(\)\s*\{\s*$"),
}
NOT_FUNCTIONS = re.compile(r"^\s*(if|for|while|switch|catch|return|else|do|try)\b")
NAMES = (re.compile(r"(?:fn|func|function|interface|class)\s+(?:\([^)]*\)\s*)?([A-Za-z_]\w*)"),
         re.compile(r"([#A-Za-z_][\w-]*)\s*\("))


def name_of(line: str) -> str:
    for pattern in NAMES:
        match = pattern.search(line)
        if match:
            return match[1]
    return ""


def brace_functions(language: str, source: str, text: str, shortest: int,
                    longest: int) -> list[Function]:
    """Functions of a brace language from their first line to the line that closes
    their first brace, `shortest` to `longest` lines. Braces in double-quoted strings
    and `//` comments are not counted."""
    lines = text.split("\n")
    found = []
    start = BRACE_STARTS[language]
    i = 0
    while i < len(lines):
        if not start.match(lines[i]) or NOT_FUNCTIONS.match(lines[i]):
            i += 1
            continue
        depth, opened, end = 0, False, None
        for j in range(i, min(len(lines), i + longest + 1)):
            bare = re.sub(r'"(\\.|[^"\\])*"', '""', lines[j].split("//")[0])
            depth += bare.count("{") - bare.count("}")
            opened = opened or "{" in bare
            if opened and depth <= 0:
                end = j
                break
        if end is not None and shortest <= end - i + 1 <= longest \
                and lines[end].strip().startswith("}"):
            code = "\n".join(lines[i:end + 1])
            found.append(Function(language, source, name_of(lines[i]), dedent(code)))
            i = end + 1
        else:
            i += 1
    return found


def dedent(code: str) -> str:
    """The lines' common leading whitespace removed (tabs and spaces alike)."""
    lines = code.split("\n")
    indents = [indentation(line) for line in lines if line.strip()]
    common = min(indents, key=len) if indents else ""
    while common and not all(indent.startswith(common) for indent in indents):
        common = common[:-1]
    return "\n".join(line[len(common):] if line.strip() else "" for line in lines)


SHELL_PAIRS = (("if", "fi"), ("do", "done"), ("case", "esac"))


def shell_balanced(lines: list[str]) -> bool:
    """Whether the lines close every brace, if, loop and case they open, and end on a
    command that does not go on."""
    code = " ".join(re.sub(r"(^|\s)#.*", "", line) for line in lines)
    words = re.findall(r"[\w-]+", re.sub(r"'[^']*'|\"(\\.|[^\"\\])*\"", "", code))
    return (bool(lines) and code.count("{") == code.count("}")
            and all(words.count(a) == words.count(b) for a, b in SHELL_PAIRS)
            and not lines[-1].rstrip().endswith(("\\", "|", "&&", "||")))


def shell_blocks(source: str, text: str, shortest: int, longest: int) -> list[Function]:
    """Runs of a shell script's top-level lines between blank lines (several runs joined
    while the whole stays within `longest`), `shortest` lines or more, each a whole
    (shell_balanced) and holding no function (brace_functions finds those)."""
    groups: list[list[str]] = [[]]
    for line in text.split("\n"):
        if line.strip():
            groups[-1].append(line)
        elif groups[-1]:
            groups.append([])
    found: list[list[str]] = []
    current: list[str] = []
    for group in groups:
        whole = shell_balanced(group) and not group[0].startswith((" ", "\t", "#!")) \
            and not any(BRACE_STARTS["shell"].match(line) for line in group)
        if current and (not whole or len(current) + 1 + len(group) > longest):
            if len(current) >= shortest:
                found.append(current)
            current = []
        if whole and len(group) <= longest:
            current = [*current, "", *group] if current else list(group)
    if len(current) >= shortest:
        found.append(current)
    return [Function("shell", source, "", "\n".join(block)) for block in found]


def identifier_counts(code: str) -> Counter[str]:
    """Identifiers of `code` by their whole-word occurrences, leaving out any that
    follows a '.' somewhere (another object's attribute: renaming it here breaks it)."""
    counts = Counter(match[0] for match in IDENTIFIER.finditer(code))
    attributes = {match[1] for match in re.finditer(r"\.\s*([A-Za-z_]\w*)", code)}
    return Counter({name: n for name, n in counts.items() if name not in attributes})
