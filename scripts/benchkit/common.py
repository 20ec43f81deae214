"""What every section shares: the repository, the hang bound, progress lines, deterministic
filler text, the figures of one generation and clients released together."""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec

REPO = Path(__file__).resolve().parent.parent.parent
SHORT_PROMPT = "Write a haiku about the sea."
SAMPLED = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": 42}
FILLER_WORDS = """model token cache socket daemon river mountain garden library engine signal
window harbor lantern market paper thread kernel memory compass winter summer orbit valley
bridge castle forest desert ocean island quickly slowly carefully brightly quietly"""
# The longest wait for any one reply or start. A hang bound, not a speed limit: on a
# 2-core machine that something else keeps busy, llama.cpp's spinning threads run
# several times slower, so the test of the bench raises it (SFCORE_BENCH_TIMEOUT_S).
TIMEOUT_S = float(os.environ.get("SFCORE_BENCH_TIMEOUT_S", "120"))
_T = TypeVar("_T")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def filler_text(n_words: int, seed: int) -> str:
    """Deterministic prose-like text: varied words, so it tokenizes like real input."""
    words = FILLER_WORDS.split()
    rng = random.Random(seed)
    sentences, count = [], 0
    while count < n_words:
        length = rng.randint(6, 14)
        sentence = " ".join(rng.choice(words) for _ in range(length))
        sentences.append(sentence.capitalize() + ".")
        count += length
    return " ".join(sentences)


def generation_figures(started: float, first: float, last: float, tokens: int, *,
                       prompt_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """The same figures for both sides, from the same instants."""
    return {
        "first_token_ms": (first - started) * 1e3,
        "total_ms": (last - started) * 1e3,
        "decode_tok_s": (tokens - 1) / (last - first) if tokens > 1 and last > first
        else float("nan"),
        "tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
    }


decode_reply = msgspec.json.Decoder(dict[str, Any]).decode


def run_together(clients: int, client: Callable[[int], _T]) -> tuple[list[_T], float]:
    """Call client(0) ... client(clients - 1) from as many threads, released at once:
    their results and the perf_counter() of the release. RuntimeError names the first
    client that raised (or did not finish within TIMEOUT_S)."""
    go = threading.Event()
    results: list[Any] = [None] * clients
    failed: list[BaseException | None] = [None] * clients

    def run(index: int) -> None:
        go.wait()
        try:
            results[index] = client(index)
        except BaseException as error:  # reported below, on the caller's thread
            failed[index] = error

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    started = time.perf_counter()
    go.set()
    deadline = started + TIMEOUT_S
    for index, thread in enumerate(threads):
        thread.join(max(0.0, deadline - time.perf_counter()))
        if thread.is_alive():
            raise RuntimeError(f"client {index} did not finish within {TIMEOUT_S:.0f} s")
        if failed[index] is not None:
            raise RuntimeError(f"client {index} failed: {failed[index]!r}")
    return results, started


def peak_rss_mb(pid: int | str = "self") -> float:
    """VmHWM in MB (10^6 bytes, like the model file size it is compared with)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


def chat_turn_renderer(model: str) -> Callable[[str], str]:
    """A user turn as raw prompt text in the model's own chat template (the GGUF's
    `tokenizer.chat_template`, rendered with jinja2 as llama-server's --jinja does, BOS
    left to the servers), so that both servers' plain completion endpoints get the
    prompt the model was trained on: a Gemma turn sent to a ChatML model measured the
    model's confusion more than the drafter."""
    import jinja2
    import llama_cpp

    vocab = llama_cpp.Llama(model, vocab_only=True, verbose=False)
    source = vocab.metadata.get("tokenizer.chat_template")
    del vocab
    if not source:
        return lambda text: f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"
    template = jinja2.Environment().from_string(source)

    def render(text: str) -> str:
        return str(template.render(messages=[{"role": "user", "content": text}],
                                   add_generation_prompt=True, bos_token="", eos_token=""))
    return render
