"""A plain greedy request's token comes from numpy's argmax of its logits row instead of
llama.cpp's sampler chain (sampling.py): the same token on every row of a real decode of
the real model.

This file holds the tests that need no daemon and no model; those of llama.cpp and the
real model in-process in tests/e2e/llama/test_sampling.py.
"""

from __future__ import annotations

import dataclasses

from sfcore_daemon.llama.sampling import (
    Sampling,
    import_numpy_beside,
    is_plain_greedy,
)


def test_only_a_chain_that_is_an_argmax_is_replaced() -> None:
    import_numpy_beside().join(60)
    assert is_plain_greedy(GREEDY)
    assert not is_plain_greedy(dataclasses.replace(GREEDY, temperature=0.7))
    assert not is_plain_greedy(dataclasses.replace(GREEDY, repeat_penalty=1.1))


GREEDY = Sampling(temperature=0.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0,
                  seed=None)

