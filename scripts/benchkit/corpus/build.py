#!/usr/bin/env python3
"""Writes prompts.jsonl, the benches' prompt corpus (benchkit/corpus/__init__.py):

    .venv/bin/python scripts/benchkit/corpus/build.py [--check]

Its sources: this repository's tracked files at SOURCE_COMMIT (the clients' Go, Rust,
TypeScript, JavaScript and Python, the daemon's Python, shell scripts, TOML, the
Markdown of docs/ and README.md), read with git, so that later edits of the tree leave
the corpus as it is; and STDLIB_MODULES of the running Python's standard library (the
same file needs the same minor version, STDLIB_PYTHON). Every random choice comes from a
`random.Random` seeded with SEED and a label of its own, so the same sources give the same
file byte for byte. --check compares the file with what would be written.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parents[2]
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))  # run as a script: the benchkit package

from benchkit.corpus import KINDS, PATH, topics  # noqa: E402  (the path above first)
from benchkit.corpus import sources as src  # noqa: E402
from benchkit.corpus.textops import (  # noqa: E402
    Function,
    count_word,
    identifier_counts,
    inject_typos,
    perturb_indentation,
    sentences,
    to_camel,
    to_snake,
)

REPO = SCRIPTS.parent
SOURCE_COMMIT = "95b35853c98eeb711ec1c4a10b6a77ae157d7b4f"
STDLIB_PYTHON = (3, 11)
SEED = 64
# Prompts wanted of each kind (fewer where the sources run out); the speculative bench's
# edit workload takes a quarter of its edit prompts from each edit kind.
TARGETS = {"code-rename": 76, "code-edit": 84, "prose-edit": 76, "json-edit": 72,
           "summary": 56, "chat": 200, "free": 160}
# How the functions and the paragraphs are shared among the kinds that use them.
CODE_SHARE = {"code-rename": 80, "code-edit": 84, "summary": 28, "free": 48}
PROSE_SHARE = {"prose-edit": 76, "summary": 28, "free": 39}
FENCE = {"python": "python", "go": "go", "rust": "rust", "javascript": "javascript",
         "typescript": "typescript", "shell": "bash"}
TITLE = {"python": "Python", "go": "Go", "rust": "Rust", "javascript": "JavaScript",
         "typescript": "TypeScript", "shell": "shell"}


def rng_of(*label: object) -> random.Random:
    return random.Random(":".join(map(str, (SEED, *label))))


# --- code --------------------------------------------------------------------------------


def code_block(function: Function) -> str:
    return f"```{FENCE[function.language]}\n{function.code}\n```"


def what(function: Function) -> str:
    if function.language == "shell" and not function.name:
        return f"a shell script ({function.source}), or part of it"
    kind = ("declaration" if function.source.endswith(".d.ts")
            else "function" if function.name else "code")
    return f"a {TITLE[function.language]} {kind} from {function.source}"


def rename_candidates(function: Function) -> list[str]:
    counts = identifier_counts(function.code)
    return sorted(name for name, n in counts.items()
                  if n >= 2 and len(name) >= 3 and name not in topics.RESERVED
                  and not name.isupper() and not name.startswith("__"))


def new_name(old: str, code: str, rng: random.Random) -> str:
    """A name for `old` in its own style (snake_case, camelCase, PascalCase) that `code`
    does not use yet."""
    words = list(topics.NAME_WORDS)
    rng.shuffle(words)
    for word in words:
        bare = old.lstrip("_")
        if "_" in bare or bare.islower():
            name = old[:len(old) - len(bare)] + f"{word}_{bare}"
        elif bare[0].isupper():
            name = old[:len(old) - len(bare)] + word.capitalize() + bare
        else:
            name = old[:len(old) - len(bare)] + word + bare[0].upper() + bare[1:]
        if not count_word(code, name):
            return name
    return old + "_renamed"


def code_rename(function: Function, rng: random.Random) -> str | None:
    candidates = rename_candidates(function)
    if not candidates:
        return None
    old = rng.choice(candidates)
    new = new_name(old, function.code, rng)
    ask = rng.choice((
        "Rewrite it with the identifier `{old}` renamed to `{new}`. Output the whole code.",
        "Rename `{old}` to `{new}` everywhere in it and output the whole code.",
        "Please rename `{old}` to `{new}` and give me back the complete code, unchanged "
        "otherwise.",
        "Change the name `{old}` to `{new}` throughout. Reply with the whole code."))
    return (f"Here is {what(function)}:\n{code_block(function)}\n"
            + ask.format(old=old, new=new))


def edit_comment(function: Function, rng: random.Random) -> str | None:
    if function.language == "python" and function.name:
        return (f"Add a one-line docstring to `{function.name}` saying what it does. "
                "Output the whole function.")
    subject = f"`{function.name}`" if function.name else "this code"
    return (f"Add a short comment at the top of {subject} that says what it does. "
            "Output the whole code.")


def edit_literal(function: Function, rng: random.Random) -> str | None:
    numbers = sorted({int(match) for match in src.INTEGER.findall(function.code)
                      if 1 < int(match) < 100000})
    if not numbers:
        return None
    old = rng.choice(numbers)
    new = rng.choice((old * 2, old + 1, old * 10, max(2, old // 2) if old > 3 else old + 5))
    return (f"Change the constant `{old}` to `{new}` everywhere it appears in this code. "
            "Output the whole code.")


def edit_parameter(function: Function, rng: random.Random) -> str | None:
    if function.language not in ("python", "javascript", "typescript") or not function.name \
            or function.name in ("constructor", "test"):
        return None
    free = [pair for pair in topics.PARAMETERS if not count_word(function.code, pair[0])]
    name, python_default, js_default = rng.choice(free)
    default = python_default if function.language == "python" else js_default
    if function.language != "python":
        name = to_camel(name)
    return (f"Add a parameter `{name}` with the default value `{default}` at the end of "
            f"the parameters of `{function.name}`; nothing else uses it yet. Output the "
            "whole function.")


def edit_style(function: Function, rng: random.Random) -> str | None:
    names = [name for name in rename_candidates(function)
             if ("_" in name.strip("_") and name.islower()) or
             (name[0].islower() and any(c.isupper() for c in name))]
    if not names:
        return None
    old = rng.choice(names)
    if "_" in old.strip("_"):
        new, style = to_camel(old), "camelCase"
    else:
        new, style = to_snake(old), "snake_case"
    if count_word(function.code, new):
        return None
    return (f"Convert the name `{old}` to {style} (`{new}`) everywhere in this code, "
            "leaving every other name as it is. Output the whole code.")


EDITS: tuple[Callable[[Function, random.Random], str | None], ...] = (
    edit_comment, edit_literal, edit_parameter, edit_style)


def code_edit(function: Function, rng: random.Random, turn: int) -> str | None:
    """One of the copy-heavy edits, by `turn`; where that one does not apply, the first
    of the others that does (a comment, which always does, last). Every fifth asks to
    fix indentation this spoilt."""
    if turn % 5 == 4:
        spoilt = perturb_indentation(function.code, rng)
        if spoilt is not None:
            return (f"The indentation of a few lines of this {TITLE[function.language]} "
                    f"code ({function.source}) is wrong:\n"
                    f"{code_block(function._replace(code=spoilt))}\n"
                    "Fix the indentation and output the whole code.")
    for edit in (EDITS[turn % len(EDITS)], *EDITS[1:], EDITS[0]):
        ask = edit(function, rng)
        if ask is not None:
            return f"Here is {what(function)}:\n{code_block(function)}\n{ask}"
    return None


def code_summary(function: Function, rng: random.Random) -> str:
    ask = rng.choice(("Summarize what this code does in two or three sentences.",
                      "In 2-3 sentences, what does this code do?",
                      "Give a two- or three-sentence summary of this code."))
    return f"{ask}\n{code_block(function)}"


def code_start(function: Function, rng: random.Random) -> str | None:
    lines = function.code.split("\n")
    if len(lines) < 10:
        return None
    cut = rng.randint(max(3, len(lines) * 2 // 5), len(lines) * 7 // 10)
    return "\n".join(lines[:cut]) + "\n"


# --- prose and JSON ----------------------------------------------------------------------


def prose_edit(paragraph: str, rng: random.Random, turn: int) -> str | None:
    if turn % 3 == 2:
        counts = {word: count_word(paragraph, word) for word in topics.SYNONYMS}
        present = sorted(word for word, n in counts.items() if n >= 2)
        if present:
            old = rng.choice(present)
            new = topics.SYNONYMS[old]
            return (f"In the paragraph below, replace the word \"{old}\" with \"{new}\" "
                    f"throughout and output the whole paragraph.\n\n{paragraph}")
    spoilt, pairs = inject_typos(paragraph, rng.randint(2, 5), rng)
    if len(pairs) < 2:
        return None
    ask = rng.choice(("Correct the spelling mistakes in this paragraph and output the "
                      "whole paragraph, changing nothing else.",
                      "Fix the typos in the following text. Reply with the corrected text "
                      "only.",
                      "This paragraph has a few misspelt words. Please return it with the "
                      "spelling fixed."))
    return f"{ask}\n\n{spoilt}"


def prose_summary(paragraph: str, rng: random.Random) -> str:
    ask = rng.choice(("Summarize this paragraph in two or three sentences.",
                      "Give a 2-3 sentence summary of the following text.",
                      "What does this paragraph say? Answer in two or three sentences."))
    return f"{ask}\n\n{paragraph}"


def prose_start(paragraph: str, rng: random.Random) -> str | None:
    parts = sentences(paragraph.replace("\n", " "))
    if len(parts) < 3:
        return None
    return " ".join(parts[:rng.randint(1, 2)])


def json_edit(record: dict[str, Any], rng: random.Random, turn: int) -> str:
    data = json.loads(json.dumps(record))  # a copy to change
    paths = list(src.scalar_paths(data))
    path = rng.choice(paths)
    shown = ".".join(str(part) for part in path)
    if turn % 3 == 0:
        key = next(str(part) for part in reversed(path) if isinstance(part, str))
        new = rng.choice(topics.KEY_RENAMES.get(key, (to_camel(key),)))
        if new == key or (len(new) > len(key) and new[-1].isupper()):
            new = key + "_value"
        ask = f"Rename the key `{key}` to `{new}` wherever it appears."
    elif turn % 3 == 1:
        old = src.value_at(data, path)
        new_value = src.changed_value(old, rng)
        ask = f"Change the value of `{shown}` to {json.dumps(new_value)}."
    else:
        field, value = rng.choice([pair for pair in topics.NEW_FIELDS if pair[0] not in data])
        ask = f"Add a top-level field `{field}` with the value {json.dumps(value)}."
    text = json.dumps(data, indent=2, ensure_ascii=False)
    return (f"Here is a JSON object:\n```json\n{text}\n```\n{ask} Output the whole JSON "
            "object.")


# --- the corpus ----------------------------------------------------------------------------


def share(items: list[Any], targets: dict[str, int]) -> dict[str, list[Any]]:
    """Items handed out in turn to the kind the least filled for its target, so that
    each kind gets the mix of the list's order."""
    shares: dict[str, list[Any]] = {kind: [] for kind in targets}
    for item in items:
        open_kinds = [kind for kind in targets if len(shares[kind]) < targets[kind]]
        if not open_kinds:
            break
        kind = min(open_kinds, key=lambda k: (len(shares[k]) / targets[k], list(targets).index(k)))
        shares[kind].append(item)
    return shares


def interleave(pools: dict[str, list[Any]]) -> Iterator[Any]:
    """One of each pool in turn, pools in sorted order, until every one is empty."""
    queues = {name: list(pools[name]) for name in sorted(pools)}
    while any(queues.values()):
        for queue in queues.values():
            if queue:
                yield queue.pop(0)


def entries() -> Iterator[tuple[str, str, str]]:
    """(kind, text, source) of every prompt, kind by kind, before deduplication."""
    files = src.tracked_files(REPO, SOURCE_COMMIT)
    files.update(src.stdlib_files(Path(sysconfig.get_path("stdlib"))))
    functions: dict[str, list[Function]] = {}
    for function in src.functions(files):
        pool = "python-stdlib" if function.source.startswith("stdlib/") else function.language
        functions.setdefault(pool, []).append(function)
    for pool, found in functions.items():
        rng_of("functions", pool).shuffle(found)
    code = share(list(interleave(functions)), CODE_SHARE)
    paragraphs = src.paragraphs(files)
    rng_of("paragraphs").shuffle(paragraphs)
    prose = share(paragraphs, PROSE_SHARE)
    made: dict[str, list[tuple[str, str]]] = {kind: [] for kind in KINDS}

    def add(kind: str, text: str | None, source: str) -> None:
        if text is not None:
            made[kind].append((text, source))

    for turn, function in enumerate(code["code-rename"]):
        add("code-rename", code_rename(function, rng_of("rename", turn)), function.source)
    for turn, function in enumerate(code["code-edit"]):
        add("code-edit", code_edit(function, rng_of("edit", turn), turn), function.source)
    for turn, (source, paragraph) in enumerate(prose["prose-edit"]):
        add("prose-edit", prose_edit(paragraph, rng_of("prose", turn), turn), source)
    for turn, (record, source) in enumerate(src.records(files, TARGETS["json-edit"], rng_of)):
        add("json-edit", json_edit(record, rng_of("json", turn), turn), source)
    summaries = [(code_summary(f, rng_of("summary", "code", i)), f.source)
                 for i, f in enumerate(code["summary"])]
    summaries += [(prose_summary(p, rng_of("summary", "prose", i)), source)
                  for i, (source, p) in enumerate(prose["summary"])]
    for text, source in interleave({"a": summaries[:len(code["summary"])],
                                    "b": summaries[len(code["summary"]):]}):
        add("summary", text, source)
    for text, source in src.chat_prompts(files, TARGETS["chat"], rng_of):
        add("chat", text, source)
    starts = [(code_start(f, rng_of("free", "code", i)), f.source)
              for i, f in enumerate(code["free"])]
    starts += [(prose_start(p, rng_of("free", "prose", i)), source)
               for i, (source, p) in enumerate(prose["free"])]
    starts += src.story_starts(TARGETS["free"] - len(starts), rng_of)
    rng_of("free", "order").shuffle(starts)
    for text, source in starts:
        add("free", text, source)
    for kind in KINDS:
        for text, source in made[kind][:TARGETS[kind]]:
            yield kind, text, source


def split_of(prompt_id: str) -> str:
    return ("held-out" if int(hashlib.sha256(prompt_id.encode()).hexdigest(), 16) % 2 == 0
            else "tuning")


def build() -> str:
    """The text of prompts.jsonl."""
    seen: set[str] = set()
    lines = []
    for kind, text, source in entries():
        if text in seen:
            continue
        seen.add(text)
        prompt_id = f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
        lines.append(json.dumps({"id": prompt_id, "kind": kind, "split": split_of(prompt_id),
                                 "text": text, "source": source}, ensure_ascii=False))
    return "\n".join(lines) + "\n"


def main() -> int:
    if sys.version_info[:2] != STDLIB_PYTHON:
        print(f"build.py reads Python {'.'.join(map(str, STDLIB_PYTHON))}'s standard library; "
              f"this is {sys.version.split()[0]}", file=sys.stderr)
        return 2
    text = build()
    if "--check" in sys.argv[1:]:
        same = PATH.exists() and PATH.read_text(encoding="utf-8") == text
        print(f"{PATH}: {'up to date' if same else 'differs from what build.py writes'}")
        return 0 if same else 1
    PATH.write_text(text, encoding="utf-8")
    print(f"{PATH}: {text.count(chr(10))} prompts, {len(text.encode()) / 1e3:.0f} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
