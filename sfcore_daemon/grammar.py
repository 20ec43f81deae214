"""Structured output: `json_schema`, `format: "json"` and `grammar` on generate and chat.

Two halves, for two threads:

- On the event loop, before a request is queued: `request_gbnf` turns the request's
  fields into GBNF text (a JSON Schema through llama-cpp-python's converter, after
  `check_schema` has refused what the converter would silently get wrong), and
  `GrammarSampler.create` compiles it with llama.cpp. Every mistake is a
  `GrammarError`, answered as `invalid_request`.
- On the decode thread: `GrammarSampler.sample(chain, ctx, idx)` in place of
  `llama_sampler_sample(chain, ctx, idx)`. It keeps the grammar out of the chain, as
  llama.cpp's common sampler does: the chain samples as usual, only the chosen token is
  tested against the grammar, and only a rejected token costs a grammar pass over the
  most likely candidates (the whole vocabulary as a last resort) and a second draw.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import importlib
import json
import math
import os
import re
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Final

from .llama_c import C

if TYPE_CHECKING:
    from .engine import Engine
    from .protocol import GenerationRequest


class GrammarError(ValueError):
    """The request's schema or grammar cannot be used; the message says why (and where)."""


# --- JSON Schema ------------------------------------------------------------------------

# Keywords that assert nothing: accepted anywhere and ignored.
ANNOTATIONS: Final = frozenset({
    "$schema", "$id", "$comment", "$anchor", "title", "description", "default", "examples",
    "deprecated", "readOnly", "writeOnly", "$defs", "definitions",
})
TYPES: Final = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
STRING_FORMATS: Final = frozenset({"date", "time", "date-time", "uuid"})
# What the converter turns into grammar, by the kind of schema it applies to.
_OBJECT_KEYWORDS: Final = frozenset({"properties", "required", "additionalProperties"})
_ARRAY_KEYWORDS: Final = frozenset({"items", "minItems", "maxItems", "prefixItems"})
_STRING_KEYWORDS: Final = frozenset({"minLength", "maxLength", "pattern", "format"})
SUPPORTED_KEYWORDS: Final = (ANNOTATIONS | _OBJECT_KEYWORDS | _ARRAY_KEYWORDS | _STRING_KEYWORDS
                             | {"type", "enum", "const", "anyOf", "$ref"})
# A repetition becomes one nested rule per allowed count; bounds keep the grammar small.
MAX_REPEAT: Final = 256
# llama.cpp's grammar parser recurses once per nested group; deeper text could exhaust
# the event loop thread's stack before it reports an error.
MAX_GRAMMAR_NESTING: Final = 64
MAX_SCHEMA_DEPTH: Final = 32
# How many of the most likely tokens the slow path runs the grammar over, tier by tier,
# before it tries the whole vocabulary. Measured on 262,144 logits: top_k(128) takes
# 0.2 ms, top_k(32768) 2.7 ms, refilling the candidates 1.6 ms.
RESAMPLE_TIERS: Final = (128, 2048, 32768)

_JSON_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "object": (dict,), "array": (list,), "string": (str,), "number": (int, float),
    "integer": (int,), "boolean": (bool,), "null": (type(None),),
}

# JSON string characters: control characters must be escaped, and a \u escape may not
# name half of a surrogate pair (llama-cpp-python's rule allowed both).
_NO_SURROGATE_ESCAPE: Final = r'"u" ([0-9a-cA-CefEF] [0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2})'
_CHAR_RULE: Final = r'[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | ' + _NO_SURROGATE_ESCAPE + ")"


def request_gbnf(request: GenerationRequest) -> tuple[str, str] | None:
    """The GBNF text a request asks for and the field it came from, or None when the
    request is unconstrained."""
    given = [name for name in ("json_schema", "format", "grammar")
             if getattr(request, name) is not None]
    if len(given) > 1:
        raise GrammarError(f"json_schema, format and grammar exclude each other; "
                           f"this request gives {' and '.join(given)}")
    if request.json_schema is not None:
        return schema_to_gbnf(request.json_schema), "json_schema"
    if request.format is not None:
        return json_gbnf(), "format"
    if request.grammar is not None:
        check_gbnf(request.grammar)
        return request.grammar, "grammar"
    return None


def json_gbnf() -> str:
    """llama.cpp's json.gbnf (any JSON object), with string escapes as in _CHAR_RULE."""
    text: str = _converter_module().JSON_GBNF
    any_hex = '"u" [0-9a-fA-F]{4}'
    if any_hex in text:
        text = text.replace(any_hex, _NO_SURROGATE_ESCAPE)
    return text


def schema_to_gbnf(schema: dict[str, Any]) -> str:
    """GBNF for documents valid against `schema`; GrammarError if it uses a keyword the
    conversion cannot honour."""
    check_schema(schema)
    converter = _converter_class()(prop_order={}, allow_fetch=False, dotall=False,
                                   raw_pattern=False)
    try:
        resolved = converter.resolve_refs(json.loads(json.dumps(schema)), "input")
        converter.visit(resolved, "")
        text: str = converter.format_grammar()
    except (AssertionError, ValueError, KeyError, TypeError, RecursionError) as exc:
        raise GrammarError(f"json_schema cannot be converted to a grammar: {exc}"
                           " - at `$.json_schema`") from None
    return text


def check_schema(schema: dict[str, Any]) -> None:
    """Refuse what the converter would ignore or get wrong, naming keyword and place.

    The converter picks one rule per schema ($ref, then anyOf, then a list of types,
    then const, enum, ...) and drops the other keywords of that schema without a word,
    so a combination it would half-honour is refused rather than let through.
    """
    _check(schema, "$.json_schema", schema, 0)


def _check(schema: Any, path: str, root: dict[str, Any], depth: int) -> None:
    if not isinstance(schema, dict):
        raise GrammarError(f"a schema must be a JSON object (boolean schemas are not "
                           f"supported) - at `{path}`")
    if depth > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"schema nested deeper than {MAX_SCHEMA_DEPTH} levels - at `{path}`")
    for key in schema:
        if key not in SUPPORTED_KEYWORDS:
            raise GrammarError(f"unsupported JSON Schema keyword {key!r} - at `{path}`")
    for key in ("$defs", "definitions"):
        if key in schema:
            defs = schema[key]
            if not isinstance(defs, dict):
                raise GrammarError(f"{key} must be an object - at `{path}.{key}`")
            for name, sub in defs.items():
                _check(sub, f"{path}.{key}.{name}", root, depth + 1)
    asserting = {key for key in schema if key not in ANNOTATIONS}

    def alone(keyword: str) -> None:
        others = sorted(asserting - {keyword})
        if others:
            raise GrammarError(f"{keyword} cannot be combined with {', '.join(others)} "
                               f"(only annotations may stand beside it) - at `{path}`")

    if "$ref" in schema:
        alone("$ref")
        _check_ref(schema["$ref"], f"{path}.$ref", root)
        return
    if "anyOf" in schema:
        alone("anyOf")
        _check_each(schema, "anyOf", path, root, depth)
        return
    kind = schema.get("type")
    if isinstance(kind, list):
        alone("type")
        if not kind or any(not isinstance(t, str) or t not in TYPES for t in kind):
            raise GrammarError(f"type must be one of {sorted(TYPES)} or a non-empty list "
                               f"of them - at `{path}.type`")
        return
    if kind is not None and (not isinstance(kind, str) or kind not in TYPES):
        raise GrammarError(f"type must be one of {sorted(TYPES)} - at `{path}.type`")
    if "const" in schema or "enum" in schema:
        _check_values(schema, kind, path, asserting)
        return
    if kind is None:
        families = [name for name, keys in (("object", _OBJECT_KEYWORDS),
                                            ("array", _ARRAY_KEYWORDS),
                                            ("string", _STRING_KEYWORDS)) if asserting & keys]
        if len(families) > 1:
            raise GrammarError(f"keywords of different types ({' and '.join(families)}) "
                               f"without a type - at `{path}`")
        kind = families[0] if families else None
        if kind == "string" and asserting & {"minLength", "maxLength", "format"}:
            raise GrammarError(f"minLength, maxLength and format need \"type\": \"string\" "
                               f"- at `{path}`")
    misplaced = sorted(asserting - {"type"} - _keywords_of(kind))
    if misplaced:
        raise GrammarError(f"keyword {misplaced[0]!r} does not apply to type {kind!r} "
                           f"- at `{path}`")
    if kind == "object":
        _check_object(schema, path, root, depth)
    elif kind == "array":
        _check_array(schema, path, root, depth)
    elif kind == "string":
        _check_string(schema, path)


def _keywords_of(kind: str | None) -> frozenset[str]:
    return {"object": _OBJECT_KEYWORDS, "array": _ARRAY_KEYWORDS,
            "string": _STRING_KEYWORDS}.get(kind or "", frozenset())


def _check_ref(ref: Any, path: str, root: dict[str, Any]) -> None:
    if not isinstance(ref, str) or not ref.startswith("#/"):
        raise GrammarError(f"only local references (\"#/...\") are supported - at `{path}`")
    target: Any = root
    for part in ref[2:].split("/"):  # as the converter reads it: no ~0/~1 escapes
        if not isinstance(target, dict) or part not in target:
            raise GrammarError(f"reference {ref!r} does not resolve - at `{path}`")
        target = target[part]
    if not isinstance(target, dict):
        raise GrammarError(f"reference {ref!r} is not a schema - at `{path}`")


def _check_values(schema: dict[str, Any], kind: str | None, path: str,
                  asserting: set[str]) -> None:
    extra = sorted(asserting - {"type", "const", "enum"})
    if extra or ("const" in schema and "enum" in schema):
        keyword = "const" if "const" in schema else "enum"
        others = sorted(asserting - {keyword, "type"})
        raise GrammarError(f"{keyword} can only be combined with type, not "
                           f"{', '.join(others)} - at `{path}`")
    if "enum" in schema:
        values = schema["enum"]
        if not isinstance(values, list) or not values:
            raise GrammarError(f"enum must be a non-empty list - at `{path}.enum`")
    else:
        values = [schema["const"]]
    if kind is not None:
        for value in values:
            if not _is_of_type(value, kind):
                raise GrammarError(f"value {json.dumps(value)} is not of type {kind!r} "
                                   f"- at `{path}`")


def _is_of_type(value: Any, kind: str) -> bool:
    if isinstance(value, bool) and kind not in ("boolean",):
        return False
    if kind == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES[kind])


def _count(schema: dict[str, Any], key: str, path: str) -> int | None:
    value = schema.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_REPEAT:
        raise GrammarError(f"{key} must be an integer from 0 to {MAX_REPEAT} - at `{path}.{key}`")
    return value


def _check_bounds(schema: dict[str, Any], path: str, low_key: str, high_key: str) -> None:
    low, high = _count(schema, low_key, path), _count(schema, high_key, path)
    if low is not None and high is not None and low > high:
        raise GrammarError(f"{low_key} is above {high_key} - at `{path}`")


def _check_object(schema: dict[str, Any], path: str, root: dict[str, Any], depth: int) -> None:
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise GrammarError(f"properties must be an object - at `{path}.properties`")
    for name, sub in properties.items():
        _check(sub, f"{path}.properties.{name}", root, depth + 1)
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise GrammarError(f"required must be a list of strings - at `{path}.required`")
    for name in required:
        if name not in properties:
            raise GrammarError(f"required property {name!r} is not in properties "
                               f"- at `{path}.required`")
    extra = schema.get("additionalProperties", False)
    if extra is not False:
        if properties:
            # Free keys could repeat a declared one with a value of another type.
            raise GrammarError("additionalProperties other than false is supported only in "
                               f"an object without properties - at `{path}`")
        if extra is not True:
            _check(extra, f"{path}.additionalProperties", root, depth + 1)


def _check_each(schema: dict[str, Any], key: str, path: str, root: dict[str, Any],
                depth: int) -> None:
    """`schema[key]` must be a non-empty list of schemas; check each."""
    subschemas = schema[key]
    if not isinstance(subschemas, list) or not subschemas:
        raise GrammarError(f"{key} must be a non-empty list - at `{path}.{key}`")
    for i, sub in enumerate(subschemas):
        _check(sub, f"{path}.{key}[{i}]", root, depth + 1)


def _check_array(schema: dict[str, Any], path: str, root: dict[str, Any], depth: int) -> None:
    if "prefixItems" in schema:
        others = sorted(set(schema) & {"items", "minItems", "maxItems"})
        if others:
            raise GrammarError(f"prefixItems cannot be combined with {', '.join(others)} "
                               f"- at `{path}`")
        _check_each(schema, "prefixItems", path, root, depth)
        return
    if "items" not in schema:
        if "minItems" in schema or "maxItems" in schema:
            raise GrammarError(f"minItems and maxItems need items - at `{path}`")
        return
    if isinstance(schema["items"], list):
        raise GrammarError(f"items must be a schema (use prefixItems for tuples) "
                           f"- at `{path}.items`")
    _check(schema["items"], f"{path}.items", root, depth + 1)
    _check_bounds(schema, path, "minItems", "maxItems")


def _check_string(schema: dict[str, Any], path: str) -> None:
    present = sorted(set(schema) & _STRING_KEYWORDS)
    groups = [bool(set(present) & {"minLength", "maxLength"}), "pattern" in present,
              "format" in present]
    if sum(groups) > 1:
        raise GrammarError(f"{', '.join(present)} cannot be combined - at `{path}`")
    _check_bounds(schema, path, "minLength", "maxLength")
    if "format" in schema and schema["format"] not in STRING_FORMATS:
        raise GrammarError(f"unsupported string format {schema['format']!r} (supported: "
                           f"{', '.join(sorted(STRING_FORMATS))}) - at `{path}.format`")
    if "pattern" in schema:
        pattern = schema["pattern"]
        if not isinstance(pattern, str) or not (pattern.startswith("^")
                                                and pattern.endswith("$")):
            raise GrammarError(f"pattern must be anchored (start with ^ and end with $) "
                               f"- at `{path}.pattern`")
        _check_pattern(pattern[1:-1], f"{path}.pattern")


# Regex escapes the converter turns into the plain character (outside brackets).
_PATTERN_ESCAPES: Final = frozenset("()[]{}|*+?")
# Characters a JSON string may not hold raw: a pattern that can produce one would make
# the converter's grammar write invalid JSON.
_JSON_UNSAFE: Final = frozenset('"\\\x7f') | frozenset(map(chr, range(0x20)))


def _check_pattern(body: str, path: str) -> None:
    """Accept what converts to GBNF that stays inside a JSON string: literals, positive
    [classes] and ranges, groups, alternatives and quantifiers; no `.`, no [^negated]
    class, no character a JSON string must escape."""
    i = 0
    while i < len(body):
        char = body[i]
        if char == "\\":
            escaped = body[i + 1:i + 2]
            if escaped not in _PATTERN_ESCAPES or not escaped:
                raise GrammarError(f"pattern escape {body[i:i + 2]!r} is not supported (write "
                                   f"a class such as [0-9] or [.]) - at `{path}`")
            i += 2
            continue
        if char == "[":
            end = body.find("]", i + 1)
            if end < 0:
                raise GrammarError(f"unbalanced [ in pattern - at `{path}`")
            members = body[i + 1:end]
            if members.startswith("^") or "\\" in members or not members:
                raise GrammarError(f"pattern class [{members}] is not supported (no negated "
                                   f"classes, no escapes inside brackets) - at `{path}`")
            low = 0
            while low < len(members):
                if low + 2 < len(members) and members[low + 1] == "-":
                    first, last = ord(members[low]), ord(members[low + 2])
                    low += 3
                else:
                    first = last = ord(members[low])
                    low += 1
                if any(first <= ord(unsafe) <= last for unsafe in _JSON_UNSAFE):
                    raise GrammarError(f"pattern class [{members}] includes characters a JSON "
                                       f"string must escape - at `{path}`")
            i = end + 1
            continue
        if char == ".":
            raise GrammarError(f"pattern '.' is not supported (write a class such as "
                               f"[a-zA-Z0-9 ]) - at `{path}`")
        if char == "(" and body[i + 1:i + 2] == "?":
            raise GrammarError(f"pattern groups with (? are not supported - at `{path}`")
        if char in _JSON_UNSAFE:
            raise GrammarError(f"pattern character {char!r} must be escaped in JSON and is "
                               f"not supported - at `{path}`")
        i += 1

_module_cache: list[Any] = []


def _converter_module() -> Any:
    """llama-cpp-python's `llama_grammar` module, imported on first use.

    It needs only the standard library; `llama_c` has registered the package without
    running its `__init__` (numpy, the high-level Llama), and importing the submodule by
    its full name keeps it that way.
    """
    if not _module_cache:
        _module_cache.append(importlib.import_module("llama_cpp.llama_grammar"))
    return _module_cache[0]


_class_cache: list[Any] = []


def _converter_class() -> Any:
    if _class_cache:
        return _class_cache[0]
    module = _converter_module()

    class Converter(module.SchemaConverter):  # type: ignore[misc,name-defined]
        """The stock converter with two fixes: literals escape backslashes (enum values
        such as "a\\\\b" broke the grammar), and string characters follow JSON (no raw
        control characters, no lone surrogate escapes)."""

        def _format_literal(self, literal: str) -> str:
            escaped = (literal.replace("\\", "\\\\").replace('"', '\\"')
                       .replace("\r", "\\r").replace("\n", "\\n"))
            return f'"{escaped}"'

        def _generate_constant_rule(self, value: Any) -> str:
            # Non-ASCII text as itself rather than as \\u escapes: the form a model writes.
            return self._format_literal(json.dumps(value, ensure_ascii=False))

        def _add_primitive(self, name: str, rule: Any) -> Any:
            if name == "char":
                rule = module.BuiltinRule(_CHAR_RULE, [])
            return super()._add_primitive(name, rule)

    _class_cache.append(Converter)
    return Converter


# --- GBNF text --------------------------------------------------------------------------


def check_gbnf(text: str) -> None:
    """Refuse grammar text llama.cpp's recursive parser should not be handed."""
    if "\x00" in text:
        raise GrammarError("grammar contains a NUL character - at `$.grammar`")
    depth = 0
    for token in _gbnf_groups(text):
        depth += 1 if token == "(" else -1
        if depth > MAX_GRAMMAR_NESTING:
            raise GrammarError(f"grammar nests groups deeper than {MAX_GRAMMAR_NESTING} "
                               "- at `$.grammar`")


_GBNF_SKIP = re.compile(r'"(?:[^"\\]|\\.)*"?|\[(?:[^\]\\]|\\.)*\]?|#[^\n]*|[^"\[#()]+',
                        re.DOTALL)


def _gbnf_groups(text: str) -> Iterator[str]:
    """The parentheses of GBNF text, outside literals, character classes and comments."""
    pos = 0
    while pos < len(text):
        char = text[pos]
        if char in "()":
            yield char
            pos += 1
            continue
        match = _GBNF_SKIP.match(text, pos)
        pos = match.end() if match and match.end() > pos else pos + 1


def _split_parse_error(captured: str, text: str) -> tuple[str, str]:
    """(llama.cpp's reason, everything else) from what was printed to fd 2 while a grammar
    was parsed. llama.cpp prints "parse: error parsing grammar: REASON\n\nGRAMMAR\n",
    REASON itself running on to the end of the grammar text."""
    marker = "error parsing grammar: "
    start = captured.find(marker)
    if start < 0:
        return "", captured
    reason = captured[start + len(marker):].split("\n", 1)[0].strip()
    if len(reason) > 200:
        reason = reason[:200] + "..."
    block_start = captured.rfind("\n", 0, start) + 1
    block_end = captured.find("\n\n" + text + "\n", start)
    block_end = len(captured) if block_end < 0 else block_end + len(text) + 3
    return reason, captured[:block_start] + captured[block_end:]


@contextlib.contextmanager
def _stderr_captured() -> Iterator[list[str]]:
    """Collect what C code writes to fd 2 meanwhile (llama.cpp prints grammar parse
    errors there, with the whole grammar, not through its log callback)."""
    out: list[str] = []
    try:
        sink = os.memfd_create("sfcore-grammar-errors")
    except OSError:
        yield out
        return
    saved = os.dup(2)
    try:
        os.dup2(sink, 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
        os.lseek(sink, 0, os.SEEK_SET)
        chunks = []
        while chunk := os.read(sink, 1 << 16):
            chunks.append(chunk)
        out.append(b"".join(chunks).decode("utf-8", errors="replace"))
    finally:
        os.close(saved)
        os.close(sink)


# --- the sampler ------------------------------------------------------------------------

_token_data_p = ctypes.POINTER(C.llama_token_data)
_ids_cache: dict[int, bytes] = {}


def _id_template(n_vocab: int) -> bytes:
    """llama_token_data[n_vocab] holding ids 0..n-1 (logits and p zero), as bytes."""
    template = _ids_cache.get(n_vocab)
    if template is None:
        raw = bytearray(ctypes.sizeof(C.llama_token_data) * n_vocab)
        memoryview(raw).cast("i")[0::3] = memoryview(array.array("i", range(n_vocab)))
        template = _ids_cache[n_vocab] = bytes(raw)
    return template


_EMPTY: Final[memoryview[Any]] = memoryview(b"")


class GrammarSampler:
    """One request's grammar, and the fast path around the request's sampler chain.

    Created on the event loop; from then on used by the decode thread only, which frees
    it when the job ends. A sampler that never reached the decode thread is freed when
    it is collected.
    """

    __slots__ = ("_grammar", "_one", "_one_array", "_history", "_penalties", "_top",
                 "_raw", "_array", "_floats", "_ids", "n_vocab", "tokens", "resampled",
                 "full_passes")

    def __init__(self, grammar: Any, n_vocab: int, history: Iterable[int],
                 history_len: int) -> None:
        self._grammar = grammar
        self.n_vocab = n_vocab
        self._one = C.llama_token_data(0, 0.0, 0.0)
        self._one_array = C.llama_token_data_array(
            ctypes.pointer(self._one), 1, -1, False)
        # The repeat penalty's view of the past (prompt tail, then accepted tokens): the
        # chain has already recorded a token the grammar rejects, and this rebuilds it.
        self._history: deque[int] = deque(history, maxlen=history_len)
        self._penalties: Any = None
        self._top: list[Any] | None = None
        self._raw: bytearray | None = None
        self._array: Any = None
        self._floats: memoryview[Any] = _EMPTY
        self._ids: memoryview[Any] = _EMPTY
        # Tokens sampled and those that needed the slow path, read by the loop at the end.
        self.tokens = 0
        self.resampled = 0
        self.full_passes = 0

    @classmethod
    def create(cls, engine: Engine, text: str, field: str, prompt: list[int]) -> GrammarSampler:
        """Compile `text` (from the request's `field`) for `engine`'s vocabulary;
        GrammarError with llama.cpp's reason if it does not parse. Event loop only (it
        reads the vocabulary)."""
        from .engine import _PENALTY_LAST_N, _router

        encoded = text.encode("utf-8")
        with engine._using_vocab(), _router.capturing_errors() as errors, \
                _stderr_captured() as printed:
            grammar = C.llama_sampler_init_grammar(engine._vocab, encoded, b"root")
        reason, rest = _split_parse_error("".join(printed), text)
        if rest:  # someone else's output, written while fd 2 was redirected
            os.write(2, rest.encode("utf-8", errors="replace"))
        if not grammar:
            reason = reason or (errors[0] if errors else "llama.cpp refused it")
            source = "the grammar" if field == "grammar" else "the grammar made from it"
            raise GrammarError(f"{source} does not parse: {reason} - at `$.{field}`")
        _id_template(engine.info.n_vocab)  # built once, here rather than mid-generation
        return cls(grammar, engine.info.n_vocab, prompt[-_PENALTY_LAST_N:], _PENALTY_LAST_N)

    def sample(self, chain: Any, ctx: Any, idx: int) -> int:
        """The next token: the chain's choice when the grammar allows it, else a draw
        from the tokens the grammar allows. Decode thread only."""
        token: int = C.llama_sampler_sample(chain, ctx, idx)
        one: Any = self._one
        grammar = self._grammar
        one.id = token
        one.logit = 0.0
        array = self._one_array
        array.size = 1
        array.selected = -1
        C.llama_sampler_apply(grammar, ctypes.byref(array))
        self.tokens += 1
        if one.logit != -math.inf:
            C.llama_sampler_accept(grammar, token)
            self._history.append(token)
            return token
        self.resampled += 1
        return self._resample(chain, ctx, idx)

    def _resample(self, chain: Any, ctx: Any, idx: int) -> int:
        """The slow path: mask what the grammar rejects, then run the chain again.

        A grammar pass costs about 0.2 us per candidate token where the grammar expects
        structure, and up to 6 us inside a JSON string (each token's text is walked
        through the grammar): 50 ms to 1.5 s over this model's 262,144 tokens, against
        15 ms for a decode step. So the pass covers the most likely tokens first, in
        growing tiers (RESAMPLE_TIERS), and the whole vocabulary only when the grammar
        allows none of those; the draw is then among the allowed tokens of that tier.
        """
        if self._top is None:
            self._top = [C.llama_sampler_init_top_k(n) for n in RESAMPLE_TIERS]
        for top in self._top:
            array, floats = self._candidates(ctx, idx)
            C.llama_sampler_apply(top, ctypes.byref(array))
            C.llama_sampler_apply(self._grammar, ctypes.byref(array))
            if max(floats[1:3 * array.size:3]) != -math.inf:
                break
        else:
            self.full_passes += 1
            array, floats = self._candidates(ctx, idx)
            C.llama_sampler_apply(self._grammar, ctypes.byref(array))
        # top_k trusts a sorted flag and would cut the masked array as it stands.
        array.sorted = False
        self._restore_penalties(chain)
        C.llama_sampler_apply(chain, ctypes.byref(array))
        selected = array.selected
        if not 0 <= selected < array.size or floats[3 * selected + 1] == -math.inf:
            raise RuntimeError("the grammar allows no token here")
        token: int = self._ids[3 * selected]
        C.llama_sampler_accept(chain, token)
        C.llama_sampler_accept(self._grammar, token)
        self._history.append(token)
        return token

    def _candidates(self, ctx: Any, idx: int) -> tuple[Any, memoryview]:
        """Every token with its logit, as llama_sampler_sample builds them, at C speed:
        one copy of the ids, then the logits' bytes into their strided slots (measured
        1.5-3 ms for 262,144 tokens; a Python loop would take 100 ms)."""
        n = self.n_vocab
        if self._raw is None:
            self._raw = bytearray(_id_template(n))
            buffer = (C.llama_token_data * n).from_buffer(self._raw)
            self._array = C.llama_token_data_array(
                ctypes.cast(buffer, _token_data_p), n, -1, False)
            self._floats = memoryview(self._raw).cast("f")
            self._ids = memoryview(self._raw).cast("i")
        else:
            self._raw[:] = _id_template(n)
        raw, array = self._raw, self._array
        logits = ctypes.string_at(C.llama_get_logits_ith(ctx, idx), 4 * n)
        stride = ctypes.sizeof(C.llama_token_data)
        for byte in range(4):
            raw[4 + byte::stride] = logits[byte::4]
        array.size = n
        array.selected = -1
        array.sorted = False
        return array, self._floats

    def _restore_penalties(self, chain: Any) -> None:
        penalties = self._penalties
        if penalties is None:
            penalties = False
            for i in range(C.llama_sampler_chain_n(chain)):
                sampler = C.llama_sampler_chain_get(chain, i)
                if C.llama_sampler_name(sampler) == b"penalties":
                    penalties = sampler
                    break
            self._penalties = penalties
        if penalties is False:
            return
        C.llama_sampler_reset(penalties)
        for token in self._history:
            C.llama_sampler_accept(penalties, token)

    def free(self) -> None:
        grammar, self._grammar = self._grammar, None
        if grammar:
            C.llama_sampler_free(grammar)
        for top in self._top or ():
            C.llama_sampler_free(top)
        self._top = None
        # The 3 MB candidate buffer goes now, not when the job is collected.
        self._floats = self._ids = _EMPTY
        self._raw = self._array = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit C may be gone
            self.free()
