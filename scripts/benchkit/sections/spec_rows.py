"""What verifying a draft costs, and how far a verified row's logits are from a lone row's.

llama.cpp directly, the daemon's context settings, one sequence:

1. The time of one `llama_decode` of 1 + k rows, every row asking for logits (the shape of
   a verification step), median of 9, the sizes in a shuffled order each round, on both
   sides of each multiple of 4 (llama.cpp's output-matrix kernel takes logit rows four at
   a time and sweeps the matrix again for 1-3 left over: speculative.aligned_lengths).
2. Greedy one token a step for 200 tokens (the reference), then the same tokens fed back
   1 + k at a time as if every draft were right: each position where a row's argmax is not
   the reference token, with the logit gap (top logit minus the reference token's).

    .venv/bin/python scripts/bench.py spec-rows [--model PATH]
"""

from __future__ import annotations

import ctypes
import random
import statistics
import time
from typing import Any

from benchkit.context import Bench
from sfcore_daemon.config import ModelConfig
from sfcore_daemon.llama.capi import C
from sfcore_daemon.llama.model import context_params

HELP = "what verifying a draft of k rows costs; rows' argmax against lone rows'"

PROMPTS = {
    "free": "The history of the city of",
    "copy": "<start_of_turn>user\nCopy this code exactly:\n```python\nimport json\n\n\n"
            "def total_price(items):\n    return sum(item.price * item.quantity for item in "
            "items)\n```<end_of_turn>\n<start_of_turn>model\n",
}
DRAFTS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 15, 16, 23, 24, 31, 32, 63, 64)
ROUNDS = 9
BATCH = 512  # the daemon's n_batch: a longer prompt is read in batches of it (Context.fresh)


class Context:
    def __init__(self, path: str) -> None:
        self._quiet = C.llama_log_callback(lambda *_: None)
        C.llama_log_set(self._quiet, None)
        C.llama_backend_init()
        self.model = C.llama_model_load_from_file(path.encode(), C.llama_model_default_params())
        config = ModelConfig(n_ctx=4096)
        self.ctx = C.llama_init_from_model(self.model, context_params(config, 2, 2, 1, 128))
        self.vocab = C.llama_model_get_vocab(self.model)
        self.n_vocab = C.llama_vocab_n_tokens(self.vocab)
        self.memory = C.llama_get_memory(self.ctx)
        self.batch: Any = C.llama_batch_init(BATCH, 0, 1)
        for row in range(BATCH):
            self.batch.n_seq_id[row] = 1

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        buffer = (C.llama_token * (len(data) + 8))()
        count = C.llama_tokenize(self.vocab, data, len(data), buffer, len(buffer), True, True)
        return list(buffer[:count])

    def decode(self, tokens: list[int], start: int, every_row: bool) -> None:
        batch = self.batch
        for index, token in enumerate(tokens):
            batch.token[index] = token
            batch.pos[index] = start + index
            batch.seq_id[index][0] = 0
            batch.logits[index] = 1 if every_row or index == len(tokens) - 1 else 0
        batch.n_tokens = len(tokens)
        if C.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def row(self, index: int) -> list[float]:
        pointer = C.llama_get_logits_ith(self.ctx, index)
        return list((ctypes.c_float * self.n_vocab).from_address(
            ctypes.addressof(pointer.contents)))

    def row_pointer(self, index: int) -> Any:
        """llama.cpp's logits of output row `index` (valid until the next decode)."""
        return C.llama_get_logits_ith(self.ctx, index)

    def fresh(self, prompt: list[int]) -> None:
        """An empty cache, then `prompt` read in batches of the batch's size; its last
        row's logits are row -1."""
        C.llama_memory_clear(self.memory, False)
        for start in range(0, len(prompt), BATCH):
            self.decode(prompt[start:start + BATCH], start, False)


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def reference(context: Context, prompt: list[int], count: int) -> list[int]:
    context.fresh(prompt)
    tokens = [argmax(context.row(-1))]
    for index in range(count - 1):
        context.decode([tokens[-1]], len(prompt) + index, True)
        tokens.append(argmax(context.row(0)))
    return tokens


def differences(context: Context, prompt: list[int], tokens: list[int],
                drafts: int) -> list[tuple[int, float]]:
    context.fresh(prompt)
    position, done, found = len(prompt), 0, []
    while done + drafts + 1 <= len(tokens):
        chunk = tokens[done:done + drafts + 1]
        context.decode(chunk, position, True)
        for offset in range(len(chunk) - 1):
            logits = context.row(offset)
            expected = tokens[done + offset + 1]
            best = argmax(logits)
            if best != expected:
                found.append((done + offset + 1, round(logits[best] - logits[expected], 4)))
        position += len(chunk)
        done += len(chunk)
    return found


def run(bench: Bench) -> dict[str, Any]:
    context = Context(bench.params["model"])
    prompt = context.tokenize(PROMPTS["free"])
    times: dict[int, list[float]] = {drafts: [] for drafts in DRAFTS}
    order = random.Random(0)
    for _ in range(ROUNDS):  # every size in each round: the machine's drift spreads evenly
        for drafts in order.sample(DRAFTS, len(DRAFTS)):
            context.fresh(prompt)
            started = time.perf_counter()
            context.decode(list(range(1000, 1001 + drafts)), len(prompt), True)
            times[drafts].append(time.perf_counter() - started)
    print(f"| rows in the step | ms (median of {ROUNDS}) | ms a row |")
    print("|---|---|---|")
    for drafts in DRAFTS:
        median = statistics.median(times[drafts]) * 1e3
        print(f"| {1 + drafts} | {median:.1f} | {median / (1 + drafts):.2f} |")
    print()
    print("| prompt | rows verified together | positions (of 200) whose argmax differs: "
          "(index, logit gap) |")
    print("|---|---|---|")
    for name, text in PROMPTS.items():
        tokens = context.tokenize(text)
        greedy = reference(context, tokens, 200)
        for drafts in (1, 4, 16, 48):
            print(f"| {name} | {1 + drafts} | {differences(context, tokens, greedy, drafts)} |")
    return {"step_ms": {drafts + 1: statistics.median(values) * 1e3
                        for drafts, values in times.items()}}

