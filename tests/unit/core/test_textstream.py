"""Unit tests of the UTF-8 / stop-sequence filter (pure logic, no model)."""

from __future__ import annotations

from sfcore_daemon.core.textstream import TextStream


def run(pieces: list[bytes], stops: tuple[str, ...] = ()) -> tuple[list[str], str, str | None]:
    stream = TextStream(stops)
    emitted = [stream.feed(piece) for piece in pieces]
    tail = stream.finish()
    return emitted, "".join(emitted) + tail, stream.stop_hit


def test_emoji_split_over_tokens_is_held_until_complete() -> None:
    emoji = "😀".encode()  # 4 bytes
    emitted, text, _ = run([b"hi ", emoji[:1], emoji[1:3], emoji[3:], b"!"])
    assert emitted == ["hi ", "", "", "😀", "!"]
    assert text == "hi 😀!"


def test_every_emitted_piece_is_valid_text_even_byte_by_byte() -> None:
    source = "naïve — 東京 😀".encode()
    emitted, text, _ = run([source[i:i + 1] for i in range(len(source))])
    assert text == "naïve — 東京 😀"
    for piece in emitted:
        piece.encode("utf-8")  # no lone surrogates, no partial characters


def test_bytes_that_never_form_a_character_are_dropped() -> None:
    # A stray byte mid-stream, then a character cut off by the end of generation.
    emitted, text, _ = run([b"a", b"\xff", b"b", b"\xe6\x9d"])
    assert text == "ab"
    assert emitted == ["a", "", "b", ""]


def test_generation_ending_inside_an_emoji_leaves_no_replacement_character() -> None:
    emoji = "🤗".encode()
    emitted, text, _ = run([b"ok ", emoji[:2]])
    assert text == "ok "
    assert "\ufffd" not in "".join(emitted)


def test_stop_hit_while_a_character_is_incomplete_drops_its_bytes() -> None:
    emoji = "😀".encode()
    _, text, hit = run([b"x END", emoji[:3]], stops=("END",))
    assert hit == "END"
    assert text == "x "


def test_stop_spanning_three_tokens_is_never_emitted() -> None:
    emitted, text, hit = run([b"Answer: 42", b" ##", b"#EN", b"D## more"], stops=("###END##",))
    assert hit == "###END##"
    assert text == "Answer: 42 "
    assert "#" not in "".join(emitted)


def test_stop_prefix_that_turns_out_not_to_match_is_released() -> None:
    emitted, text, hit = run([b"a <", b"/b", b"x> c"], stops=("</body>",))
    assert hit is None
    assert emitted[0] == "a "  # "<" could begin the stop: held back
    assert emitted[1] == ""  # "</b" still could
    assert emitted[2] == "</bx> c"  # no longer can: released at once
    assert text == "a </bx> c"


def test_held_prefix_is_flushed_at_end_of_generation() -> None:
    emitted, text, hit = run([b"value: </bo"], stops=("</body>",))
    assert emitted == ["value: "]
    assert text == "value: </bo"
    assert hit is None


def test_stop_at_the_very_first_token() -> None:
    emitted, text, hit = run([b"STOP", b"ignored"], stops=("STOP",))
    assert hit == "STOP"
    assert text == ""
    assert emitted == ["", ""]


def test_earliest_of_several_stops_wins() -> None:
    _, text, hit = run([b"one two three"], stops=("three", "two"))
    assert hit == "two"
    assert text == "one "


def test_stop_inside_a_multibyte_character_sequence() -> None:
    stop = "東京"
    data = "行き先は東京です".encode()
    _, text, hit = run([data[i:i + 2] for i in range(0, len(data), 2)], stops=(stop,))
    assert hit == stop
    assert text == "行き先は"


def test_no_stops_releases_everything_immediately() -> None:
    emitted, _, _ = run([b"a", b"b"])
    assert emitted == ["a", "b"]


def test_overlapping_stop_prefixes_hold_the_longest_candidate() -> None:
    emitted, text, hit = run([b"xaa", b"ab"], stops=("aab",))
    # "xaa": "aa" may begin "aab" -> held; then "aaab" contains "aab" at index 1.
    assert emitted[0] == "x"
    assert hit == "aab"
    assert text == "xa"
