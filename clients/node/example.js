#!/usr/bin/env node
// Stream a completion from the sfcore-ai daemon to stdout.
//
//   node clients/node/example.js "Jelaskan Rust dalam 1 kalimat"
//   node clients/node/example.js --socket /tmp/my.sock --max-tokens 32 --temperature 0 "Hello"
//
// Exit status: 0 done, 1 the daemon answered with an error line (message on stderr),
// 2 bad arguments, 3 the daemon is unreachable or the connection broke, 130 interrupted.

import { parseArgs } from "node:util";
import { connect, SfcoreConnectionError, SfcoreError } from "./index.js";

const USAGE = `usage: node example.js [options] PROMPT...

  --socket PATH          daemon socket (default: $SFCORE_SOCKET, else /tmp/sfcore-ai.sock)
  --chat                 send PROMPT as a user message through the chat template
  --max-tokens N         --temperature T   --top-k N   --top-p P   --min-p P
  --repeat-penalty R     --seed N          --stop TEXT (repeatable)
  --no-cache-prompt      evaluate the prompt from an empty cache
  --verbose              print finish reason, usage and timings to stderr`;

const NUMBERS = {
  "max-tokens": "max_tokens",
  temperature: "temperature",
  "top-k": "top_k",
  "top-p": "top_p",
  "min-p": "min_p",
  "repeat-penalty": "repeat_penalty",
  seed: "seed",
};

function parse(argv) {
  const options = {
    socket: { type: "string" },
    chat: { type: "boolean" },
    stop: { type: "string", multiple: true },
    "no-cache-prompt": { type: "boolean" },
    verbose: { type: "boolean" },
    help: { type: "boolean", short: "h" },
  };
  for (const name of Object.keys(NUMBERS)) options[name] = { type: "string" };
  const { values, positionals } = parseArgs({ args: argv, options, allowPositionals: true });
  if (values.help) {
    process.stdout.write(`${USAGE}\n`);
    process.exit(0);
  }
  if (positionals.length === 0) throw new Error("missing PROMPT");
  const request = {};
  for (const [flag, field] of Object.entries(NUMBERS)) {
    if (values[flag] === undefined) continue;
    const value = Number(values[flag]);
    if (values[flag].trim() === "" || !Number.isFinite(value)) {
      throw new Error(`--${flag}: not a number: ${values[flag]}`);
    }
    request[field] = value;
  }
  if (values.stop) request.stop = values.stop;
  if (values["no-cache-prompt"]) request.cache_prompt = false;
  return { values, prompt: positionals.join(" "), request };
}

async function main() {
  let args;
  try {
    args = parse(process.argv.slice(2));
  } catch (error) {
    process.stderr.write(`sfcore-example: ${error.message}\n${USAGE}\n`);
    return 2;
  }
  const { values, prompt, request } = args;

  let client;
  try {
    client = await connect(values.socket);
  } catch (error) {
    process.stderr.write(`sfcore-example: ${error.message}\n`);
    return error instanceof SfcoreConnectionError ? 3 : 1;
  }

  const interrupt = new AbortController();
  process.once("SIGINT", () => interrupt.abort(new Error("interrupted")));
  const options = { ...request, signal: interrupt.signal };
  let wrote = false;
  try {
    const stream = values.chat
      ? client.streamChat([{ role: "user", content: prompt }], options)
      : client.streamGenerate(prompt, options);
    for await (const piece of stream) {
      process.stdout.write(piece);
      wrote = true;
    }
    process.stdout.write("\n");
    if (values.verbose) {
      const { finishReason, stopSequence, usage, timings } = stream.result;
      process.stderr.write(`${JSON.stringify({ finishReason, stopSequence, usage, timings })}\n`);
    }
    return 0;
  } catch (error) {
    if (wrote) process.stdout.write("\n");
    if (interrupt.signal.aborted) return 130;
    if (error instanceof SfcoreConnectionError) {
      process.stderr.write(`sfcore-example: ${error.message}\n`);
      return 3;
    }
    if (error instanceof SfcoreError) {
      process.stderr.write(`sfcore-example: ${error.code}: ${error.message}\n`);
      return 1;
    }
    throw error;
  } finally {
    await client.close();
  }
}

process.exitCode = await main();
