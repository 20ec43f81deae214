"""`sfcore`: the sfcore-ai daemon from a terminal.

Exit status: 0 ok, 1 the daemon answered with an error line, 2 usage, 3 daemon unreachable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from ._common import Result, SfcoreConnectionError, SfcoreError
from .client import Client, Stream

EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE = 1, 2, 3


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--socket", metavar="PATH",
                        help="daemon socket (default: $SFCORE_SOCKET, else /tmp/sfcore-ai.sock)")
    common.add_argument("--json", action="store_true", help="print the raw reply lines")
    sampling = argparse.ArgumentParser(add_help=False)
    sampling.add_argument("--max-tokens", type=int, metavar="N")
    sampling.add_argument("--temperature", type=float, metavar="T")
    sampling.add_argument("--seed", type=int, metavar="N")
    sampling.add_argument("--stop", action="append", metavar="TEXT",
                          help="stop sequence (repeatable)")
    sampling.add_argument("--system", metavar="TEXT", help="system message (chat only)")

    parser = argparse.ArgumentParser(prog="sfcore", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate = commands.add_parser("generate", parents=[common, sampling],
                                   help="complete a prompt, streaming as tokens arrive")
    generate.add_argument("prompt", nargs="?", default=None,
                          help="the prompt; '-' or omitted with a pipe: read stdin")
    commands.add_parser("chat", parents=[common, sampling],
                        help="interactive multi-turn chat (one message per line from a pipe)")
    for name, text in (("health", "is the daemon up"), ("info", "model and config"),
                       ("stats", "counters since start")):
        commands.add_parser(name, parents=[common], help=text)
    tokenize = commands.add_parser("tokenize", parents=[common], help="text to token ids")
    tokenize.add_argument("text")
    detokenize = commands.add_parser("detokenize", parents=[common], help="token ids to text")
    detokenize.add_argument("tokens", nargs="+", type=int)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        with Client(args.socket, timeout=None) as client:
            return _run(client, args)
    except SfcoreConnectionError as exc:
        print(f"sfcore: {exc.message}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except SfcoreError as exc:
        print(f"sfcore: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    except _UsageError as exc:
        print(f"sfcore: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `sfcore generate ... | head`
        return 0


class _UsageError(Exception):
    pass


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_tokens": args.max_tokens, "temperature": args.temperature,
            "seed": args.seed, "stop": args.stop}


def _run(client: Client, args: argparse.Namespace) -> int:
    match args.command:
        case "generate":
            return _generate(client, args)
        case "chat":
            return _chat(client, args)
        case "health" | "info" | "stats":
            reply = getattr(client, args.command)()
            print(json.dumps(reply, ensure_ascii=False) if args.json else _readable(reply))
        case "tokenize":
            tokens = client.tokenize(args.text)
            print(json.dumps(tokens) if args.json else " ".join(map(str, tokens)))
        case "detokenize":
            text = client.detokenize(args.tokens)
            print(json.dumps(text, ensure_ascii=False) if args.json else text)
    return 0


def _generate(client: Client, args: argparse.Namespace) -> int:
    if args.system is not None:
        raise _UsageError("--system applies to `sfcore chat`; generate takes a raw prompt")
    prompt = args.prompt
    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
        prompt = sys.stdin.read()
    if not prompt:
        raise _UsageError("no prompt (give one, or pipe it on stdin)")
    stream = client.stream_generate(prompt, **_options(args))
    _print_stream(stream, args.json, sys.stdout)
    if not args.json:
        print()
    return 0


def _print_stream(stream: Stream, raw: bool, out: TextIO) -> None:
    for piece in stream:
        if raw:
            out.write(json.dumps({"type": "token", "id": stream.id, "text": piece},
                                 ensure_ascii=False) + "\n")
        else:
            out.write(piece)
        out.flush()
    if raw and stream.result is not None:
        out.write(json.dumps(_done_line(stream.result), ensure_ascii=False) + "\n")


def _done_line(result: Result) -> dict[str, Any]:
    return {"type": "done", "id": result.id, "text": "", "finish_reason": result.finish_reason,
            "stop_sequence": result.stop_sequence, "usage": vars_of(result.usage),
            "timings": vars_of(result.timings)}


def vars_of(value: Any) -> dict[str, Any]:
    return {name: getattr(value, name) for name in value.__slots__}


def _chat(client: Client, args: argparse.Namespace) -> int:
    interactive = sys.stdin.isatty()
    dim = interactive and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict[str, str]] = list(system)
    if interactive:
        print("sfcore chat: Ctrl-C stops an answer, Ctrl-D or /exit leaves, /reset starts over.")
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except EOFError:
            line = ""
        except KeyboardInterrupt:
            print()
            continue
        if not line:  # Ctrl-D or end of the pipe
            if interactive:
                print()
            return 0
        message = line.rstrip("\n")
        if message.strip() in ("/exit", "/quit"):
            return 0
        if message.strip() == "/reset":
            history = list(system)
            print("(conversation cleared)")
            continue
        if not message.strip():
            continue
        history.append({"role": "user", "content": message})
        stream = client.stream_chat(history, **_options(args))
        try:
            _print_stream(stream, args.json, sys.stdout)
        except KeyboardInterrupt:
            # Cancel on the daemon and drain; the connection stays usable.
            stream.close()
            print(" [cancelled]", end="")
        result = stream.result
        text = result.text if result is not None else ""
        # The partial answer of a cancelled turn stays in the history: the model
        # then knows what it already said, and the cache still holds it.
        history.append({"role": "assistant", "content": text})
        if not args.json:
            print()
            if result is not None:
                _print_figures(result, dim)
    return 0


def _print_figures(result: Result, dim: bool) -> None:
    usage, timings = result.usage, result.timings
    line = (f"[{usage.completion_tokens} tokens, {timings.decode_tok_s:.1f} tok/s, "
            f"cached {usage.cached_tokens}/{usage.prompt_tokens} prompt tokens, "
            f"first token {timings.first_token_ms:.0f} ms, {result.finish_reason}]")
    print(f"\x1b[2m{line}\x1b[0m" if dim else line, flush=True)


def _readable(reply: dict[str, Any], indent: str = "") -> str:
    lines = []
    for key, value in reply.items():
        if key in ("type", "id"):
            continue
        if isinstance(value, dict):
            lines.append(f"{indent}{key}:")
            lines.append(_readable(value, indent + "  "))
        elif isinstance(value, list):
            lines.append(f"{indent}{key}: {', '.join(map(str, value))}")
        else:
            lines.append(f"{indent}{key}: {value}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
