"""The prompt store's tests' common ground (tests/e2e/ndjson/test_prompt_store.py and
tests/lifecycle/test_prompt_store_faults.py): the prompts, a store folder of its own
(the `cache_dir` fixture: import it, and name it in the module's __all__), the config,
a request, the store's stats and files, and the cold-warm-cold answer a restore is
checked against."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kit import Client, Daemon, done_of
from tests.kit.prompts import PREFIX, QUESTION_1, QUESTION_2

__all__ = [
    "LONG", "OTHER", "QUESTION_1", "QUESTION_2", "SHORT_PREFIXES",
    "assert_restored_at_the_question", "cache_dir", "cache_stats", "generate", "state_files",
    "store_config", "warm_answer",
]

# Longer than Gemma 3's 512-token sliding window: a restored state holds only the last
# window of rows in the window layers, so this is where a restore could go wrong. The
# tail makes the question's line start (where a restore begins) one at which restoring
# without placing the window rows (kvcache.KVCache.restore) drifts from the cold text at
# the third token (with PREFIX alone it happened to stay equal for 96 tokens).
LONG = PREFIX + " The end of the records." * 2
OTHER = " ".join(f"Line {i}: nothing to do with boxes or stones, only words." for i in range(30))
SHORT_PREFIXES = [
    " ".join(f"Topic {k}, note {i}: the {('cat', 'dog', 'owl', 'fox')[(i + k) % 4]} sleeps "
             f"{i * 3 % 17} hours." for i in range(28))
    for k in range(4)
]


@pytest.fixture
def cache_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="sfstore", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def store_config(directory: Path, **cache: Any) -> dict[str, Any]:
    return {"cache": {"dir": str(directory), "min_tokens": 64, **cache},
            "server": {"slots": 1}, "model": {"n_ctx": 4096}}


async def generate(client: Client, prompt: str, **options: Any) -> dict[str, Any]:
    request = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": False,
               "speculative": False, **options}
    done = done_of(await client.request(request, timeout=180))
    assert done["finish_reason"] in ("length", "stop"), done
    return done


async def cache_stats(client: Client) -> dict[str, Any]:
    stats = await client.final({"op": "stats"})
    assert stats["type"] == "stats", stats
    cache: dict[str, Any] = stats["cache"]
    return cache


def state_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*/*.kv"))


async def warm_answer(daemon: Daemon) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """LONG + QUESTION_1 cold, then LONG + QUESTION_2 with the prefix warm in the slot,
    then LONG + QUESTION_2 cold (cache_prompt false: nothing reused, nothing kept)."""
    async with daemon.client() as client:
        cold = await generate(client, LONG + QUESTION_1)
        assert cold["timings"]["cache_source"] == "none"
        warm = await generate(client, LONG + QUESTION_2)
        assert warm["timings"]["cache_source"] == "slot"
        cold_2 = await generate(client, LONG + QUESTION_2, cache_prompt=False)
        assert cold_2["timings"]["cache_source"] == "none"
        return cold, warm, cold_2


def assert_restored_at_the_question(restored: dict[str, Any], cold_2: dict[str, Any]) -> None:
    """Restored at the line start before "Question" (a chunk cut of the prompt, where
    the first prompt's state was kept), with the cold run's greedy answer."""
    question = restored["usage"]["prompt_tokens"] - restored["usage"]["cached_tokens"]
    assert 0 < question < 16, restored["usage"]
    # Without the placed window rows this drifted from the cold text at the third token.
    assert restored["text"] == cold_2["text"]
