#!/usr/bin/env node
// A tool-call round trip with the sfcore-ai daemon: offer two functions, run the calls the
// model makes here, send their results back, print the final answer.
//
//   node clients/node/tools-example.js "What is the weather in Paris, and what is 2 + 3?"
//   node clients/node/tools-example.js --tool-choice add --json "What is 2 + 3?"
//
// stdout gets one line per call (`name(arguments) -> result`) and then the answer; with
// --json, one JSON object instead: {tools, first: {finishReason, text}, calls: [{id, name,
// arguments, result}], answer: {finishReason, text, toolCalls}}. Exit status: 0 done, 1 the
// daemon answered with an error line (message on stderr), 2 bad arguments, 3 the daemon is
// unreachable.

import { parseArgs } from "node:util";
import { connect, SfcoreConnectionError, SfcoreError } from "./index.js";

const USAGE = `usage: node tools-example.js [options] [PROMPT...]

  --tool-choice C    auto (default), required, none, or a function's name: get_weather, add
  --socket PATH      daemon socket (default: $SFCORE_SOCKET, else /tmp/sfcore-ai.sock)
  --max-tokens N     per answer (default 64)   --temperature T   --seed N
  --no-parallel      one call at most (parallel_tool_calls false)
  --json             print the round trip as one JSON object`;

const DEFAULT_PROMPT = "What is the weather in Paris, and what is 2 + 3?";

const TOOLS = [
  { type: "function", function: {
    name: "get_weather", description: "The weather in a city now",
    parameters: { type: "object", properties: {
      city: { type: "string", maxLength: 40 }, unit: { enum: ["c", "f"] } },
    required: ["city"], additionalProperties: false } } },
  { type: "function", function: {
    name: "add", description: "The sum of two integers",
    parameters: { type: "object", properties: { a: { type: "integer" }, b: { type: "integer" } },
      required: ["a", "b"], additionalProperties: false } } },
];

// The functions themselves, run here: the daemon only says which to call and with what.
// Their arguments are already valid against the tools' parameters.
const FUNCTIONS = {
  get_weather: ({ city, unit = "c" }) => `${city}: ${unit === "f" ? "70 F" : "21 C"}, sunny`,
  add: ({ a, b }) => String(a + b),
};

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
      "tool-choice": { type: "string" },
      socket: { type: "string" },
      "max-tokens": { type: "string" },
      temperature: { type: "string" },
      seed: { type: "string" },
      "no-parallel": { type: "boolean" },
      json: { type: "boolean" },
      help: { type: "boolean", short: "h" },
    },
  });
  if (values.help) {
    process.stdout.write(`${USAGE}\n`);
    process.exit(0);
  }
  const options = { max_tokens: number("--max-tokens", values["max-tokens"] ?? "64") };
  if (values.temperature !== undefined) options.temperature = number("--temperature", values.temperature);
  if (values.seed !== undefined) options.seed = number("--seed", values.seed);
  const choice = values["tool-choice"] ?? "auto";
  let toolChoice;
  if (["auto", "required", "none"].includes(choice)) toolChoice = choice;
  else if (choice in FUNCTIONS) toolChoice = { type: "function", function: { name: choice } };
  else throw new Error(`--tool-choice: not auto, required, none or a function: ${choice}`);
  return { values, prompt: positionals.join(" ") || DEFAULT_PROMPT, options, toolChoice };
}

async function roundTrip(client, { values, prompt, options, toolChoice }) {
  const messages = [{ role: "user", content: prompt }];
  const first = await client.chat(messages, {
    ...options, tools: TOOLS, toolChoice, parallelToolCalls: !values["no-parallel"] });
  const calls = first.toolCalls.map((call) => ({
    id: call.id, name: call.function.name, arguments: call.function.arguments,
    result: FUNCTIONS[call.function.name](call.function.arguments),
  }));
  let answer = first;
  if (first.finishReason === "tool_calls") {
    // The conversation goes back with the assistant's calls and one tool message per result.
    const history = [...messages, { role: "assistant", content: first.text, toolCalls: first.toolCalls },
      ...calls.map((call) => ({ role: "tool", toolCallId: call.id, content: call.result }))];
    answer = await client.chat(history, { ...options, tools: TOOLS });
  }
  return { first, calls, answer };
}

async function main() {
  let args;
  try {
    args = parse(process.argv.slice(2));
  } catch (error) {
    process.stderr.write(`tools-example: ${error.message}\n${USAGE}\n`);
    return 2;
  }
  let client;
  try {
    client = await connect(args.values.socket);
  } catch (error) {
    process.stderr.write(`tools-example: ${error.message}\n`);
    return error instanceof SfcoreConnectionError ? 3 : 1;
  }
  try {
    const { first, calls, answer } = await roundTrip(client, args);
    if (args.values.json) {
      process.stdout.write(`${JSON.stringify({
        tools: TOOLS,
        first: { finishReason: first.finishReason, text: first.text },
        calls,
        answer: { finishReason: answer.finishReason, text: answer.text, toolCalls: answer.toolCalls },
      })}\n`);
    } else {
      for (const call of calls) {
        process.stdout.write(`${call.name}(${JSON.stringify(call.arguments)}) -> ${call.result}\n`);
      }
      process.stdout.write(`${answer.text}\n`);
      if (answer.finishReason === "tool_calls") {
        // This example runs one round of calls; an agent would loop until a text answer.
        process.stderr.write(`tools-example: the model asked for more calls: ` +
          `${answer.toolCalls.map((call) => call.function.name).join(", ")}\n`);
      }
    }
    return 0;
  } catch (error) {
    if (error instanceof SfcoreConnectionError) {
      process.stderr.write(`tools-example: ${error.message}\n`);
      return 3;
    }
    if (error instanceof SfcoreError) {
      process.stderr.write(`tools-example: ${error.code}: ${error.message}\n`);
      return 1;
    }
    throw error;
  } finally {
    await client.close();
  }
}

process.exitCode = await main();
