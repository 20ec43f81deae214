"""The benches' prompt corpus (scripts/benchkit/corpus): the committed prompts.jsonl is what
build.py writes, holds every kind at its minimum in two disjoint halves, and `load` filters
it; the text helpers the builder edits with change what they say and nothing else; and the
speculative and concurrency sections draw their prompts from it."""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kit.benchkit import benchkit_module

REPO = Path(__file__).resolve().parents[3]


corpus: Any = benchkit_module("benchkit.corpus")
build: Any = benchkit_module("benchkit.corpus.build")
textops: Any = benchkit_module("benchkit.corpus.textops")
MINIMUM = {"code-rename": 40, "code-edit": 40, "prose-edit": 40, "json-edit": 30,
           "summary": 30, "chat": 60, "free": 80}
FAST = settings(max_examples=150, deadline=None)


def test_the_file_holds_every_kind_at_its_minimum_once_each() -> None:
    prompts = corpus.load(split="all")
    assert len(prompts) >= 400
    assert corpus.PATH.stat().st_size < 700_000
    kinds = Counter(prompt.kind for prompt in prompts)
    assert set(kinds) == set(corpus.KINDS) == set(MINIMUM)
    assert all(kinds[kind] >= least for kind, least in MINIMUM.items()), kinds
    assert set(corpus.EDIT_KINDS) <= set(corpus.KINDS)
    assert len({prompt.id for prompt in prompts}) == len(prompts)
    assert len({prompt.text for prompt in prompts}) == len(prompts)
    for prompt in prompts:
        assert prompt.text.strip() and prompt.source, prompt.id
        digest = hashlib.sha256(prompt.text.encode()).hexdigest()[:12]
        assert prompt.id == f"{prompt.kind}-{digest}"
        assert prompt.split == build.split_of(prompt.id)


def test_each_kind_is_split_about_in_half_into_disjoint_halves() -> None:
    held_out, tuning = corpus.load(), corpus.load(split="tuning")
    assert {p.split for p in held_out} == {"held-out"} and {p.split for p in tuning} == {
        "tuning"}
    assert not {p.id for p in held_out} & {p.id for p in tuning}
    assert not {p.text for p in held_out} & {p.text for p in tuning}
    assert len(held_out) + len(tuning) == len(corpus.load(split="all"))
    for kind in corpus.KINDS:
        share = sum(p.kind == kind for p in held_out) / sum(
            p.kind == kind for p in (*held_out, *tuning))
        assert 0.35 <= share <= 0.65, (kind, share)


def test_load_filters_by_kind_and_split_in_file_order() -> None:
    everything = corpus.load(split="all")
    chat = corpus.load(["chat"], "tuning")
    assert chat and {(p.kind, p.split) for p in chat} == {("chat", "tuning")}
    assert chat == [p for p in everything if p.kind == "chat" and p.split == "tuning"]
    edits = corpus.load(corpus.EDIT_KINDS)
    assert {p.kind for p in edits} == set(corpus.EDIT_KINDS)
    assert corpus.load([]) == []
    texts = corpus.texts_by_kind("held-out")
    assert texts["free"] == [p.text for p in corpus.load(["free"])]
    with pytest.raises(ValueError):
        corpus.load(split="train")
    with pytest.raises(ValueError):
        corpus.load(["poetry"])


def test_build_writes_the_committed_file_byte_for_byte() -> None:
    if sys.version_info[:2] != build.STDLIB_PYTHON:
        pytest.skip(f"the corpus reads Python {build.STDLIB_PYTHON}'s standard library")
    known = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e",
                            f"{build.SOURCE_COMMIT}^{{commit}}"], capture_output=True,
                           check=False)
    if known.returncode != 0:
        pytest.skip("the sources' commit is not in this clone")
    first = build.build()
    assert first == build.build()
    assert first.encode() == corpus.PATH.read_bytes(), (
        "run .venv/bin/python scripts/benchkit/corpus/build.py")


# --- the text helpers ----------------------------------------------------------------------

PROSE = st.text(st.sampled_from("abcdefghij klmnop.,`-\nXYZ"), max_size=300)
NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True)


@FAST
@given(PROSE, st.integers(0, 6), st.integers(0, 2**32))
def test_typos_swap_letters_inside_words_and_move_nothing_else(text: str, count: int,
                                                                seed: int) -> None:
    spoilt, pairs = textops.inject_typos(text, count, random.Random(seed))
    assert len(spoilt) == len(text) and Counter(spoilt) == Counter(text)
    assert all(a == b for a, b in zip(text, spoilt, strict=True) if not a.isalpha())
    assert len(pairs) <= count
    assert (spoilt != text) == bool(pairs)
    for word, typo in pairs:
        assert word != typo and sorted(word) == sorted(typo) and word[0] == typo[0]


@FAST
@given(st.lists(st.one_of(NAMES, st.sampled_from([" ", ".", "(", ")", "\n", "1"])),
                max_size=40), NAMES, NAMES)
def test_a_rename_replaces_every_whole_word_and_nothing_else(parts: list[str], old: str,
                                                             new: str) -> None:
    text = "".join(parts)
    renamed = textops.rename_word(text, old, new)
    if old == new or textops.count_word(text, new):
        return
    assert textops.count_word(renamed, new) == textops.count_word(text, old)
    assert textops.count_word(renamed, old) == 0
    assert textops.rename_word(renamed, new, old) == text


@FAST
@given(st.lists(st.tuples(st.sampled_from(["", "  ", "    ", "\t", "\t\t"]),
                          st.sampled_from(["x = 1", "return y", "}", "call(a, b)"])),
                max_size=20), st.integers(0, 2**32))
def test_spoilt_indentation_changes_leading_whitespace_only(lines: list[tuple[str, str]],
                                                            seed: int) -> None:
    code = "\n".join(indent + text for indent, text in lines)
    spoilt = textops.perturb_indentation(code, random.Random(seed))
    if spoilt is None:
        return
    before, after = code.split("\n"), spoilt.split("\n")
    assert [line.lstrip(" \t") for line in after] == [line.lstrip(" \t") for line in before]
    changed = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    assert 2 <= len(changed) <= 5 and changed == list(range(changed[0], changed[-1] + 1))


def test_naming_styles_round_trip() -> None:
    assert textops.to_camel("max_items") == "maxItems"
    assert textops.to_camel("_private_name") == "_privateName"
    assert textops.to_snake("maxItems") == "max_items"
    assert textops.to_snake(textops.to_camel("read_all_lines")) == "read_all_lines"


# --- the sections that draw from it --------------------------------------------------------


def test_the_speculative_edit_workload_takes_the_edit_kinds_in_turn() -> None:
    speculative: Any = benchkit_module("benchkit.sections.speculative")
    texts = speculative.Texts("held-out")
    kinds = {p.text: p.kind for p in corpus.load(corpus.EDIT_KINDS)}
    # Variants of --runs 5: the single-client ones, edit x4's and the first-token probes'.
    variants = range(6 * (speculative.SINGLE_PROMPTS + speculative.EDIT_CLIENTS
                          + speculative.FIRST_TOKEN_PAIRS))
    edits = [texts.edit(v) for v in variants]
    assert [kinds[text] for text in edits] == [corpus.EDIT_KINDS[v % 4] for v in variants]
    assert len(set(edits)) == len(edits)
    assert texts.free(3) == corpus.texts_by_kind("held-out")["free"][3]
    turn = "<user>{}</user>".format
    work = speculative.workloads(5, turn, texts)
    assert work["edit"] == work["regenerate"] == (turn(texts.edit(5)), {"temperature": 0.0})
    assert work["free"][0] == texts.free(5) and work["sampled"][0] == turn(texts.sampled(5))
    assert "corpus split held-out" in texts.describe()
    builtin = speculative.workloads(5, turn, speculative.Texts("builtin"))
    assert builtin["edit"][0] == speculative.edit_prompt(5, turn)
    assert builtin["free"][0] == speculative.FREE_STARTS[5]
    assert builtin["sampled"][0] == turn(
        f"Write a short story about {speculative.SAMPLED_TOPICS[5]}.")


def test_the_concurrency_rows_take_new_chat_prompts() -> None:
    concurrency: Any = benchkit_module("benchkit.sections.concurrency")
    prompts = concurrency.ClientPrompts("tuning", "[{}]".format)
    rows = [prompts.take(clients) for clients in concurrency.CLIENT_COUNTS]
    sent = [text for row in rows for text in row]
    assert [len(row) for row in rows] == list(concurrency.CLIENT_COUNTS)
    assert len(set(sent)) == len(sent)
    assert sent == [f"[{p.text}]" for p in corpus.load(["chat"], "tuning")][:len(sent)]
    builtin = concurrency.ClientPrompts("builtin")
    assert builtin.take(4) == concurrency.CLIENT_PROMPTS[:4]
