"""Admission: a generate or chat request becomes a queued `Generation`, or is refused.

`Admission.admit` is the one way in, whatever front end decoded the request: it takes
the request, the sink its reply goes to and the time it arrived, and goes down in
order, cheap checks before costly work: a queue that is surely full, the
grammar the request asks for (checked and compiled), the prompt (a chat rendered
through its template), its tokens (off the event loop when long, or when tools are
rendered), whether the client is still there after each costly step, the
GrammarSampler, the sampling settings with their defaults, max_tokens clipped to the
room the prompt leaves, and the scheduler. A request that cannot run raises `Refused`,
which the front end answers as an error line in the request's place.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeVar

import msgspec

from sfcore_daemon.core import errors, tools
from sfcore_daemon.core.cachemarks import segment_cuts
from sfcore_daemon.core.chat import ChatTemplateError
from sfcore_daemon.core.generation import Generation, ReplySink
from sfcore_daemon.core.request import ChatRequest, GenerateRequest, GenerationRequest
from sfcore_daemon.core.scheduler import QueueFull
from sfcore_daemon.core.state import ServerState
from sfcore_daemon.engine.thread import Engine
from sfcore_daemon.llama.model import EngineClosed
from sfcore_daemon.llama.sampling import SEED_MODULUS, Sampling, draw_seed
from sfcore_daemon.structured.compiler import compile_json_object, compile_schema
from sfcore_daemon.structured.gbnfcheck import check_gbnf
from sfcore_daemon.structured.grammar import GrammarError, GrammarSampler
from sfcore_daemon.structured.lenient import relax_tool_schema
from sfcore_daemon.structured.shape import Shape

log = logging.getLogger(__name__)

# Prompts above this size are tokenized off the event loop (about a millisecond of C work).
_INLINE_TOKENIZE_BYTES = 32 * 1024

_T = TypeVar("_T")
# (tokens, seconds) for each cache mark (engine/crossing.py JobSpec.pins).
Pins = tuple[tuple[int, int], ...]


class Refused(Exception):
    """The request cannot run; answered with an error line (its outcome is counted)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ClientSink(ReplySink, Protocol):
    """A reply sink as admission needs it: it can tell that its client has left, and
    it is told which generation writes into it (so the client's leaving or a cancel
    can reach it) before that generation is queued."""

    @property
    def gone(self) -> bool: ...

    def attach(self, generation: Generation) -> None: ...


class GrammarSpec(NamedTuple):
    """What a request's output is held to: GBNF text, the field it came from, and for a
    JSON document the shape budget-aware closing completes (None for a GBNF grammar).
    With a `trigger`, the grammar holds the output only from the end of that text on
    (an "auto" tool call); before it the output is free."""

    text: str
    field: str
    shape: Shape | None
    trigger: bytes | None = None


def request_grammar(request: GenerationRequest, native_tools: bool = False,
                    ) -> GrammarSpec | None:
    """The grammar a request asks for, or None when the request is unconstrained.
    `native_tools`: the chat template renders tools itself (tools.plan)."""
    given = [name for name in ("json_schema", "format", "grammar")
             if getattr(request, name) is not None]
    if isinstance(request, ChatRequest) and request.tools:
        given.append("tools")
    if len(given) > 1:
        raise GrammarError(f"json_schema, format, grammar and tools exclude each other; "
                           f"this request gives {' and '.join(given)}")
    if isinstance(request, ChatRequest) and (
            request.tools or request.tool_choice not in (None, "none", "auto")):
        return _tools_grammar(request, native_tools)
    if request.json_schema is not None:
        compiled = compile_schema(request.json_schema)
        return GrammarSpec(compiled.gbnf, "json_schema", compiled.shape)
    if request.format is not None:
        compiled = compile_json_object()
        return GrammarSpec(compiled.gbnf, "format", compiled.shape)
    if request.grammar is not None:
        check_gbnf(request.grammar)
        return GrammarSpec(request.grammar, "grammar", None)
    return None


def _tools_grammar(request: ChatRequest, native: bool) -> GrammarSpec | None:
    """The grammar of the calls a chat with tools may make (tools.py), or None. Each
    tool's parameters are relaxed first (structured/lenient.py): agents' validators
    use keywords the grammar does not enforce."""
    if request.tools:
        request = msgspec.structs.replace(request, tools=[
            _relaxed(tool, index) for index, tool in enumerate(request.tools)])
    tool_plan = tools.plan(request, native)
    if tool_plan is None:
        return None
    compiled = compile_schema(tool_plan.schema)
    return GrammarSpec(compiled.gbnf, "tools", compiled.shape,
                       None if tool_plan.forced else tools.CALL_MARKER.encode())


def _relaxed(tool: Any, index: int) -> Any:
    """`tool` with its parameters relaxed and checked (GrammarError naming the place)."""
    if not tool.function.parameters:
        return tool
    parameters, dropped = relax_tool_schema(tool.function.parameters)
    if dropped:
        log.debug("tool %r: not enforced in its calls: %s", tool.function.name,
                  ", ".join(dropped))
        tool = msgspec.structs.replace(tool, function=msgspec.structs.replace(
            tool.function, parameters=parameters))
    try:
        compile_schema(tool.function.parameters)
    except GrammarError as exc:
        raise GrammarError(str(exc).replace(
            "`$.json_schema", f"`$.tools[{index}].function.parameters")) from None
    return tool


class Admission:
    """Turns generation requests into queued generations; event loop only."""

    def __init__(self, state: ServerState) -> None:
        self._state = state

    async def admit(self, request: GenerationRequest, sink: ClientSink,
                    arrived_ns: int) -> Generation | None:
        """Queue `request` (or start it) with its reply going to `sink`.

        Returns its generation: queued, running, or already answered `queue_full`
        (counted as a generation that failed). None when the client left meanwhile
        (counted as cancelled; nothing is written). Raises Refused for a request
        that cannot run, counted as an error outcome; the caller writes the error.
        """
        state = self._state
        request_id = request.id
        assert request_id is not None
        # Capacity first: a request the queue would refuse costs no compile or render.
        # (Draining is each front end's check, right before this call.)
        if state.scheduler is not None and state.scheduler.surely_full():
            raise self._refused(errors.QUEUE_FULL, self._queue_full_message())
        try:
            # Checking and converting take about a millisecond per 2 KB of grammar (a
            # second for a schema of a megabyte): a worker thread, unless it is small.
            template = state.chat_template
            native = template is not None and template.tool_renderer is not None
            spec = (await asyncio.to_thread(request_grammar, request, native)
                    if _long_grammar(request) else request_grammar(request, native))
            engine = await state.loaded_engine()
            if sink.gone:  # left during the compile or the load: render nothing for it
                state.stats.by_outcome["cancelled"] += 1
                return None
            prompt, pins = await self._prompt(engine, request, with_pins=True)
            grammar = (GrammarSampler.create(engine.loaded_model(), spec.text, spec.field,
                                             prompt, state.config.server.grammar_budget_s,
                                             shape=spec.shape)
                       if spec is not None else None)
        except (ChatTemplateError, GrammarError) as exc:
            raise self._refused(errors.INVALID_REQUEST, str(exc)) from None
        except EngineClosed:
            raise self._refused(errors.SHUTTING_DOWN, "the daemon is shutting down") from None
        if len(prompt) >= engine.n_ctx:
            raise self._refused(
                errors.CONTEXT_OVERFLOW,
                f"the prompt is {len(prompt)} tokens and the context holds {engine.n_ctx} "
                "(model.n_ctx); no room is left for a reply")
        if sink.gone:
            state.stats.by_outcome["cancelled"] += 1
            return None
        if state.draining:
            raise self._refused(errors.SHUTTING_DOWN, "the daemon is shutting down")
        scheduler = state.scheduler
        assert scheduler is not None
        defaults = state.config.generation
        temperature = _pick(request.temperature, defaults.temperature)
        seed = request.seed
        if seed is None and temperature > 0:
            seed = draw_seed()
        generation = Generation(
            request_id=request_id,
            stream=request.stream,
            stops=request.stop_sequences,
            prompt=prompt,
            sampling=Sampling(
                temperature=temperature,
                top_k=_pick(request.top_k, defaults.top_k),
                top_p=_pick(request.top_p, defaults.top_p),
                min_p=_pick(request.min_p, defaults.min_p),
                repeat_penalty=_pick(request.repeat_penalty, defaults.repeat_penalty),
                seed=seed % SEED_MODULUS if seed is not None else None,
                drawn_seed=request.seed is None,
                frequency_penalty=request.frequency_penalty or 0.0,
                presence_penalty=request.presence_penalty or 0.0,
            ),
            # Clipped to the room the prompt leaves, so the scheduler can reserve it.
            max_tokens=min(_pick(request.max_tokens, defaults.max_tokens),
                           engine.n_ctx - len(prompt)),
            cache_prompt=request.cache_prompt,
            sink=sink,
            arrived_ns=arrived_ns,
            loop=asyncio.get_running_loop(),
            stats=state.stats,
            grammar=grammar,
            # Drafts are verified a run at a time: a grammar that starts holding the
            # output inside a run (an "auto" call) would find tokens drawn without it.
            speculative=(request.speculative and state.speculates
                         and (spec is None or spec.trigger is None)),
            logprobs=request.logprobs,
            grammar_trigger=spec.trigger if spec is not None else None,
            calls=(tools.MarkerSplit(forced=spec.trigger is None)
                   if spec is not None and spec.field == "tools" else None),
            pins=pins,
            cache_key=request.prompt_cache_key if isinstance(request, ChatRequest) else None,
            model_fingerprint=engine.reply_fingerprint,
            priority=request.priority,
        )
        sink.attach(generation)
        try:
            scheduler.submit(generation)
        except QueueFull:
            # Answered through the generation, so it is counted as one that failed.
            generation.fail(errors.QUEUE_FULL, self._queue_full_message())
        return generation

    async def prompt_tokens(self, request: ChatRequest) -> int:
        """How many tokens `request`'s prompt is, rendered and tokenized as `admit`
        would (template, tools, a forced call's opening): a request's count without
        its generation. Refused for a request `admit` would refuse before generating."""
        state = self._state
        try:
            template = state.chat_template
            native = template is not None and template.tool_renderer is not None
            if _long_grammar(request):
                await asyncio.to_thread(request_grammar, request, native)
            else:
                request_grammar(request, native)
            engine = await state.loaded_engine()
            return len((await self._prompt(engine, request))[0])
        except (ChatTemplateError, GrammarError) as exc:
            raise Refused(errors.INVALID_REQUEST, str(exc)) from None
        except EngineClosed:
            raise Refused(errors.SHUTTING_DOWN, "the daemon is shutting down") from None

    def _queue_full_message(self) -> str:
        scheduler = self._state.scheduler
        assert scheduler is not None
        return (f"every slot is busy and {scheduler.queue_depth} requests are waiting "
                "(server.max_queue)")

    def _refused(self, code: str, message: str) -> Refused:
        self._state.stats.by_outcome["error"] += 1
        return Refused(code, message)

    async def _prompt(self, engine: Engine, request: GenerationRequest, with_pins: bool = False
                      ) -> tuple[list[int], Pins]:
        """The request's prompt tokens, and `with_pins` where its cache marks end in them
        (JobSpec.pins); ChatTemplateError if a chat cannot be rendered."""
        if isinstance(request, GenerateRequest):
            return await off_loop_if_long(len(request.prompt), engine.tokenize,
                                          request.prompt), ()
        marks = request.cache_marks if with_pins else None
        if marks and max(mark.message for mark in marks) >= len(request.messages):
            raise ChatTemplateError(
                f"a cache mark names message {max(mark.message for mark in marks)}; the "
                f"request has {len(request.messages)} - at `$.cache_marks`")
        template = self._state.chat_template
        if template is None:
            raise ChatTemplateError(
                f"chat needs a chat template: the model ({engine.info.architecture}) has none "
                "of its own and model.chat_template names none (set it to a llama.cpp "
                "built-in name such as \"chatml\", or to a Jinja template)")
        native = template.tool_renderer is not None
        with_tools = tools.uses_tools(request)

        def build() -> tuple[list[int], Pins]:
            tool_plan = tools.plan(request, native) if request.tools else None
            # "required" or a named function: the answer starts as the call, so the
            # marker is the prompt's last text (content: never a special token).
            forced = tool_plan is not None and tool_plan.forced
            opening = [(tools.CALL_MARKER + "\n", True)] if forced else []
            ends: list[int] = []
            origins = list(range(len(request.messages)))
            if native and with_tools:
                messages, extras, definitions = tools.native_render(request, tool_plan)
                segments = template.render(messages, extras, definitions, ends)
            else:
                if with_tools:
                    origins = []
                    messages = tools.render(request, tool_plan, origins)
                else:
                    messages = [(message.role, message.content) for message in request.messages]
                segments = template.render(messages, None, None, ends)
            tokens = engine.tokenize_segments([*segments, *opening])
            if not marks:
                return tokens, ()
            cuts = segment_cuts(marks, origins, [role for role, _ in messages], ends, segments)
            # Each segment is tokenized alone: a prefix of them is a prefix of the tokens.
            pins: dict[int, int] = {}
            for cut, ttl in sorted(cuts.items()):
                n = len(engine.tokenize_segments(segments[:cut]))
                if 0 < n <= len(tokens):
                    pins[n] = max(pins.get(n, 0), ttl)
            return tokens, tuple(pins.items())

        # Tool definitions (up to a megabyte) are planned and rendered with the chat:
        # never on the event loop, whatever the messages' size.
        if with_tools:
            return await asyncio.to_thread(build)
        return await off_loop_if_long(
            sum(len(message.content) for message in request.messages), build)


def _pick(value: _T | None, default: _T) -> _T:
    return default if value is None else value


def _long_grammar(request: GenerationRequest) -> bool:
    """Whether checking the request's grammar may take more than about a millisecond (a
    schema's grammar is not known before it is converted: taken as long)."""
    return (request.json_schema is not None or len(request.grammar or "") > 2048
            or (isinstance(request, ChatRequest) and bool(request.tools)))


async def off_loop_if_long(size: int, function: Callable[..., _T], *args: Any) -> _T:
    """Run a tokenizer call inline, or in a worker thread when `size` (bytes of text)
    would keep the event loop busy for more than about a millisecond."""
    if size > _INLINE_TOKENIZE_BYTES:
        return await asyncio.to_thread(function, *args)
    return function(*args)
