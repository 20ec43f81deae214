"""Chat templates: which one applies, and rendering messages into prompt segments.

A rendered chat prompt mixes two kinds of text: the template's own markup (turn
markers such as `<start_of_turn>`, which must become special tokens) and the
messages' content (which must stay text, so a user who types `<end_of_turn>` cannot
forge a turn). Rendering therefore returns segments tagged with their kind; the
engine tokenizes markup with special-token parsing on and content with it off.

The template, first match wins: the model's own `tokenizer.chat_template` (Jinja),
else `[model] chat_template` (a llama.cpp built-in name, or a Jinja text), else the
built-in matching the model's architecture. Built-ins render through llama.cpp's
`llama_chat_apply_template`; Jinja through jinja2's sandbox, imported only when a
Jinja template is actually used.
"""

from __future__ import annotations

import ctypes
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sfcore_daemon.llama.capi import C

log = logging.getLogger(__name__)

# role, content
ChatMessage = tuple[str, str]
# text, is_content
Segment = tuple[str, bool]

# Architectures whose chat format llama.cpp has a built-in for, when the model file
# carries no template of its own (general.architecture -> built-in name).
_BUILTIN_FOR_ARCHITECTURE = {
    "gemma": "gemma",
    "gemma2": "gemma",
    "gemma3": "gemma",
    "gemma3n": "gemma",
    "phi3": "phi3",
    "qwen2": "chatml",
    "qwen3": "chatml",
}

# Stands in for message i while the template's own markup is located; private-use
# code points with no surrounding whitespace survive the usual `trim` of content.
_PLACEHOLDER = "\ue000{}\ue001"
_PLACEHOLDER_RE = re.compile("\ue000(\\d+)\ue001")
# What templates commonly do to content; the first that reproduces the real
# rendering is applied to each message's content.
_CONTENT_TRANSFORMS: tuple[Callable[[str], str], ...] = (
    lambda text: text, str.strip, str.lstrip, str.rstrip)


class ChatTemplateError(Exception):
    """The request cannot be rendered (no template, or the template refused it)."""


class TemplateBudgetError(ChatTemplateError):
    """A Jinja template rendered past its time or size budget (core/sandbox.py)."""


# A plain conversation every template must render within the budget at start-up.
_SAMPLE_CHAT: tuple[ChatMessage, ...] = (
    ("system", "You are a helpful assistant."), ("user", "Hello!"),
    ("assistant", "Hi! How can I help?"), ("user", "What is 2 + 2?"))
_SAMPLE_TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}}}}}]


def builtin_template_names() -> frozenset[str]:
    count = C.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * count)()
    C.llama_chat_builtin_templates(names, count)
    return frozenset(name.decode() for name in names if name)


# A Jinja template that renders tools itself: (messages, each message's other fields
# (tool_calls, tool_call_id), the tools) -> text.
ToolRenderer = Callable[[Sequence[ChatMessage], Sequence[dict[str, Any]], list[dict[str, Any]]],
                        str]


@dataclass(frozen=True)
class ChatTemplate:
    # "model" (the GGUF's own), a built-in name, or "jinja" (configured text).
    label: str
    render_text: Callable[[Sequence[ChatMessage]], str]
    # Set for a Jinja template that takes `tools` and writes calls as `<tool_call>`
    # blocks (the Hermes format: Qwen, Hermes and others): tools.py renders through it.
    tool_renderer: ToolRenderer | None = None

    def render(self, messages: Sequence[ChatMessage],
               extras: Sequence[dict[str, Any]] | None = None,
               tools: list[dict[str, Any]] | None = None,
               ends: list[int] | None = None) -> list[Segment]:
        """Render `messages` followed by the opening of the assistant's turn; with
        `tools`, through the template's own tool rendering (`extras`: each message's
        tool_calls or tool_call_id). Calls and tool definitions are the template's
        markup; message content stays content. `ends`, if given, is filled with each
        message's end: the number of segments up to its text's end (-1: not rendered)."""
        render_text = self.render_text
        tool_renderer = self.tool_renderer
        if tools is not None and tool_renderer is not None:
            fields = list(extras or [{} for _ in messages])
            definitions = tools

            def render_text(chat: Sequence[ChatMessage]) -> str:
                return tool_renderer(chat, fields, definitions)

        placeholders = [(role, _PLACEHOLDER.format(i)) for i, (role, _) in enumerate(messages)]
        skeleton = render_text(placeholders)
        real = render_text(messages)
        parts = _PLACEHOLDER_RE.split(skeleton)
        # parts: markup, index, markup, index, ..., markup
        found = [-1] * len(messages)
        for transform in _CONTENT_TRANSFORMS:
            segments = _fill(parts, messages, transform, found)
            if "".join(text for text, _ in segments) == real:
                break
        else:
            # The template rewrites content in some other way: keep the markup it
            # produced and the content as sent, which is always safe.
            segments = _fill(parts, messages, _CONTENT_TRANSFORMS[0], found)
        if ends is not None:
            ends[:] = found
        return segments


def _fill(parts: list[str], messages: Sequence[ChatMessage],
          transform: Callable[[str], str], ends: list[int]) -> list[Segment]:
    segments: list[Segment] = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            if part:
                segments.append((part, False))
        else:
            index = int(part)
            content = transform(messages[index][1])
            if content:
                segments.append((content, True))
            ends[index] = len(segments)
    return segments


def resolve_template(
    *,
    model_template: str | None,
    configured: str,
    architecture: str,
    bos_token: str,
    eos_token: str,
) -> ChatTemplate | None:
    """The template `chat` uses for this model, or None when no template applies.

    A configured template that does not parse raises ChatTemplateError (a config
    mistake, reported at startup); a broken template inside the model file is
    logged and passed over.
    """
    builtins = builtin_template_names()
    if model_template:
        try:
            return _checked(ChatTemplate(
                "model", *_jinja_renderers(model_template, bos_token, eos_token)))
        except TemplateBudgetError:
            raise
        except ChatTemplateError as exc:
            log.warning("ignoring the model's own chat template: %s", exc)
    if configured:
        if configured in builtins:
            return ChatTemplate(configured, _builtin_renderer(configured))
        return _checked(ChatTemplate("jinja",
                                     *_jinja_renderers(configured, bos_token, eos_token)))
    for prefix_len in (len(architecture), *range(len(architecture) - 1, 0, -1)):
        name = _BUILTIN_FOR_ARCHITECTURE.get(architecture[:prefix_len])
        if name is not None and name in builtins:
            return ChatTemplate(name, _builtin_renderer(name))
    return None


def _checked(template: ChatTemplate) -> ChatTemplate:
    """`template`, once it has rendered a plain chat (and, if it renders tools, a chat with
    one tool) within the budget: TemplateBudgetError otherwise. A template that refuses
    the sample (a system turn, say) is not the budget's business."""
    samples: list[Callable[[], object]] = [lambda: template.render(_SAMPLE_CHAT)]
    if template.tool_renderer is not None:
        samples.append(lambda: template.render(_SAMPLE_CHAT, None, _SAMPLE_TOOLS))
    for sample in samples:
        try:
            sample()
        except TemplateBudgetError:
            raise
        except ChatTemplateError:
            pass
    return template


def _builtin_renderer(name: str) -> Callable[[Sequence[ChatMessage]], str]:
    template_name = name.encode()

    def render(messages: Sequence[ChatMessage]) -> str:
        # Keep the encoded strings alive while C reads them.
        encoded = [(role.encode(), content.encode()) for role, content in messages]
        chat = (C.llama_chat_message * len(encoded))(
            *(C.llama_chat_message(role, content) for role, content in encoded))
        size = 2 * sum(len(role) + len(content) for role, content in encoded) + 256
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = C.llama_chat_apply_template(template_name, chat, len(encoded), True, buf, size)
            if n < 0:
                raise ChatTemplateError(f"llama.cpp's {name!r} template refused these messages")
            if n <= size:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = n
        raise ChatTemplateError(f"llama.cpp's {name!r} template output kept growing")

    return render


def takes_tools(source: str) -> bool:
    """Whether a Jinja template renders `tools` and writes calls in `<tool_call>` blocks,
    the one call format tools.py reads (others get the generic format)."""
    return "tools" in source and "<tool_call>" in source


def _jinja_renderers(source: str, bos_token: str, eos_token: str,
                     ) -> tuple[Callable[[Sequence[ChatMessage]], str], ToolRenderer | None]:
    # jinja2 only when a Jinja template is in use: never on the startup path otherwise.
    import jinja2

    from sfcore_daemon.core import sandbox

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"the chat template refused the messages: {message}")

    # trim_blocks/lstrip_blocks as Hugging Face renders these templates.
    environment = sandbox.BudgetedSandbox(
        trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    environment.globals["raise_exception"] = raise_exception
    try:
        template = environment.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not parse: {exc}") from None

    def render(messages: Sequence[ChatMessage]) -> str:
        # `tools` as Hugging Face passes it when there are none: templates test it.
        return render_context({
            "messages": sandbox.BudgetedList(
                {"role": role, "content": content} for role, content in messages),
            "tools": None})

    def render_tools(messages: Sequence[ChatMessage], extras: Sequence[dict[str, Any]],
                     tools: list[dict[str, Any]]) -> str:
        return render_context({
            "messages": sandbox.BudgetedList(
                {"role": role, "content": content, **fields}
                for (role, content), fields in zip(messages, extras, strict=True)),
            "tools": sandbox.BudgetedList(tools)})

    def render_context(fields: dict[str, Any]) -> str:
        context: dict[str, Any] = {
            **fields,
            "add_generation_prompt": True,
            "bos_token": bos_token,
            "eos_token": eos_token,
        }
        try:
            return sandbox.render(template, context)
        except sandbox.TemplateBudgetExceeded as exc:
            raise TemplateBudgetError(f"the chat template went past its budget: {exc}") from None
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from None
        except Exception as exc:  # a template may index, divide or compare anything
            raise ChatTemplateError(
                f"the chat template failed: {type(exc).__name__}: {exc}") from None

    return render, render_tools if takes_tools(source) else None
