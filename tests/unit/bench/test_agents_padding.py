"""The agents section's padding of llama-server's instructions (scripts/benchkit/sections/
agents.py, `server_padding`): none where the two prompts are near enough, else filler
words in proportion to the tokens missing."""

from __future__ import annotations

from typing import Any

from tests.kit.benchkit import benchkit_module

agents: Any = benchkit_module("benchkit.sections.agents")


def test_prompts_within_two_percent_get_no_padding() -> None:
    assert agents.server_padding(13_597, 13_597, 10_875) == ""
    assert agents.server_padding(10_200, 10_000, 7_250) == ""
    assert agents.server_padding(9_000, 10_000, 7_250) == ""  # the server's is longer


def test_a_server_prompt_without_the_tools_gets_words_for_the_tokens_it_lacks() -> None:
    # The default model's 15,000-token sitting: 12,076 tokens against 13,597.
    words = len(agents.server_padding(13_597, 12_076, 10_875).split())
    wanted = (13_597 - 12_076) * 10_875 / 12_076
    # filler_text ends on a whole sentence of at most 14 words.
    assert wanted - 1 <= words <= wanted + 14
    assert agents.server_padding(13_597, 12_076, 10_875) == agents.server_padding(
        13_597, 12_076, 10_875)
