// Unit tests of the client against a fake daemon on a real Unix socket (no model needed).
//   node --test clients/node/test/

import assert from "node:assert/strict";
import fs from "node:fs";
import net from "node:net";
import os from "node:os";
import path from "node:path";
import { after, test } from "node:test";
import { connect, SfcoreConnectionError, SfcoreError } from "../index.js";

const dir = fs.mkdtempSync(path.join(os.tmpdir(), "sfnt"));
after(() => fs.rmSync(dir, { recursive: true, force: true }));
let servers = 0;

// A fake daemon: serve(request, socket, state) answers each request line (writing raw
// bytes as it likes); `state` is shared by every connection.
async function fakeDaemon(serve) {
  let closes = 0;
  const waiters = [];
  const check = () => {
    for (const waiter of waiters) if (closes >= waiter.n) waiter.resolve();
  };
  const state = {
    connections: 0,
    requests: [],
    // Resolves once n connections have closed on the daemon's side.
    closed: (n) => new Promise((resolve) => {
      waiters.push({ n, resolve });
      check();
    }),
  };
  const socketPath = path.join(dir, `d${servers++}.sock`);
  const server = net.createServer((socket) => {
    state.connections += 1;
    let buffered = "";
    socket.setEncoding("utf8");
    socket.on("data", (chunk) => {
      buffered += chunk;
      let end;
      while ((end = buffered.indexOf("\n")) !== -1) {
        const request = JSON.parse(buffered.slice(0, end));
        buffered = buffered.slice(end + 1);
        state.requests.push(request);
        serve(request, socket, state);
      }
    });
    socket.on("error", () => {});
    socket.on("close", () => {
      closes += 1;
      check();
    });
  });
  await new Promise((resolve) => server.listen(socketPath, resolve));
  after(() => server.close());
  return { socketPath, state };
}

const line = (object) => `${JSON.stringify(object)}\n`;
const done = (id, extra = {}) => line({ type: "done", id, text: "", finish_reason: "stop",
  stop_sequence: null, usage: { prompt_tokens: 2, cached_tokens: 0, completion_tokens: 3 },
  timings: { total_ms: 1.5 }, ...extra });

test("pieces split mid-character across reads stay whole; the Result is camelCase", async () => {
  const { socketPath } = await fakeDaemon((request, socket) => {
    const bytes = Buffer.from(line({ type: "token", id: request.id, text: "日本" }) +
      line({ type: "token", id: request.id, text: "é" }) + done(request.id));
    const cut = bytes.indexOf(Buffer.from("本")) + 1; // inside the 3-byte character
    socket.write(bytes.subarray(0, cut));
    setTimeout(() => socket.write(bytes.subarray(cut)), 20);
  });
  const client = await connect(socketPath);
  const pieces = [];
  const stream = client.streamGenerate("p", { maxTokens: 3, temperature: 0 });
  for await (const piece of stream) pieces.push(piece);
  assert.deepEqual(pieces, ["日本", "é"]);
  assert.equal(stream.result.text, "日本é");
  assert.equal(stream.result.finishReason, "stop");
  assert.deepEqual(stream.result.usage, { promptTokens: 2, cachedTokens: 0, completionTokens: 3 });
  assert.equal(stream.result.timings.totalMs, 1.5);
  assert.equal(await stream.completed, stream.result);
  await client.close();
});

test("requests carry the protocol's fields; a long non-streamed done is read whole", async () => {
  const long = "日本語のテキスト ".repeat(40000);
  const { socketPath, state } = await fakeDaemon((request, socket) => {
    socket.write(done(request.id, { text: long, finish_reason: "stop_sequence",
      stop_sequence: "END" }));
  });
  const client = await connect(socketPath);
  const result = await client.generate("p", { maxTokens: 5, top_k: 0, seed: undefined,
    stop: ["END"], cachePrompt: false });
  assert.equal(result.text, long);
  assert.equal(result.stopSequence, "END");
  assert.deepEqual(state.requests[0], { op: "generate", prompt: "p", max_tokens: 5, top_k: 0,
    stop: ["END"], cache_prompt: false, id: 1, stream: false });
  await client.close();
});

test("structured output fields go out as given; truncated defaults to false", async () => {
  const { socketPath, state } = await fakeDaemon((request, socket) => {
    const extra = request.op === "chat" ? { truncated: true, finish_reason: "length" } : {};
    socket.write(done(request.id, { text: "{}", ...extra }));
  });
  const client = await connect(socketPath);
  const schema = { type: "object", properties: { firstName: { type: "string" } },
    required: ["firstName"] };
  const plain = await client.generate("p", { jsonSchema: schema, format: undefined });
  const cut = await client.chat([{ role: "user", content: "c" }], { format: "json" });
  const stream = client.streamGenerate("p", { grammar: 'root ::= "a"' });
  for await (const piece of stream) void piece;
  assert.equal(plain.truncated, false);
  assert.equal(cut.truncated, true);
  assert.equal(cut.finishReason, "length");
  assert.equal(stream.result.truncated, false);
  // The schema's own keys are not renamed, whatever their case.
  assert.deepEqual(state.requests[0], { op: "generate", prompt: "p", json_schema: schema, id: 1,
    stream: false });
  assert.equal(state.requests[1].format, "json");
  assert.equal(state.requests[2].grammar, 'root ::= "a"');
  assert.ok(!("json_schema" in state.requests[1]) && !("grammar" in state.requests[1]));
  await client.close();
});

test("concurrent requests are pipelined and matched in order", async () => {
  const { socketPath } = await fakeDaemon((request, socket) => {
    if (request.op === "tokenize") socket.write(line({ type: "tokens", id: request.id, tokens: [2, 7] }));
    else if (request.op === "health") socket.write(line({ type: "health", id: request.id, status: "ok" }));
    else socket.write(line({ type: "error", id: request.id, code: "invalid_request", message: "m" }));
  });
  const client = await connect(socketPath);
  const [tokens, health, failure] = await Promise.allSettled([
    client.tokenize("x"), client.health(), client.detokenize([1])]);
  assert.deepEqual(tokens.value, [2, 7]);
  assert.equal(health.value.status, "ok");
  assert.ok(failure.reason instanceof SfcoreError);
  assert.equal(failure.reason.code, "invalid_request");
  await client.close();
});

test("cache() lists or clears the prompt store; the reply is the line as sent", async () => {
  const stored = { tokens: 80, bytes: 4096, ram: true, disk: false, preview: "You are" };
  const { socketPath, state } = await fakeDaemon((request, socket) => {
    const clear = request.action === "clear";
    socket.write(line({ type: "cache", id: request.id, enabled: true, dir: "/tmp/p",
      states: clear ? [] : [stored], removed_states: clear ? 1 : 0,
      removed_files: 0, removed_bytes: 0 }));
  });
  const client = await connect(socketPath);
  const listed = await client.cache();
  const cleared = await client.cache({ clear: true });
  const listedAgain = await client.cache({ clear: false });
  assert.deepEqual(listed, { type: "cache", id: 1, enabled: true, dir: "/tmp/p",
    states: [stored], removed_states: 0, removed_files: 0, removed_bytes: 0 });
  assert.equal(cleared.removed_states, 1);
  assert.deepEqual(cleared.states, []);
  assert.deepEqual(state.requests, [{ op: "cache", action: "list", id: 1 },
    { op: "cache", action: "clear", id: 2 }, { op: "cache", action: "list", id: 3 }]);
  assert.equal(listedAgain.id, 3);
  await client.close();
});

test("logprobs entries are typed and gathered from the token lines and the done line", async () => {
  const entry = (token, bytes, logprob) => ({ token, text: Buffer.from(bytes).toString(), bytes,
    logprob, top_logprobs: [{ token, text: "x", bytes, logprob }] });
  const first = entry(5, [0xe6, 0x97], -0.5);
  const second = entry(6, [0xa5], -0.25);
  const third = entry(7, [0x21], 0);
  const { socketPath, state } = await fakeDaemon((request, socket) => {
    if (request.op === "metrics") {
      socket.write(line({ type: "metrics", id: request.id, text: "# TYPE a counter\na 1\n" }));
    } else if (request.stream) {
      socket.write(line({ type: "token", id: request.id, text: "日", logprobs: [first, second] }) +
        line({ type: "token", id: request.id, text: "!", logprobs: [third] }) +
        done(request.id, { logprobs: [] }));
    } else if (request.logprobs !== undefined) {
      socket.write(done(request.id, { text: "日!", logprobs: [first, second, third] }));
    } else {
      socket.write(done(request.id, { text: "日!" }));
    }
  });
  const client = await connect(socketPath);
  const stream = client.streamGenerate("p", { logprobs: 1, frequencyPenalty: 0.5 });
  for await (const piece of stream) void piece;
  const whole = await client.chat([{ role: "user", content: "c" }], { logprobs: 1,
    presence_penalty: -1 });
  const plain = await client.generate("p");
  assert.equal(await client.metrics(), "# TYPE a counter\na 1\n");
  for (const result of [stream.result, whole]) {
    assert.deepEqual(result.logprobs.map((e) => e.token), [5, 6, 7]);
    assert.ok(result.logprobs[0].bytes instanceof Uint8Array);
    assert.deepEqual([...result.logprobs[1].bytes], [0xa5]);
    assert.deepEqual(Buffer.concat(result.logprobs.map((e) => e.bytes)).toString(), "日!");
    assert.deepEqual(result.logprobs[0].topLogprobs, [{ token: 5, text: "x",
      bytes: Uint8Array.from([0xe6, 0x97]), logprob: -0.5 }]);
  }
  assert.equal(plain.logprobs, null);
  assert.equal(state.requests[0].frequency_penalty, 0.5);
  assert.equal(state.requests[1].presence_penalty, -1);
  assert.deepEqual(state.requests[3], { op: "metrics", id: 4 });
  await client.close();
});

test("tool fields go out as the protocol has them; a done's tool_calls are typed", async () => {
  const call = { id: "call_1", type: "function", function: { name: "add",
    arguments: { a: 2, b: 3 } } };
  const { socketPath, state } = await fakeDaemon((request, socket) => {
    if (request.tools === undefined) {
      socket.write(done(request.id, { text: "5" }));
      return;
    }
    const calls = { text: "", finish_reason: "tool_calls", tool_calls: [call] };
    if (request.stream) socket.write(done(request.id, calls));
    else socket.write(done(request.id, { ...calls, text: "Let me add. " }));
  });
  const tools = [{ type: "function", function: { name: "add", description: "a + b",
    parameters: { type: "object", properties: { someNumber: { type: "integer" } } } } }];
  const choice = { type: "function", function: { name: "add" } };
  const client = await connect(socketPath);
  // Closed whatever happens: an open connection keeps the test runner waiting.
  after(() => client.close());
  const user = { role: "user", content: "2 + 3?" };
  const result = await client.chat([user], { tools, toolChoice: choice,
    parallelToolCalls: false });
  const stream = client.streamChat([user], { tools, tool_choice: "required" });
  for await (const piece of stream) void piece;
  // The result's calls go back as they are; OpenAI-style JSON text arguments become objects.
  const answer = await client.chat([user,
    { role: "assistant", content: result.text, toolCalls: result.toolCalls },
    { role: "assistant", content: "", tool_calls: [{ id: "call_2",
      function: { name: "add", arguments: '{"a": 1, "b": 1}' } }] },
    { role: "assistant", content: "", toolCalls: [{ id: "call_3",
      function: { name: "add", arguments: "not json" } }] },
    { role: "tool", toolCallId: "call_1", content: "5" },
    { role: "tool", tool_call_id: "call_2", content: "2" }]);

  for (const got of [result, stream.result]) {
    assert.equal(got.finishReason, "tool_calls");
    assert.deepEqual(got.toolCalls, [call]);
  }
  assert.equal(result.text, "Let me add. ");
  assert.deepEqual(answer.toolCalls, []);
  assert.equal(answer.finishReason, "stop");
  // The tools and their schemas' keys are sent as given; only the option names change.
  assert.deepEqual(state.requests[0], { op: "chat", messages: [user], tools, tool_choice: choice,
    parallel_tool_calls: false, id: 1, stream: false });
  assert.equal(state.requests[1].tool_choice, "required");
  assert.deepEqual(state.requests[2].messages, [user,
    { role: "assistant", content: "Let me add. ", tool_calls: [call] },
    { role: "assistant", content: "", tool_calls: [{ id: "call_2",
      function: { name: "add", arguments: { a: 1, b: 1 } } }] },
    { role: "assistant", content: "", tool_calls: [{ id: "call_3",
      function: { name: "add", arguments: "not json" } }] },
    { role: "tool", tool_call_id: "call_1", content: "5" },
    { role: "tool", tool_call_id: "call_2", content: "2" }]);
});

test("the daemon's numbers come through exactly", async () => {
  // Decimals a parser that does not round correctly can land a ULP off: the last few are
  // halfway cases or long expansions.
  const numbers = ["-0.9871219318255093", "0.1", "2.2250738585072014e-308",
    "2.2250738585072011e-308", "5e-324", "1.7976931348623157e308", "9007199254740993",
    "-0.30000000000000004", "1e23", "8.98846567431158e307",
    "1.00000000000000011102230246251565404236316680908203125",
    "1.00000000000000011102230246251565404236316680908203125000000000000000001",
    `0.${"0".repeat(323)}24703282292062328`];
  let n;
  // Each decimal written as given: JSON.stringify would send the float's shortest form.
  const { socketPath } = await fakeDaemon((request, socket) => {
    const entry = `{"token":1,"text":"x","bytes":[120],"logprob":${n},` +
      `"top_logprobs":[{"token":1,"text":"x","bytes":[120],"logprob":${n}}]}`;
    const id = request.id;
    if (request.op === "stats") {
      socket.write(`{"type":"stats","id":${id},"decode_tok_s":${n}}\n`);
    } else if (request.stream) {
      socket.write(`{"type":"token","id":${id},"text":"x","logprobs":[${entry}]}\n` +
        `{"type":"done","id":${id},"text":"","finish_reason":"stop","logprobs":[]}\n`);
    } else {
      socket.write(`{"type":"done","id":${id},"text":"","finish_reason":"tool_calls",` +
        `"timings":{"decode_tok_s":${n}},"logprobs":[${entry}],"tool_calls":[{"id":"c",` +
        `"type":"function","function":{"name":"f","arguments":{"v":${n}}}}]}\n`);
    }
  });
  const client = await connect(socketPath);
  after(() => client.close());
  for (n of numbers) {
    const want = Number(n);
    const whole = await client.generate("p", { logprobs: 1 });
    const stream = client.streamGenerate("p", { logprobs: 1 });
    for await (const piece of stream) void piece;
    const stats = await client.stats();
    assert.equal(whole.logprobs[0].logprob, want, n);
    assert.equal(whole.logprobs[0].topLogprobs[0].logprob, want, n);
    assert.equal(whole.timings.decodeTokS, want, n);
    assert.equal(whole.toolCalls[0].function.arguments.v, want, n);
    assert.equal(stream.result.logprobs[0].logprob, want, n);
    assert.equal(stats.decode_tok_s, want, n);
  }
});

test("queued lines report the place; unknown lines are skipped; priority only when given",
  async () => {
    const { socketPath, state } = await fakeDaemon((request, socket) => {
      const id = request.id;
      if (request.op === "cancel") {
        socket.write(line({ type: "cancelled", id, target: request.target, found: true }));
        return;
      }
      if (request.op === "health") {
        socket.write(line({ type: "health", id, status: "ok" }));
        return;
      }
      const unknown = line({ type: "future_kind", id, detail: [1, 2] });
      if (!request.stream) {
        socket.write(unknown + done(id, { text: "Hi!" }));
        return;
      }
      socket.write(line({ type: "queued", id, position: 2, queue_depth: 3 }) +
        line({ type: "queued", id, position: 1, queue_depth: 2 }) + unknown +
        line({ type: "token", id, text: "Hi" }) + line({ type: "token", id, text: "!" }) +
        done(id));
    });
    const client = await connect(socketPath);
    after(() => client.close());
    const places = [];
    const stream = client.streamGenerate("p", { priority: "background",
      onQueued: (place) => places.push(place) });
    assert.equal(stream.queuePosition, null);
    const pieces = [];
    for await (const piece of stream) pieces.push(piece);
    assert.deepEqual(pieces, ["Hi", "!"]);
    assert.deepEqual(places, [{ position: 2, queueDepth: 3 }, { position: 1, queueDepth: 2 }]);
    assert.deepEqual(stream.queuePosition, { position: 1, queueDepth: 2 });
    assert.equal(stream.result.text, "Hi!");
    assert.equal(stream.result.finishReason, "stop");

    // Without a callback: the same pieces; the place is still kept.
    const chat = client.streamChat([{ role: "user", content: "c" }], { priority: "interactive" });
    const chatPieces = [];
    for await (const piece of chat) chatPieces.push(piece);
    assert.deepEqual(chatPieces, ["Hi", "!"]);
    assert.deepEqual(chat.queuePosition, { position: 1, queueDepth: 2 });

    // Not streamed: an unknown line before the done is skipped.
    assert.equal((await client.generate("p")).text, "Hi!");
    assert.equal((await client.chat([{ role: "user", content: "c" }], { priority: null })).text,
      "Hi!");
    // onQueued (with or without onToken) streams generate and chat.
    const called = [];
    const tokens = [];
    const viaCallbacks = await client.chat([{ role: "user", content: "c" }], {
      priority: "background", onQueued: (place) => called.push(place.position),
      onToken: (piece) => tokens.push(piece) });
    assert.deepEqual([called, tokens, viaCallbacks.text], [[2, 1], ["Hi", "!"], "Hi!"]);
    const onlyQueued = await client.generate("p", { onQueued: (place) => called.push(place) });
    assert.equal(onlyQueued.text, "Hi!");
    assert.equal(called.length, 4);

    // A callback that throws cancels the request; the iteration rejects with its error.
    const failing = client.streamGenerate("p", { onQueued: () => {
      throw new Error("stop here");
    } });
    await assert.rejects((async () => {
      for await (const piece of failing) void piece;
    })(), /stop here/);
    assert.equal((await client.health()).status, "ok"); // still in step

    const sent = state.requests.map((r) => [r.op, r.stream, r.priority]);
    assert.deepEqual(sent.slice(0, 7), [["generate", true, "background"],
      ["chat", true, "interactive"], ["generate", false, undefined], ["chat", false, undefined],
      ["chat", true, "background"], ["generate", true, undefined], ["generate", true, undefined]]);
    assert.ok(!("priority" in state.requests[2]) && !("priority" in state.requests[3]));
    assert.ok(!("on_queued" in state.requests[4]) && !("onQueued" in state.requests[4]));
    assert.equal(state.requests[7].op, "cancel");
    assert.equal(state.requests[7].target, state.requests[6].id);
  });

test("leaving an iteration early sends cancel for the request", async () => {
  const { socketPath, state } = await fakeDaemon((request, socket) => {
    if (request.op === "generate") {
      socket.write(line({ type: "token", id: request.id, text: "a" }));
    } else if (request.op === "cancel") {
      socket.write(done(request.target, { finish_reason: "cancelled" }));
      socket.write(line({ type: "cancelled", id: request.id, target: request.target, found: true }));
    } else {
      socket.write(line({ type: "health", id: request.id, status: "ok" }));
    }
  });
  const client = await connect(socketPath);
  const stream = client.streamGenerate("p");
  for await (const piece of stream) {
    assert.equal(piece, "a");
    break;
  }
  assert.equal((await client.health()).status, "ok");
  assert.deepEqual(state.requests.map((r) => r.op), ["generate", "cancel", "health"]);
  assert.equal(state.requests[1].target, stream.id);
  assert.equal(stream.result.finishReason, "cancelled");
  await client.close();
});

test("a closing error fails the request; the next request connects again", async () => {
  const { socketPath, state } = await fakeDaemon((request, socket) => {
    if (request.op === "health") {
      socket.write(line({ type: "health", id: request.id, status: "ok" }));
      socket.end(); // as the idle timeout does, with nothing pending
      return;
    }
    socket.end(line({ type: "error", id: "sfc-1", code: "too_many_connections", message: "limit" }));
  });
  const client = await connect(socketPath);
  await assert.rejects(client.generate("p"), { name: "SfcoreError", code: "too_many_connections" });
  assert.equal((await client.health()).status, "ok");
  await state.closed(2); // the daemon has closed the second connection (idle)
  assert.equal((await client.health()).status, "ok");
  assert.equal(state.connections, 3);
  await client.close();
  await assert.rejects(client.health(), { name: "SfcoreConnectionError", code: "disconnected" });
});

test("an unreachable daemon: the error names the path; $SFCORE_SOCKET is the default", async () => {
  const missing = path.join(dir, "missing.sock");
  await assert.rejects(connect(missing), (error) => {
    assert.ok(error instanceof SfcoreConnectionError);
    assert.equal(error.code, "unreachable");
    assert.equal(error.path, missing);
    assert.match(error.message, /missing\.sock.*ENOENT.*may not be running/);
    return true;
  });
  process.env.SFCORE_SOCKET = missing;
  try {
    await assert.rejects(connect(), { path: missing });
  } finally {
    delete process.env.SFCORE_SOCKET;
  }
});
