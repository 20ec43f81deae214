"""The model zoo in one sitting: a few speed figures on each of several GGUF models, the
daemon against llama-server, both at their own defaults, in one table
(docs/performance/zoo.md, "The zoo section").

The models: `--zoo-models` (names of `~/.cache/sfcore-ai/zoo/NAME.gguf`, or paths; by
default every `*.gguf` there), the bench's `--model`, and `--zoo-real` paths. A missing
file is skipped with a line on stderr.

On each model, in each of `--runs` rounds (sides one right after the other, their order
alternating by round):

- first token: FIRST_TOKEN_PROMPTS short prompts (new ones every round), each sent to
  both sides in turn (which goes first alternating), each after FIRST_TOKEN_PAUSE_S of
  idle time, one token, greedy, `cache_prompt: false`, no
  streaming, timed client-side from the request's send to its reply; the round's figure
  is their median.
- decode, one client: a raw opening of the prompt corpus's `free` kind (new every round)
  continued for `--tokens` tokens, greedy: the daemon's `timings.decode_tok_s`,
  llama-server's `timings.predicted_per_second`.
- aggregate, 4 and 8 clients: N distinct chat questions of the corpus (as chat turns in
  the model's template) sent at once, `--tokens` greedy tokens each: the completion
  tokens of all over the time from the first send to the last reply (the concurrency
  section's measure). The daemon has `[server] slots = N`, llama-server `-np N`.

The daemon runs with its defaults and the bench's threads (`[model] n_ctx = 0` unless
`--n-ctx`), llama-server with its own (only the model, address, threads and, for the
aggregate rows, `-np`). Each is started once per model and client count and reused
across rounds. Without `--llama-server` only the daemon's figures are shown.

    .venv/bin/python scripts/bench.py zoo --llama-server PATH [--zoo-models a,b]
        [--zoo-real PATH[,PATH]] [--runs 2] [--tokens 128] [--corpus-split held-out]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import math
import re
import statistics
import struct
import time
from pathlib import Path
from typing import Any

from zoo import ggufio  # scripts/zoo: the zoo's GGUF reader and writer

from benchkit import corpus
from benchkit.common import TIMEOUT_S, chat_turn_renderer, log
from benchkit.context import Bench
from benchkit.daemon import Daemon, Stream
from benchkit.peers import GREEDY_SERVER, LlamaServer, peer_paths
from benchkit.sections.concurrency import CLIENT_PROMPTS, ClientPrompts, daemon_aggregate
from benchkit.table import print_head, row

HELP = ("several GGUF models (the zoo) in one table: first token, decode, 4 and 8 clients, "
        "daemon against llama-server (both at their defaults)")
DEFAULTS = {"runs": 2, "tokens": 128, "n_ctx": 0}
ZOO_DIR = Path.home() / ".cache" / "sfcore-ai" / "zoo"
# Six a side a round: with three, one slow reply moved a round's median by a tenth.
FIRST_TOKEN_PROMPTS = 6
# Idle time before each first-token request, as a person reading the last answer leaves:
# a request after a pause pays what a busy one does not (sharing-the-machine.md).
FIRST_TOKEN_PAUSE_S = 1.0
TOPICS = ("rivers", "bridges", "lanterns", "gardens", "winter", "harbors", "compasses",
          "libraries", "orbits", "deserts", "forests", "markets")
CLIENT_ROWS = (4, 8)
WARM_UP_PROMPT = "The weather today is"
WARM_UP_TOKENS = 8
SIDES = ("daemon", "llama-server")
# (key, column label, unit, higher is better): a round's ratio is daemon / server for a
# rate and server / daemon for a time, so above 1 always means the daemon was ahead.
FIGURES = (("first_token_ms", "first token", "ms", False),
           ("decode_tok_s", "decode, 1 client", "tok/s", True),
           *((f"clients_{n}_tok_s", f"{n} clients", "tok/s", True) for n in CLIENT_ROWS))
# llama.cpp's llama_ftype (general.file_type), the quantization a file is named after.
FTYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
          10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
          16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 25: "IQ4_NL", 30: "IQ4_XS", 32: "BF16"}


def add_arguments(parser: argparse._ArgumentGroup) -> None:
    parser.add_argument("--zoo-models", metavar="NAMES",
                        help="zoo: comma-separated model names (~/.cache/sfcore-ai/zoo/"
                             "NAME.gguf) or paths (default: every *.gguf there)")
    parser.add_argument("--zoo-real", metavar="PATHS",
                        help="zoo: comma-separated paths of real models to add")


def check(args: argparse.Namespace) -> list[str]:
    return peer_paths(llama_server=args.llama_server)


# --- the models ---------------------------------------------------------------------------


def model_paths(zoo_models: str | None, zoo_real: str | None, bench_model: str
                ) -> list[Path]:
    """The models that exist, each once, in order; a line on stderr for each that does not."""
    if zoo_models:
        named = [ZOO_DIR / f"{name}.gguf" if "/" not in name and not name.endswith(".gguf")
                 else Path(name).expanduser()
                 for name in (part.strip() for part in zoo_models.split(",")) if name]
    else:
        named = sorted(ZOO_DIR.glob("*.gguf"))
    real = [Path(part.strip()).expanduser() for part in (zoo_real or "").split(",")
            if part.strip()]
    found: dict[Path, Path] = {}
    for path in [*named, Path(bench_model), *real]:
        if not path.is_file():
            log(f"[zoo] skipped {path}: no such file")
            continue
        found.setdefault(path.resolve(), path)
    return list(found.values())


def model_facts(path: Path) -> str:
    """The table's "arch, params, vocab, quant" of a model, from its GGUF header, else
    guessed from its file name."""
    try:
        kv, elements = ggufio.read_summary(path)
        shape = json.loads(kv["zoo.shape"]) if "zoo.shape" in kv else {}
        ftype = int(kv.get("general.file_type", -1))
        quant = shape.get("quant") or FTYPES.get(ftype, f"ftype {ftype}" if ftype >= 0 else "?")
        vocab = kv.get("tokenizer.ggml.tokens")
        return (f"{kv.get('general.architecture', '?')}, {elements / 1e9:.2f}B, "
                f"{f'{vocab:,}' if vocab else '?'}, {quant}")
    except (OSError, ValueError, KeyError, struct.error) as error:
        log(f"[zoo] {path.name}: the GGUF header did not read ({error}); facts from its name")
    stem = path.stem.lower()
    size = re.search(r"(\d+(?:\.\d+)?[bm])\b", stem)
    quant_name = re.search(r"(i?q\d_[a-z0-9_]+|bf16|f16|f32)", stem)
    return (f"{stem.split('-')[0]}, {size.group(1).upper() if size else '?'}, ?, "
            f"{quant_name.group(1).upper() if quant_name else '?'}")


# --- one side's requests ------------------------------------------------------------------


async def daemon_request(stream: Stream, prompt: str, tokens: int) -> tuple[float, dict[str, Any]]:
    """One greedy cold request, no streaming: the client's ms from send to reply, and the
    `done` line."""
    timed = await stream.timed({"prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
                                "cache_prompt": False, "stream": False}, TIMEOUT_S)
    if timed.final["type"] != "done":
        raise RuntimeError(f"daemon answered {timed.final}"[:500])
    return (timed.ended - timed.started) * 1e3, timed.final


def server_request(server: LlamaServer, prompt: str, tokens: int
                   ) -> tuple[float, dict[str, Any]]:
    """The same request to llama-server's `/completion`, on a connection made before the
    clock starts: the client's ms from send to reply, and the reply."""
    body = json.dumps({"prompt": prompt, "n_predict": tokens, "cache_prompt": False,
                       "stream": False, **GREEDY_SERVER})
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT_S)
    try:
        connection.connect()
        started = time.perf_counter()
        connection.request("POST", "/completion", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()
        elapsed_ms = (time.perf_counter() - started) * 1e3
    finally:
        connection.close()
    if response.status != 200:
        raise RuntimeError(f"llama-server answered {response.status}: {data[:300]!r}")
    reply: dict[str, Any] = json.loads(data)
    return elapsed_ms, reply


def first_token_prompts(round_index: int) -> list[str]:
    numbers = range(round_index * FIRST_TOKEN_PROMPTS, (round_index + 1) * FIRST_TOKEN_PROMPTS)
    return [f"Write one sentence about {TOPICS[n % len(TOPICS)]} number {n + 1}."
            for n in numbers]


def order(round_index: int, sides: list[str]) -> list[str]:
    return sides if round_index % 2 == 0 else sides[::-1]


# --- the phases: one client, then N clients -----------------------------------------------


Samples = dict[str, dict[str, list[Any]]]


async def single_client(params: dict[str, Any], binary: str | None, openings: list[str],
                        rounds: int, *, name: str, samples: Samples) -> None:
    """First token and decode, every round, on one daemon and one llama-server."""
    daemon = await Daemon.start(params)
    server: LlamaServer | None = None
    stream: Stream | None = None
    try:
        stream = await Stream.open(daemon.socket_path, TIMEOUT_S)
        if binary:
            server = await asyncio.to_thread(LlamaServer.start, binary,
                                             {**params, "llama_server_kv": "default"}, 1)
        # First-touch costs (pages, buffers) fall on an unmeasured request on each side.
        await daemon_request(stream, WARM_UP_PROMPT, WARM_UP_TOKENS)
        if server is not None:
            await asyncio.to_thread(server_request, server, WARM_UP_PROMPT, WARM_UP_TOKENS)
        sides = [*SIDES] if server is not None else ["daemon"]
        for index in range(rounds):
            times: dict[str, list[float]] = {side: [] for side in sides}
            # Prompt by prompt, the sides alternating: a drift of the machine's pace over
            # the round falls on both alike.
            for number, prompt in enumerate(first_token_prompts(index)):
                for side in order(index + number, sides):
                    await asyncio.sleep(FIRST_TOKEN_PAUSE_S)
                    if side == "daemon":
                        ms, _ = await daemon_request(stream, prompt, 1)
                    else:
                        assert server is not None
                        ms, _ = await asyncio.to_thread(server_request, server, prompt, 1)
                    times[side].append(ms)
            for side in sides:
                samples["first_token_all_ms"][side].append(times[side])
                samples["first_token_ms"][side].append(statistics.median(times[side]))
            log(f"[zoo] {name}, round {index + 1}/{rounds}, first token: " + ", ".join(
                f"{side} {samples['first_token_ms'][side][-1]:.1f} ms" for side in sides))
            opening = openings[index % len(openings)]
            for side in order(index, sides):
                if side == "daemon":
                    _, done = await daemon_request(stream, opening, params["tokens"])
                    rate = float(done["timings"]["decode_tok_s"])
                    tokens = int(done["usage"]["completion_tokens"])
                else:
                    assert server is not None
                    _, reply = await asyncio.to_thread(server_request, server, opening,
                                                       params["tokens"])
                    rate = float(reply["timings"]["predicted_per_second"])
                    tokens = int(reply["tokens_predicted"])
                samples["decode_tok_s"][side].append(rate)
                samples["decode_tokens"][side].append(tokens)
            log(f"[zoo] {name}, round {index + 1}/{rounds}, decode: " + ", ".join(
                f"{side} {samples['decode_tok_s'][side][-1]:.1f} tok/s "
                f"({samples['decode_tokens'][side][-1]} tokens)" for side in sides))
    finally:
        if stream is not None:
            await stream.close()
        if server is not None:
            await asyncio.to_thread(server.stop)
        await daemon.stop()


async def many_clients(params: dict[str, Any], binary: str | None, clients: int,
                       prompts: list[list[str]], *, name: str, samples: Samples) -> None:
    """The aggregate of `clients` at once, every round (its prompts in `prompts`), on a
    daemon with that many slots and llama-server with `-np` that many."""
    daemon = await Daemon.start({**params, "slots": clients})
    server: LlamaServer | None = None
    key = f"clients_{clients}_tok_s"
    try:
        if binary:
            server = await asyncio.to_thread(
                LlamaServer.start, binary, {**params, "llama_server_kv": "default"}, clients,
                ["-np", str(clients)])
        await daemon_aggregate(daemon.socket_path, [WARM_UP_PROMPT], WARM_UP_TOKENS)
        if server is not None:
            await asyncio.to_thread(server.completion, WARM_UP_PROMPT, WARM_UP_TOKENS)
        sides = [*SIDES] if server is not None else ["daemon"]
        for index, texts in enumerate(prompts):
            for side in order(index, sides):
                if side == "daemon":
                    rate = await daemon_aggregate(daemon.socket_path, texts, params["tokens"])
                else:
                    assert server is not None
                    rate = await asyncio.to_thread(server.aggregate, texts, params["tokens"])
                samples[key][side].append(rate)
            log(f"[zoo] {name}, round {index + 1}/{len(prompts)}, {clients} clients: "
                + ", ".join(f"{side} {samples[key][side][-1]:.1f} tok/s" for side in sides))
    finally:
        if server is not None:
            await asyncio.to_thread(server.stop)
        await daemon.stop()


def measure_model(bench: Bench, path: Path, openings: list[str]) -> dict[str, Any]:
    """Every figure of one model; a phase that fails is logged and kept as an error, so
    the sitting goes on with the next."""
    name = path.stem
    params = {**bench.params, "model": str(path), "tokens": bench.args.tokens}
    keys = ["first_token_ms", "first_token_all_ms", "decode_tok_s", "decode_tokens",
            *(f"clients_{n}_tok_s" for n in CLIENT_ROWS)]
    samples: Samples = {key: {side: [] for side in SIDES} for key in keys}
    errors: dict[str, str] = {}
    facts = model_facts(path)
    log(f"[zoo] {name} ({facts}): {bench.runs} rounds ...")
    phases: list[tuple[str, Any]] = [("single", lambda: single_client(
        params, bench.llama_server, openings, bench.runs, name=name, samples=samples))]
    try:
        chat = ClientPrompts(bench.args.corpus_split,
                             None if bench.args.corpus_split == "builtin"
                             else chat_turn_renderer(str(path)))
        for clients in CLIENT_ROWS:
            rows = [chat.take(clients) for _ in range(bench.runs)]
            phases.append((f"clients_{clients}", lambda clients=clients, rows=rows: (
                many_clients(params, bench.llama_server, clients, rows, name=name,
                             samples=samples))))
    except (RuntimeError, OSError, ValueError) as error:
        errors["prompts"] = str(error)[:500]
        log(f"[zoo] {name}: no chat prompts ({error})")
    for phase, make in phases:
        try:
            bench.runner(make())
        except (RuntimeError, OSError, TimeoutError, KeyError, ValueError) as error:
            errors[phase] = f"{type(error).__name__}: {error}"[:500]
            log(f"[zoo] {name}, {phase} failed: {errors[phase]}")
    return {"path": str(path), "facts": facts, "samples": samples, "errors": errors}


# --- the table ----------------------------------------------------------------------------


def figure_stats(samples: Samples, key: str, higher: bool) -> dict[str, float]:
    """The sides' medians over rounds and the median of the rounds' ratios (nan where a
    side has none)."""
    daemon, server = samples[key]["daemon"], samples[key]["llama-server"]
    ratios = [(d / s if higher else s / d) for d, s in zip(daemon, server, strict=False)
              if d and s]
    return {"daemon": statistics.median(daemon) if daemon else math.nan,
            "llama-server": statistics.median(server) if server else math.nan,
            "ratio": statistics.median(ratios) if ratios else math.nan}


def shown(stats: dict[str, float], failed: bool) -> str:
    if math.isnan(stats["daemon"]):
        return "failed" if failed else "-"
    if math.isnan(stats["llama-server"]):
        return f"{stats['daemon']:.1f} / -"
    return f"{stats['daemon']:.1f} / {stats['llama-server']:.1f} ({stats['ratio']:.2f})"


def print_table(models: dict[str, dict[str, Any]], bench: Bench) -> list[dict[str, Any]]:
    n_ctx = bench.params["n_ctx"] or "sized from the model"
    print(f"Model zoo: the daemon (its defaults, n_ctx {n_ctx}) against llama-server (its "
          f"defaults), greedy, {bench.args.tokens} decode tokens, medians of "
          f"{bench.runs} rounds: {bench.header}")
    print("\nEach cell: daemon / llama-server (the median of the rounds' ratios, above 1: the "
          "daemon ahead; first token: server/daemon, rates: daemon/server).\n")
    print_head("model", "arch, params, vocab, quant", *(
        f"{label} {unit}, daemon / server ({'daemon/server' if higher else 'server/daemon'})"
        for _, label, unit, higher in FIGURES))
    for name, model in models.items():
        failed = bool(model["errors"])
        print(row(name, model["facts"], *(shown(model["medians"][key], failed)
                                          for key, *_ in FIGURES)))
    errors = [f"{name}: {phase}: {text}" for name, model in models.items()
              for phase, text in model["errors"].items()]
    if errors:
        print("\nFailed: " + "; ".join(errors))
    decode = [model["samples"]["decode_tokens"] for model in models.values()]
    short = sorted({n for sides in decode for runs in sides.values() for n in runs
                    if n < bench.args.tokens})
    if short:
        print(f"\nSome decode replies ended before {bench.args.tokens} tokens (end of "
              f"generation): {short}")
    targets = [("decode_tok_s", "decode 1 client >= 1.0x llama-server"),
               *((f"clients_{n}_tok_s", f"decode {n} clients (aggregate) >= 1.0x "
                  "llama-server") for n in CLIENT_ROWS),
               ("first_token_ms", "first token no slower than llama-server")]
    results = []
    print()
    for key, label in targets:
        measured = [name for name, model in models.items()
                    if not math.isnan(model["medians"][key]["ratio"])]
        met = [name for name in measured if models[name]["medians"][key]["ratio"] >= 1.0]
        missed = [name for name in measured if name not in met]
        print(f"- {label}: {len(met)} of {len(measured)} models"
              + (f" (not: {', '.join(missed)})" if missed else ""))
        results.append({"target": label, "met": met, "missed": missed})
    return results


def run(bench: Bench) -> dict[str, Any]:
    args = bench.args
    paths = model_paths(args.zoo_models, args.zoo_real, bench.params["model"])
    if not paths:
        raise RuntimeError("no model to run: none of the zoo's models exists")
    openings = (list(CLIENT_PROMPTS) if args.corpus_split == "builtin" else
                [prompt.text for prompt in corpus.load(["free"], split=args.corpus_split)])
    if not openings:
        raise RuntimeError(f"the corpus's {args.corpus_split} split has no free openings")
    log(f"[zoo] {len(paths)} models: {', '.join(path.stem for path in paths)}; "
        f"{'daemon and llama-server' if bench.llama_server else 'daemon only'}")
    models: dict[str, dict[str, Any]] = {}
    for path in paths:
        name = path.stem if path.stem not in models else str(path)
        model = measure_model(bench, path, openings)
        model["medians"] = {key: figure_stats(model["samples"], key, higher)
                            for key, _, _, higher in FIGURES}
        models[name] = model
    targets = print_table(models, bench)
    return {"models": models, "targets": targets, "corpus_split": args.corpus_split}
