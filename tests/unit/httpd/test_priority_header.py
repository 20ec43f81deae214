"""The priority an HTTP request asks for (issue 64): the X-Sfcore-Priority header on
every API, over OpenAI's service_tier; a bad header is a 400 naming it."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request
from hypothesis import given
from hypothesis import strategies as st

from sfcore_daemon.core.request import ChatRequest, GenerateRequest, Message
from sfcore_daemon.httpd.api import PRIORITY_HEADER, ApiHost, tier_priority
from sfcore_daemon.httpd.errors import ApiError
from tests.kit.mapping import FAST

CHAT = ChatRequest(id="c", messages=[Message(role="user", content="hi")])


@pytest.mark.parametrize("core", [CHAT, GenerateRequest(id="g", prompt="x", priority="background")])
@pytest.mark.parametrize("given_value", ["interactive", "background"])
def test_the_header_sets_the_priority_whatever_the_body_said(
        core: ChatRequest | GenerateRequest, given_value: str) -> None:
    request = make_mocked_request("POST", "/v1/x", headers={PRIORITY_HEADER: given_value})
    prioritized = ApiHost.with_priority(request, core)
    assert type(prioritized) is type(core) and prioritized.priority == given_value
    assert prioritized.id == core.id


def test_without_the_header_the_body_decides() -> None:
    request = make_mocked_request("POST", "/v1/x")
    assert ApiHost.with_priority(request, CHAT) is CHAT


@FAST
@given(st.text(max_size=80).filter(lambda text: text.strip() not in ("interactive",
                                                                     "background")))
def test_any_other_header_value_is_a_400_naming_the_header(value: str) -> None:
    # What aiohttp would hand on: no line breaks, no outer whitespace.
    value = " ".join(value.split()) or "x"
    request = make_mocked_request("POST", "/v1/x", headers={PRIORITY_HEADER: value})
    with pytest.raises(ApiError) as caught:
        ApiHost.with_priority(request, CHAT)
    assert caught.value.status == 400 and caught.value.code == "invalid_request"
    assert PRIORITY_HEADER in caught.value.message
    caught.value.message.encode("ascii")  # the client's bytes are escaped


def test_service_tier_flex_is_background_and_anything_else_interactive() -> None:
    assert tier_priority("flex") == "background"
    for other in (None, "auto", "default", "priority", "Flex", 3, ["flex"]):
        assert tier_priority(other) == "interactive"
