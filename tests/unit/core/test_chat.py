"""The chat op: templates, unforgeable turns, validation and multi-turn cache reuse.

This file holds the tests that need no daemon and no model; those against the real
daemon in tests/e2e/ndjson/test_chat.py.
"""

from __future__ import annotations

from sfcore_daemon.core import chat


def test_no_template_for_an_unknown_architecture() -> None:
    assert chat.resolve_template(model_template=None, configured="", architecture="mamba",
                                 bos_token="", eos_token="") is None
    named = chat.resolve_template(model_template=None, configured="chatml",
                                  architecture="mamba", bos_token="", eos_token="")
    assert named is not None and named.label == "chatml"
    segments = named.render([("user", "hi")])
    assert segments == [("<|im_start|>user\n", False), ("hi", True),
                        ("<|im_end|>\n<|im_start|>assistant\n", False)]
