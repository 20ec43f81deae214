"""The prompt corpus of the speculative and concurrency benches: hundreds of prompts of
seven kinds, each in one of two halves, "tuning" (for choosing a policy) and "held-out"
(for judging it), so that a policy is not judged on the prompts it was tuned on.

prompts.jsonl, next to this file, is written by build.py (`.venv/bin/python
scripts/benchkit/corpus/build.py`) from this repository's tracked files at a fixed commit
and a fixed list of standard-library modules; each line is one prompt:
{"id", "kind", "split", "text", "source"}. `free` texts are raw openings to be continued;
every other kind's text is a user message, to be sent as a chat turn.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

PATH = Path(__file__).resolve().parent / "prompts.jsonl"
KINDS = ("code-rename", "code-edit", "prose-edit", "json-edit", "summary", "chat", "free")
# The kinds whose answer copies most of the prompt (the speculative bench's edit workload).
EDIT_KINDS = ("code-rename", "code-edit", "prose-edit", "json-edit")
SPLITS = ("held-out", "tuning")
# What the benches' --corpus-split takes: a split, both ("all"), or the benches' own
# few prompts ("builtin").
CHOICES = ("held-out", "tuning", "all", "builtin")


class CorpusPrompt(NamedTuple):
    id: str
    kind: str
    split: str
    text: str
    source: str


def load(kinds: Iterable[str] | None = None, split: str = "held-out") -> list[CorpusPrompt]:
    """The prompts of `kinds` (None: every kind) in `split` ("all": both), in file order."""
    if split not in (*SPLITS, "all"):
        raise ValueError(f"no split {split!r}; the splits: {', '.join(SPLITS)}, all")
    wanted = set(KINDS if kinds is None else kinds)
    unknown = wanted - set(KINDS)
    if unknown:
        raise ValueError(f"no kind {', '.join(sorted(unknown))}; the kinds: {', '.join(KINDS)}")
    prompts = []
    with PATH.open(encoding="utf-8") as lines:
        for line in lines:
            prompt = CorpusPrompt(**json.loads(line))
            if prompt.kind in wanted and split in ("all", prompt.split):
                prompts.append(prompt)
    return prompts


def texts_by_kind(split: str) -> dict[str, list[str]]:
    """Every kind's texts in `split`, in file order."""
    found: dict[str, list[str]] = {kind: [] for kind in KINDS}
    for prompt in load(split=split):
        found[prompt.kind].append(prompt.text)
    return found
