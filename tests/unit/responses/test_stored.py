"""The stored responses (responses/store.py, records.py, items.py), fast: the bounds,
least recently used out first, in memory and on disk; a record file read back as it
was written, and any damage to one found (never anything but DamagedRecord); files
written 0600 in a 0700 folder; the input items listed a page at a time as OpenAI does."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sfcore_daemon.core.request import Message
from sfcore_daemon.httpd.errors import ApiError
from sfcore_daemon.responses import records
from sfcore_daemon.responses.items import input_items, page
from sfcore_daemon.responses.records import DamagedRecord, Record
from sfcore_daemon.responses.reply import ResponsesShape
from sfcore_daemon.responses.schema import ResponseObject, responses_decoder
from sfcore_daemon.responses.store import ResponseStore
from tests.kit.mapping import FAST

CONVERSATION = [Message(role="user", content="hi"), Message(role="assistant", content="yo")]
WAIT_S = 30.0


def body(number: int) -> ResponseObject:
    shape = ResponsesShape("m", responses_decoder.decode(b'{"input": "hi"}'), None)
    return msgspec.structs.replace(shape.base, id=f"resp_{number:024x}")


def rid(number: int) -> str:
    return f"resp_{number:024x}"


def put(store: ResponseStore, number: int) -> None:
    store.put(body(number), CONVERSATION, 2, [{"id": f"msg_{number}"}], 1)


def settle(store: ResponseStore) -> None:
    assert store.writer is not None and store.writer.wait_idle(WAIT_S)


def test_the_store_keeps_its_bounds_least_recently_used_out_first() -> None:
    store = ResponseStore(max_count=2, max_bytes=1 << 20)
    put(store, 0)
    put(store, 1)
    assert asyncio.run(store.get(rid(0))) is not None  # now the most recently used
    put(store, 2)
    assert rid(1) not in store and len(store) == 2
    assert store.delete(rid(0)) and not store.delete(rid(0))
    assert store.nbytes > 0
    store.delete(rid(2))
    assert store.nbytes == 0
    tiny = ResponseStore(max_count=10, max_bytes=100)
    put(tiny, 0)  # larger than the whole budget: not kept
    assert len(tiny) == 0 and tiny.nbytes == 0


def test_records_on_disk_outlive_the_store_and_keep_its_bounds(tmp_path: Path) -> None:
    folder = tmp_path / "responses"
    store = ResponseStore(max_count=3, max_bytes=1 << 20, folder=folder)
    for number in range(4):
        put(store, number)
    settle(store)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    files = sorted(path.name for path in folder.iterdir())
    assert files == [rid(number) + ".resp" for number in (1, 2, 3)]
    for path in folder.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert store.nbytes == sum(path.stat().st_size for path in folder.iterdir())
    # Used last: 1 (its file touched), so 2 goes first in the next store.
    assert asyncio.run(store.get(rid(1))) is not None
    settle(store)
    again = ResponseStore(max_count=2, max_bytes=1 << 20, folder=folder)
    settle(again)
    assert rid(2) not in again and not (folder / (rid(2) + ".resp")).exists()
    found = asyncio.run(again.get(rid(3)))
    assert found is not None and found.conversation == CONVERSATION
    assert found.items == [{"id": "msg_3"}]
    assert msgspec.json.decode(found.body)["id"] == rid(3)
    assert [item["id"] for item in found.next_items()] == ["msg_3"]
    assert again.delete(rid(3))
    settle(again)
    assert not (folder / (rid(3) + ".resp")).exists()


def test_a_damaged_or_foreign_file_is_dropped_never_served(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    folder = tmp_path / "responses"
    store = ResponseStore(max_count=10, max_bytes=1 << 20, folder=folder)
    for number in range(3):
        put(store, number)
    settle(store)
    first = folder / (rid(0) + ".resp")
    first.write_bytes(first.read_bytes()[:-3])  # truncated
    second = folder / (rid(1) + ".resp")
    data = bytearray(second.read_bytes())
    data[-5] ^= 0x40  # a flipped bit
    second.write_bytes(bytes(data))
    (folder / "notes.txt").write_text("not ours")
    os.symlink(folder / (rid(2) + ".resp"), folder / (rid(9) + ".resp"))
    again = ResponseStore(max_count=10, max_bytes=1 << 20, folder=folder)
    assert rid(9) not in again  # a link is not a record
    for number in (0, 1):
        assert asyncio.run(again.get(rid(number))) is None
        assert rid(number) not in again
    assert asyncio.run(again.get(rid(2))) is not None
    settle(again)
    assert not first.exists() and not second.exists()
    assert (folder / "notes.txt").exists()
    assert "truncated" in caplog.text and "checksum" in caplog.text


def test_a_store_whose_folder_cannot_be_made_keeps_responses_in_memory(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = ResponseStore(max_count=10, max_bytes=1 << 20, folder=blocker / "responses")
    assert store.folder is None
    put(store, 0)
    assert asyncio.run(store.get(rid(0))) is not None


RECORD = records.encode_record(Record(id=rid(7), conversation=CONVERSATION,
                                      items=[{"id": "msg_1", "type": "message"}],
                                      body=msgspec.Raw(b'{"id": "x"}')))


def test_a_record_reads_back_as_written() -> None:
    record = records.decode_record(RECORD, rid(7))
    assert record.conversation == CONVERSATION and bytes(record.body) == b'{"id": "x"}'
    with pytest.raises(DamagedRecord, match="holds"):
        records.decode_record(RECORD, rid(8))


def check_decoding(data: bytes) -> None:
    try:
        record = records.decode_record(data, rid(7))
    except DamagedRecord as exc:
        assert exc.reason
    else:
        assert data == RECORD and record.id == rid(7)


@FAST
@given(st.binary(max_size=512))
def test_random_bytes_are_damaged(data: bytes) -> None:
    check_decoding(data)
    check_decoding(records.MAGIC + data)


@FAST
@given(st.integers(0, len(RECORD)), st.integers(0, len(RECORD) - 1), st.integers(0, 255))
def test_a_truncated_or_changed_record_is_damaged(cut: int, at: int, value: int) -> None:
    check_decoding(RECORD[:cut])
    changed = bytearray(RECORD)
    changed[at] = value
    check_decoding(bytes(changed))


@FAST
@given(st.binary(max_size=256))
def test_a_record_with_a_right_checksum_and_wrong_contents_is_damaged(payload: bytes) -> None:
    import zlib

    framed = (records.MAGIC + len(payload).to_bytes(4, "little")
              + zlib.crc32(payload).to_bytes(4, "little") + payload)
    check_decoding(framed)


# --- input items ---------------------------------------------------------------------


def listed(body: dict[str, Any]) -> list[dict[str, Any]]:
    return input_items(responses_decoder.decode(msgspec.json.encode(body)))


def test_input_items_in_openai_shapes() -> None:
    items = listed({"input": [
        {"role": "developer", "content": "be brief"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
        {"type": "reasoning", "summary": []}]})
    assert [item["type"] for item in items] == ["message", "message", "function_call",
                                                "function_call_output"]
    assert items[0]["content"] == [{"type": "input_text", "text": "be brief"}]
    assert items[1]["content"] == [{"type": "output_text", "text": "a", "annotations": []}]
    assert items[3]["output"] == "42" and items[3]["call_id"] == "c1"
    assert len({item["id"] for item in items}) == 4
    assert all(item["status"] == "completed" for item in items)
    text = listed({"input": "hi"})
    assert text[0]["role"] == "user" and text[0]["content"][0]["text"] == "hi"


ITEMS = [{"id": f"i{number}"} for number in range(7)]


def ids(result: dict[str, Any]) -> list[str]:
    return [item["id"] for item in result["data"]]


def test_pages_as_openai_lists_them() -> None:
    newest = page(ITEMS, {"limit": "3"})
    assert ids(newest) == ["i6", "i5", "i4"] and newest["has_more"]
    assert (newest["object"], newest["first_id"], newest["last_id"]) == ("list", "i6", "i4")
    rest = page(ITEMS, {"limit": "3", "after": "i2"})
    assert ids(rest) == ["i1", "i0"] and not rest["has_more"]
    assert ids(page(ITEMS, {"order": "asc", "after": "i1", "limit": "2"})) == ["i2", "i3"]
    back = page(ITEMS, {"order": "asc", "before": "i5", "limit": "2"})
    assert ids(back) == ["i3", "i4"] and back["has_more"]
    assert ids(page(ITEMS, {"order": "asc", "before": "i1"})) == ["i0"]
    assert ids(page(ITEMS, {})) == [f"i{number}" for number in range(6, -1, -1)]
    empty = page([], {})
    assert empty["data"] == [] and empty["first_id"] is None and not empty["has_more"]


@pytest.mark.parametrize(("query", "param"), [
    ({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"), ({"limit": "x"}, "limit"),
    ({"order": "up"}, "order"), ({"after": "nope"}, "after"), ({"before": "nope"}, "before")])
def test_bad_page_queries_are_400_naming_the_parameter(query: dict[str, str],
                                                       param: str) -> None:
    with pytest.raises(ApiError) as caught:
        page(ITEMS, query)
    assert caught.value.status == 400 and caught.value.param == param


@FAST
@given(st.integers(1, 100), st.sampled_from(["asc", "desc"]), st.integers(0, 12))
def test_paging_through_visits_every_item_once(limit: int, order: str, count: int) -> None:
    items = [{"id": f"i{number}"} for number in range(count)]
    seen: list[str] = []
    query = {"limit": str(limit), "order": order}
    while True:
        result = page(items, query)
        seen += ids(result)
        if not result["has_more"]:
            break
        query = {**query, "after": result["last_id"]}
    expected = [item["id"] for item in items]
    assert seen == (expected if order == "asc" else expected[::-1])


query_values = st.none() | st.sampled_from(["i0", "i3", "i6", "asc", "desc", "0", "1", "20",
                                            "100", "101", "-1", ""]) | st.text(max_size=8)


@FAST
@given(st.fixed_dictionaries({}, optional={name: query_values for name in
                                           ("limit", "order", "after", "before")}))
def test_any_query_is_a_page_or_a_400(query: dict[str, str | None]) -> None:
    given_query = {name: value for name, value in query.items() if value is not None}
    try:
        result = page(ITEMS, given_query)
    except ApiError as error:
        assert error.status == 400 and error.param in given_query
    else:
        assert set(result) == {"object", "data", "first_id", "last_id", "has_more"}
        assert len(result["data"]) <= int(given_query.get("limit", "20"))
