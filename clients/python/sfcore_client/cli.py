"""sfcore: talk to the sfcore-ai daemon from a terminal.

Exit status: 0 ok, 1 the daemon answered with an error, 2 usage, 3 daemon unreachable
(or the connection broke, or no reply within --timeout), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from types import FrameType
from typing import Any, TextIO

from ._common import (
    DEFAULT_SOCKET,
    Result,
    SfcoreConnectionError,
    SfcoreError,
    generation_request,
)
from .client import Client, Stream

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
HELP_CHAT = "commands: /reset starts over, /exit (or Ctrl-D) leaves; Ctrl-C stops an answer"


class UsageError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--socket", metavar="PATH",
                        help=f"daemon socket (default: $SFCORE_SOCKET, else {DEFAULT_SOCKET})")
    common.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                        help="give up when no reply line comes for this long (default 120)")
    common.add_argument("--json", action="store_true",
                        help="print the daemon's reply lines (NDJSON) instead")
    sampling = argparse.ArgumentParser(add_help=False)
    sampling.add_argument("--max-tokens", type=int, metavar="N")
    sampling.add_argument("--temperature", type=float, metavar="T", help="0 is greedy")
    sampling.add_argument("--top-k", type=int, metavar="K")
    sampling.add_argument("--top-p", type=float, metavar="P")
    sampling.add_argument("--min-p", type=float, metavar="P")
    sampling.add_argument("--repeat-penalty", type=float, metavar="X")
    sampling.add_argument("--seed", type=int, metavar="N")
    sampling.add_argument("--stop", action="append", metavar="TEXT",
                          help="stop before this text (repeatable)")
    sampling.add_argument("--no-cache", dest="cache_prompt", action="store_const",
                          const=False, help="evaluate the prompt afresh (cache_prompt=false)")
    sampling.add_argument("--system", metavar="TEXT",
                          help="system message (chat only; generate rejects it)")
    structured = sampling.add_mutually_exclusive_group()
    structured.add_argument("--json-schema", metavar="FILE",
                            help="the output is a JSON document valid against this JSON "
                                 "Schema (a file; '-' reads stdin)")
    structured.add_argument("--format", choices=["json"],
                            help="json: the output is a JSON object")
    structured.add_argument("--grammar", metavar="FILE",
                            help="the output matches this GBNF grammar (a file; '-' reads "
                                 "stdin)")
    sampling.add_argument("-v", "--verbose", action="store_true",
                          help="generate: print token counts and speed to stderr at the end")

    # argparse reports usage mistakes itself: usage line, one error line, exit status 2.
    parser = argparse.ArgumentParser(prog="sfcore", description=(__doc__ or "").split("\n\n", 1)[0],
                     epilog=(__doc__ or "").split("\n\n", 1)[-1])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate = commands.add_parser(
        "generate", parents=[common, sampling], help="complete a prompt, streaming the text",
        description="Complete PROMPT, printing the text as it is generated.")
    generate.add_argument("prompt", nargs="?", metavar="PROMPT",
                          help="the prompt; '-', or nothing with stdin a pipe: read stdin "
                               "(one trailing newline dropped)")
    commands.add_parser(
        "chat", parents=[common, sampling], help="multi-turn chat",
        description="Interactive multi-turn chat. " + HELP_CHAT + ". With stdin not a "
                    "terminal, each line of stdin is one user message.")
    for name, text in (("health", "is the daemon up, is it busy"),
                       ("info", "model, effective config, versions"),
                       ("stats", "counters since the daemon started")):
        command = commands.add_parser(name, parents=[common], help=text, description=text)
        if name == "stats":
            command.add_argument("--prometheus", action="store_true",
                                 help="print them in Prometheus' text format (for "
                                      "node_exporter's textfile collector)")
    cache = commands.add_parser(
        "cache", parents=[common], help="the prompts the daemon keeps (list or clear)",
        description="List the prompt prefixes the daemon keeps in RAM and on disk to "
                    "restore instead of evaluating again, most recently used first.")
    cache.add_argument("--clear", action="store_true",
                       help="forget them all first (RAM and this model's files)")
    tokenize = commands.add_parser("tokenize", parents=[common], help="text to token ids")
    tokenize.add_argument("text", metavar="TEXT", help="'-' reads stdin")
    tokenize.add_argument("--no-special", dest="add_special", action="store_false",
                          help="do not add the BOS token")
    detokenize = commands.add_parser("detokenize", parents=[common], help="token ids to text")
    detokenize.add_argument("tokens", nargs="+", type=int, metavar="ID")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.timeout is not None and args.timeout <= 0:
            raise UsageError("--timeout must be positive")
        if args.command in ("generate", "chat"):
            # Files named by flags are read (and a bad one reported) before connecting.
            args.options = _options(args)
        with Client(args.socket, timeout=args.timeout) as client:
            return _run(client, args)
    except UsageError as exc:
        print(f"sfcore: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SfcoreConnectionError as exc:
        print(f"sfcore: {exc.message}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except SfcoreError as exc:
        print(f"sfcore: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `sfcore generate ... | head`: stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


def _run(client: Client, args: argparse.Namespace) -> int:
    match args.command:
        case "generate":
            return _generate(client, args)
        case "chat":
            return _chat(client, args)
        case "stats" if args.prometheus:
            sys.stdout.write(client.metrics())
        case "health" | "info" | "stats":
            reply = getattr(client, args.command)()
            print(_json(reply) if args.json else _readable(reply))
        case "cache":
            reply = client.cache(clear=args.clear)
            print(_json(reply) if args.json else _cache_table(reply))
        case "tokenize":
            text = _read_stdin() if args.text == "-" else args.text
            tokens = client.tokenize(text, add_special=args.add_special)
            print(json.dumps(tokens) if args.json else " ".join(map(str, tokens)))
        case "detokenize":
            text = client.detokenize(args.tokens)
            print(json.dumps(text, ensure_ascii=False) if args.json else text)
    return EXIT_OK


def _options(args: argparse.Namespace) -> dict[str, Any]:
    if "-" in (args.json_schema, args.grammar):
        if args.command == "chat":
            raise UsageError("chat reads its messages from stdin: give the schema or "
                             "grammar as a file")
        if args.prompt in ("-", None):
            raise UsageError("stdin is the schema or grammar here: give the prompt as an "
                             "argument")
    return {"max_tokens": args.max_tokens, "temperature": args.temperature,
            "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
            "repeat_penalty": args.repeat_penalty, "seed": args.seed, "stop": args.stop,
            "cache_prompt": args.cache_prompt, "format": args.format,
            "json_schema": _json_schema(args.json_schema), "grammar": _grammar(args.grammar)}


def _read_file(flag: str, path: str) -> str:
    """The text of a flag's FILE argument ('-': stdin); a usage error if unreadable."""
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except OSError as exc:
        raise UsageError(f"{flag} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{flag} {path}: not UTF-8 text") from None


def _json_schema(path: str | None) -> Any:
    if path is None:
        return None
    text = _read_file("--json-schema", path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--json-schema {path}: not JSON: {exc}") from None


def _grammar(path: str | None) -> str | None:
    return None if path is None else _read_file("--grammar", path)


def _json(reply: Any) -> str:
    return json.dumps(reply, ensure_ascii=False, separators=(",", ":"))


def _read_stdin() -> str:
    text = sys.stdin.read()
    return text.removesuffix("\n").removesuffix("\r")


# --- generate ---

def _generate(client: Client, args: argparse.Namespace) -> int:
    if args.system is not None:
        raise UsageError("--system is for `sfcore chat`; generate takes a raw prompt")
    prompt = args.prompt
    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
        prompt = _read_stdin()
    if prompt is None:
        raise UsageError("no prompt: give one, or pipe it on stdin")
    if not prompt:
        raise UsageError("the prompt is empty")
    request = generation_request("generate", "prompt", prompt, True, args.options)
    out = sys.stdout
    text, result, interrupted = _stream(client.request(request), args.json, out)
    if not args.json and not text.endswith("\n"):
        out.write("\n")
    out.flush()
    if args.verbose and result is not None:
        _print_figures(result, sys.stderr)
    if interrupted:
        print("sfcore: cancelled", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK


def _stream(stream: Stream[dict[str, Any]], raw: bool, out: TextIO) -> tuple[str, Result | None,
                                                                              bool]:
    """Print a reply as it arrives; the first Ctrl-C cancels it (the rest still prints),
    a second one interrupts. Returns (text, result, interrupted)."""
    parts: list[str] = []
    with _cancel_on_ctrl_c(stream.cancel) as interrupted:
        try:
            for line in stream:
                token = line["type"] == "token"
                if token:
                    parts.append(line["text"])
                if raw:
                    out.write(_json(line) + "\n")
                elif token:
                    out.write(line["text"])
                out.flush()
        except SfcoreError as exc:
            if raw and exc.reply is not None:
                out.write(_json(exc.reply) + "\n")
                out.flush()
            raise
    return "".join(parts), stream.result, bool(interrupted)


@contextmanager
def _cancel_on_ctrl_c(cancel: Callable[[], None]) -> Iterator[list[bool]]:
    """While active, Ctrl-C calls `cancel` (no exception in the middle of a read); a
    second Ctrl-C raises KeyboardInterrupt. Yields a list that is non-empty once hit."""
    hits: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield hits
        return

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        if hits:
            raise KeyboardInterrupt
        hits.append(True)
        cancel()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield hits
    finally:
        signal.signal(signal.SIGINT, previous)


def _print_figures(result: Result, out: TextIO) -> None:
    usage, timings = result.usage, result.timings
    line = (f"[{usage.completion_tokens} tokens, {timings.decode_tok_s:.1f} tok/s, "
            f"cached {usage.cached_tokens}/{usage.prompt_tokens} prompt tokens, "
            f"first token {timings.first_token_ms:.0f} ms, {result.finish_reason}]")
    dim = out.isatty() and not os.environ.get("NO_COLOR")
    out.write(f"\x1b[2m{line}\x1b[0m\n" if dim else line + "\n")
    out.flush()


# --- chat ---

def _chat(client: Client, args: argparse.Namespace) -> int:
    interactive = sys.stdin.isatty()
    if interactive:
        with suppress(ImportError):
            import readline  # noqa: F401  (line editing and history for input())
        print(f"sfcore chat ({HELP_CHAT})", file=sys.stderr)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = list(system)
    options = args.options
    out = sys.stdout
    while True:
        line = _read_message(interactive)
        if line is None:
            return EXIT_OK
        message = line.strip()
        if message in ("/exit", "/quit"):
            return EXIT_OK
        if message == "/reset":
            history = list(system)
            print("(conversation cleared)", file=sys.stderr)
            continue
        if message in ("/help", "/?"):
            print(HELP_CHAT, file=sys.stderr)
            continue
        if not message:
            continue
        history.append({"role": "user", "content": line})
        request = generation_request("chat", "messages", history, True, options)
        try:
            text, result, interrupted = _stream(client.request(request), args.json, out)
        except SfcoreError as exc:
            if not interactive:
                raise
            # At a terminal an error ends the turn, not the session (the next turn
            # reconnects if the connection was lost).
            history.pop()
            out.write("\n")
            out.flush()
            print(f"sfcore: {exc.message}" if isinstance(exc, SfcoreConnectionError)
                  else f"sfcore: {exc.code}: {exc.message}", file=sys.stderr)
            if exc.code == "context_overflow":
                print("(the conversation no longer fits the context: /reset starts over)",
                      file=sys.stderr)
            continue
        if interrupted and not args.json:
            out.write(" [cancelled]")
        if not args.json:
            out.write("\n")
        out.flush()
        if interrupted and not text:
            history.pop()  # stopped before a word: as if it had not been asked
        else:
            # A stopped answer stays as far as it was shown: the model then knows what
            # it already said, and the daemon's cache still holds it.
            history.append({"role": "assistant", "content": text})
        if result is not None and not args.json:
            _print_figures(result, sys.stderr)


def _read_message(interactive: bool) -> str | None:
    """The next user message, or None to leave (Ctrl-D, end of input)."""
    if not interactive:
        line = sys.stdin.readline()
        return line.removesuffix("\n") if line else None
    while True:
        try:
            return input("> ")
        except EOFError:
            print()
            return None
        except KeyboardInterrupt:  # at the prompt: drop the line, ask again
            print("^C")


def _cache_table(reply: dict[str, Any]) -> str:
    if not reply["enabled"]:
        return "the prompt store is off ([cache] enabled = false, or reproducible mode)"
    lines = []
    if reply["removed_states"] or reply["removed_files"]:
        lines.append(f"cleared: {reply['removed_states']} states, {reply['removed_files']} "
                     f"files ({reply['removed_bytes'] / 1e6:.1f} MB)")
    states = reply["states"]
    lines.append(f"{len(states)} states; files in {reply['dir'] or '(no disk tier)'}")
    if states:
        lines.append(f"{'tokens':>7} {'MB':>7}  {'kept in':<8}  text")
        for state in states:
            where = "+".join(tier for tier in ("ram", "disk") if state[tier])
            lines.append(f"{state['tokens']:>7} {state['bytes'] / 1e6:>7.1f}  {where:<8}  "
                         f"{json.dumps(state['preview'], ensure_ascii=False)}")
    return "\n".join(lines)


def _readable(reply: dict[str, Any], indent: str = "") -> str:
    lines = []
    for key, value in reply.items():
        if not indent and key in ("type", "id"):
            continue
        if isinstance(value, dict):
            lines.append(f"{indent}{key}:")
            lines.append(_readable(value, indent + "  "))
        elif isinstance(value, list):
            lines.append(f"{indent}{key}: {', '.join(map(str, value))}")
        elif isinstance(value, bool):
            lines.append(f"{indent}{key}: {'yes' if value else 'no'}")
        elif isinstance(value, float):
            lines.append(f"{indent}{key}: {round(value, 3)}")
        else:
            lines.append(f"{indent}{key}: {value}")
    return "\n".join(lines)

if __name__ == "__main__":
    sys.exit(main())
