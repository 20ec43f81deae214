"""What the unit tests of the HTTP front ends' mappings share (tests/unit/openai/,
tests/unit/responses/): hypothesis settings, any JSON value, the shape of a refusal
(a 400), and a mapped request through the NDJSON side's own decoder."""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from sfcore_daemon.core.request import ChatRequest, GenerateRequest
from sfcore_daemon.ndjson import protocol
from sfcore_daemon.openai.translate import ApiError

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)


def check_refusal(error: ApiError) -> None:
    assert error.status == 400
    assert isinstance(error.message, str) and error.message
    assert error.param is None or isinstance(error.param, str)
    body = error.body()
    assert body.error.message == error.message and body.error.type == "invalid_request_error"


def as_ndjson(request: ChatRequest | GenerateRequest) -> protocol.Request:
    """The mapped request through the daemon's own decoder: what the HTTP side builds
    must be a request the NDJSON side would have accepted."""
    if request.top_p == 0:
        # The one known difference: OpenAI's range for top_p takes 0, the NDJSON one
        # does not; the sampler keeps at least one token, so 0 means greedy (the
        # end-to-end test sends it).
        request = msgspec.structs.replace(request, top_p=None)
    op = "chat" if isinstance(request, ChatRequest) else "generate"
    line = msgspec.json.encode({"op": op, **msgspec.structs.asdict(request)})
    decoded: protocol.Request = msgspec.json.decode(line, type=protocol.Request)
    return decoded
