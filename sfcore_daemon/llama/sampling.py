"""Sampler chains: how each request picks its next token from a row of logits.

A chain is llama.cpp's own C sampler chain, built once per request; the decode thread
calls `llama_sampler_sample` on it (or, with a grammar, `GrammarSampler.sample`). A
plain greedy request (temperature 0, no repeat penalty, no grammar) takes numpy's
argmax of the row instead: the same token, without the chain's candidate array.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass
from typing import Any

from sfcore_daemon.llama.capi import C
from sfcore_daemon.llama.logitrow import row_view

# llama.cpp takes LLAMA_DEFAULT_SEED (0xFFFFFFFF) as "pick a random seed", so client
# seeds are folded into the 32-bit range below it.
SEED_MODULUS = 0xFFFFFFFF
# Tokens the repeat penalty looks back over (llama.cpp's default).
PENALTY_LAST_N = 64


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    seed: int | None
    # OpenAI's penalties, in llama.cpp's penalties sampler beside repeat_penalty: each
    # recent token's logit less frequency_penalty per use and presence_penalty once.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # The seed was drawn by the daemon (the request named none): the reply reports it,
    # and the request is unseeded for drafting (steploop.py).
    drawn_seed: bool = False

    @property
    def penalised(self) -> bool:
        return (self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)


def draw_seed() -> int:
    """A seed for a sampled request that named none, reported in its reply so that the
    reply can be had again."""
    return secrets.randbelow(SEED_MODULUS)


def make_chain(vocab: Any, sampling: Sampling, prompt: list[int]) -> tuple[Any, Any]:
    """A llama.cpp sampler chain for one request (the caller frees it), and the repeat
    penalty's sampler in it (None without one; the chain owns it): a grammar's draw
    over masked candidates rebuilds that sampler's history (grammar.py)."""
    penalties: Any = None
    chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
    add = C.llama_sampler_chain_add
    # Cheap filters first: top_k shrinks the candidates before anything sorts them.
    if sampling.temperature > 0 and sampling.top_k > 0:
        add(chain, C.llama_sampler_init_top_k(sampling.top_k))
    if sampling.penalised:
        n_vocab = C.llama_vocab_n_tokens(vocab)
        penalties = C.llama_sampler_init_penalties(
            n_vocab, PENALTY_LAST_N, sampling.repeat_penalty, sampling.frequency_penalty,
            sampling.presence_penalty)
        add(chain, penalties)
        # The prompt's tail counts as "recent" too, as in llama.cpp's own tools.
        for token in prompt[-PENALTY_LAST_N:]:
            C.llama_sampler_accept(chain, token)
    if sampling.temperature <= 0:
        if penalties is None:
            # The same argmax, faster than the greedy sampler alone over the whole vocabulary
            # (docs/performance/design.md, "Decode loop").
            add(chain, C.llama_sampler_init_top_k(1))
        add(chain, C.llama_sampler_init_greedy())
        return chain, penalties
    if sampling.top_p < 1.0:
        add(chain, C.llama_sampler_init_top_p(sampling.top_p, 1))
    if sampling.min_p > 0.0:
        add(chain, C.llama_sampler_init_min_p(sampling.min_p, 1))
    add(chain, C.llama_sampler_init_temp(sampling.temperature))
    seed = C.LLAMA_DEFAULT_SEED if sampling.seed is None else sampling.seed % SEED_MODULUS
    add(chain, C.llama_sampler_init_dist(seed))
    return chain, penalties


# numpy once `import_numpy_beside` has imported it, on a thread beside the model load so
# start-up does not wait; greedy argmax beats the C chain (docs/performance/design.md).
_imported: dict[str, Any] = {}


def import_numpy_beside() -> threading.Thread:
    """Start importing numpy on a thread of its own; join it before serving."""
    def run() -> None:
        try:
            import numpy
        except ImportError:  # the chain then draws every token, as before
            return
        _imported["numpy"] = numpy

    thread = threading.Thread(target=run, name="sfcore-import", daemon=True)
    thread.start()
    return thread


def is_plain_greedy(sampling: Sampling) -> bool:
    """Whether the chain for `sampling` is an argmax and nothing else."""
    return sampling.temperature <= 0 and not sampling.penalised and "numpy" in _imported


def argmax(ctx: Any, row: int, n_vocab: int) -> int:
    """The token with the highest logit in `row` (the first of equals, like top_k(1))."""
    return int(row_view(ctx, row, n_vocab).argmax())
