"""A response's input items as `GET /v1/responses/{id}/input_items` lists them.

The items are the request's input in OpenAI's item shapes, each with an id of its own
(the cursor of the list's pages), after those of the earlier turns when the request
named a `previous_response_id` (their inputs and their outputs, as OpenAI lists a
chain). They are made once the request has been mapped (translate.py), so every item
here is one the daemon read; reasoning items, which it skips, are left out.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any, Final

from sfcore_daemon.httpd.errors import ApiError
from sfcore_daemon.responses.schema import InputItem, InputPart, ResponsesRequest

DEFAULT_LIMIT: Final = 20
MAX_LIMIT: Final = 100
_ORDERS: Final = ("asc", "desc")


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The items of `body.input`, as listed."""
    if isinstance(body.input, str):
        return [_message("user", body.input)] if body.input else []
    items = []
    for item in body.input:
        made = _item(item)
        if made is not None:
            items.append(made)
    return items


def _item(item: InputItem) -> dict[str, Any] | None:
    kind = item.type or "message"
    if kind == "message":
        return _message(item.role or "user", item.content or "")
    if kind == "function_call":
        return {"id": _new_id("fc"), "type": "function_call", "status": "completed",
                "call_id": item.call_id, "name": item.name,
                "arguments": item.arguments or "{}"}
    if kind == "function_call_output":
        output = item.output if isinstance(item.output, str) else [
            {"type": "input_text", "text": part.text or ""} for part in item.output or ()]
        return {"id": _new_id("fco"), "type": "function_call_output", "status": "completed",
                "call_id": item.call_id, "output": output}
    return None


def _message(role: str, content: str | list[InputPart]) -> dict[str, Any]:
    texts = [content] if isinstance(content, str) else [part.text or "" for part in content]
    if role == "assistant":
        parts = [{"type": "output_text", "text": text, "annotations": []} for text in texts]
    else:
        parts = [{"type": "input_text", "text": text} for text in texts]
    return {"id": _new_id("msg"), "type": "message", "role": role, "status": "completed",
            "content": parts}


def page(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """One page of `items` as OpenAI's list object: `limit` (1 to 100, 20 by
    default) items in `order` ("desc", newest first, by default), from after the
    item `after` or up to before the item `before`."""
    limit = _limit(query.get("limit"))
    order = query.get("order", "desc")
    if order not in _ORDERS:
        raise _bad(f"order must be asc or desc, not {order!r}", "order")
    ordered = items if order == "asc" else items[::-1]
    after, before = query.get("after"), query.get("before")
    start = _position(ordered, after, "after") + 1 if after is not None else 0
    end = _position(ordered, before, "before") if before is not None else len(ordered)
    if before is not None and after is None:
        # Paging back: the `limit` items nearest to `before`.
        first = max(0, end - limit)
        chosen = ordered[first:end]
        has_more = first > 0
    else:
        chosen = ordered[start:end][:limit]
        has_more = start + len(chosen) < end
    return {"object": "list", "data": chosen,
            "first_id": chosen[0]["id"] if chosen else None,
            "last_id": chosen[-1]["id"] if chosen else None,
            "has_more": has_more}


def _limit(text: str | None) -> int:
    if text is None:
        return DEFAULT_LIMIT
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise _bad(f"limit must be an integer from 1 to {MAX_LIMIT}, not {text!r}", "limit")
    return limit


def _position(ordered: list[dict[str, Any]], item_id: str, param: str) -> int:
    for index, item in enumerate(ordered):
        if item.get("id") == item_id:
            return index
    raise _bad(f"no input item {item_id!r} in this response", param)


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param, "invalid_request")
