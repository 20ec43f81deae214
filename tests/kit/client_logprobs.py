"""What the Go, Node and Rust clients' logprobs tests check against: the Python client's
entries for the same greedy request, and the generated-tokens counter in the metrics."""

from __future__ import annotations

import re

import sfcore_client


def python_logprobs(path: str, prompt: str) -> list[tuple[int, float]]:
    """(token, logprob) of each token of the greedy 16-token request the examples make."""
    with sfcore_client.Client(path, timeout=60) as client:
        result = client.generate(prompt, max_tokens=16, temperature=0, seed=7,
                                 cache_prompt=False, logprobs=3)
    assert result.logprobs is not None
    return [(entry.token, entry.logprob) for entry in result.logprobs]


def assert_generated_counted(metrics: str, at_least: int) -> None:
    """The metrics text counts the generated tokens (a counter, at least `at_least`)."""
    assert "# TYPE sfcore_generated_tokens_total counter" in metrics
    generated = re.search(r"^sfcore_generated_tokens_total (\d+)", metrics, re.M)
    assert generated is not None and int(generated.group(1)) >= at_least
