#!/usr/bin/env node
// Ask the sfcore-ai daemon for a JSON document shaped by a JSON Schema, and print it.
//
//   node clients/node/structured.js --json-schema person.json "A person as JSON:"
//   node clients/node/structured.js --format json --chat "Describe a cat as JSON."
//   node clients/node/structured.js --grammar yesno.gbnf "Is the sky blue? Answer:"
//
// stdout gets the document and a newline (ready for `jq`). Exit status: 0 a whole
// document, 1 the daemon answered with an error line (a schema it refuses is
// invalid_request; the message goes to stderr), 2 bad arguments or a file that cannot be
// read, 3 the daemon is unreachable, 4 the reply ended before the document did
// (max_tokens; what came is still printed).

import fs from "node:fs";
import { parseArgs } from "node:util";
import { connect, SfcoreConnectionError, SfcoreError } from "./index.js";

const USAGE = `usage: node structured.js (--json-schema FILE | --format json | --grammar FILE) [options] PROMPT...

  --json-schema FILE     the output is a JSON document valid against this JSON Schema
  --format json          the output is a JSON object
  --grammar FILE         the output matches this GBNF grammar
  --socket PATH          daemon socket (default: $SFCORE_SOCKET, else /tmp/sfcore-ai.sock)
  --chat                 send PROMPT as a user message through the chat template
  --max-tokens N         (default 256)   --temperature T   --seed N
  --no-cache-prompt      evaluate the prompt from an empty cache`;

function readFile(flag, file) {
  try {
    return fs.readFileSync(file, "utf8");
  } catch (error) {
    throw new Error(`${flag} ${file}: ${error.code ?? error.message}`);
  }
}

function number(flag, text) {
  const value = Number(text);
  if (text.trim() === "" || !Number.isFinite(value)) throw new Error(`${flag}: not a number: ${text}`);
  return value;
}

function parse(argv) {
  const { values, positionals } = parseArgs({
    args: argv,
    allowPositionals: true,
    options: {
      "json-schema": { type: "string" },
      format: { type: "string" },
      grammar: { type: "string" },
      socket: { type: "string" },
      chat: { type: "boolean" },
      "max-tokens": { type: "string" },
      temperature: { type: "string" },
      seed: { type: "string" },
      "no-cache-prompt": { type: "boolean" },
      help: { type: "boolean", short: "h" },
    },
  });
  if (values.help) {
    process.stdout.write(`${USAGE}\n`);
    process.exit(0);
  }
  if (positionals.length === 0) throw new Error("missing PROMPT");
  const request = { max_tokens: number("--max-tokens", values["max-tokens"] ?? "256") };
  if (values.temperature !== undefined) request.temperature = number("--temperature", values.temperature);
  if (values.seed !== undefined) request.seed = number("--seed", values.seed);
  if (values["no-cache-prompt"]) request.cache_prompt = false;
  // More than one of these is sent as given: the daemon answers invalid_request.
  if (values["json-schema"] !== undefined) {
    const text = readFile("--json-schema", values["json-schema"]);
    try {
      request.json_schema = JSON.parse(text);
    } catch (error) {
      throw new Error(`--json-schema ${values["json-schema"]}: not JSON: ${error.message}`);
    }
  }
  if (values.format !== undefined) request.format = values.format;
  if (values.grammar !== undefined) request.grammar = readFile("--grammar", values.grammar);
  if (!("json_schema" in request || "format" in request || "grammar" in request)) {
    throw new Error("give --json-schema FILE, --format json or --grammar FILE");
  }
  return { values, prompt: positionals.join(" "), request };
}

async function main() {
  let args;
  try {
    args = parse(process.argv.slice(2));
  } catch (error) {
    process.stderr.write(`structured: ${error.message}\n${USAGE}\n`);
    return 2;
  }
  const { values, prompt, request } = args;
  let client;
  try {
    client = await connect(values.socket);
  } catch (error) {
    process.stderr.write(`structured: ${error.message}\n`);
    return error instanceof SfcoreConnectionError ? 3 : 1;
  }
  try {
    const result = values.chat
      ? await client.chat([{ role: "user", content: prompt }], request)
      : await client.generate(prompt, request);
    process.stdout.write(`${result.text}\n`);
    if (result.truncated) {
      process.stderr.write("structured: the daemon closed the document early (max_tokens)\n");
    } else if (result.finishReason !== "stop") {
      process.stderr.write(`structured: the reply ended before the document did ` +
        `(finish_reason ${result.finishReason})\n`);
      return 4;
    }
    return 0;
  } catch (error) {
    if (error instanceof SfcoreConnectionError) {
      process.stderr.write(`structured: ${error.message}\n`);
      return 3;
    }
    if (error instanceof SfcoreError) {
      process.stderr.write(`structured: ${error.code}: ${error.message}\n`);
      return 1;
    }
    throw error;
  } finally {
    await client.close();
  }
}

process.exitCode = await main();
