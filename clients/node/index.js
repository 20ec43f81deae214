// Client for the sfcore-ai daemon: NDJSON over a Unix socket, Node.js standard library only.
//
//   import { connect } from "sfcore-client";
//   const client = await connect();               // $SFCORE_SOCKET, else /tmp/sfcore-ai.sock
//   const result = await client.generate("Hello", { max_tokens: 32, temperature: 0 });
//   for await (const piece of client.streamGenerate("Hello")) process.stdout.write(piece);
//   await client.close();
//
// One Client is one connection. Requests may be issued concurrently: they are pipelined on
// the connection, and since the daemon answers them in request order, each reply line is
// matched to the oldest unfinished request (and checked against its id).

import net from "node:net";

export const DEFAULT_SOCKET_PATH = "/tmp/sfcore-ai.sock";

/** An `error` line from the daemon (`code` is one of the protocol's error codes), or a
 * client-side failure with a code of the client's own ("unreachable", "disconnected",
 * "protocol"). */
export class SfcoreError extends Error {
  constructor(code, message, id = undefined) {
    super(message);
    this.name = "SfcoreError";
    this.code = code;
    this.id = id;
  }
}

/** The daemon could not be reached (code "unreachable"), or the connection ended while
 * requests were waiting for their replies (code "disconnected"). `path` is the socket. */
export class SfcoreConnectionError extends SfcoreError {
  constructor(code, path, message, cause = undefined) {
    super(code, message);
    this.name = "SfcoreConnectionError";
    this.path = path;
    if (cause !== undefined) this.cause = cause;
  }
}

// After an error line with one of these codes the daemon closes the connection.
const CLOSING_CODES = new Set(["line_too_long", "too_many_connections", "forbidden",
  "shutting_down"]);

const CONNECT_HINTS = {
  ENOENT: "no such socket file",
  ECONNREFUSED: "nothing is listening on it",
  EACCES: "permission denied",
  ENOTSOCK: "not a socket",
};

function unreachable(path, cause) {
  const what = cause.code ? `${cause.code}, ${CONNECT_HINTS[cause.code] ?? cause.message}` : cause.message;
  return new SfcoreConnectionError(
    "unreachable", path,
    `cannot connect to the sfcore-ai daemon at ${path} (${what}); the daemon may not be ` +
      "running: start it (scripts/run.sh) or set SFCORE_SOCKET to its socket path",
    cause);
}

/** Open a connection. `socketPath` defaults to $SFCORE_SOCKET, else /tmp/sfcore-ai.sock.
 * `options.timeout`: milliseconds to wait for the connection (default 10000; 0: no limit). */
export function connect(socketPath = undefined, options = {}) {
  if (socketPath !== null && typeof socketPath === "object") {
    options = socketPath;
    socketPath = options.socketPath;
  }
  const path = socketPath || process.env.SFCORE_SOCKET || DEFAULT_SOCKET_PATH;
  const timeout = options.timeout ?? 10000;
  return openSocket(path, timeout).then((socket) => new Client(socket, path, timeout));
}

function openSocket(path, timeout) {
  return new Promise((resolve, reject) => {
    const socket = net.createConnection({ path });
    let timer = null;
    const onError = (error) => {
      clearTimeout(timer);
      reject(unreachable(path, error));
    };
    if (timeout > 0) {
      timer = setTimeout(() => {
        socket.removeListener("error", onError);
        socket.destroy();
        const error = new Error(`timed out after ${timeout} ms`);
        error.code = "ETIMEDOUT";
        reject(unreachable(path, error));
      }, timeout);
    }
    socket.once("error", onError);
    socket.once("connect", () => {
      clearTimeout(timer);
      socket.removeListener("error", onError);
      resolve(socket);
    });
  });
}

function camelize(object) {
  if (object === null || typeof object !== "object") return object;
  const out = {};
  for (const key of Object.keys(object)) {
    out[key.replace(/_([a-z])/g, (_, c) => c.toUpperCase())] = object[key];
  }
  return out;
}

// A logprobs entry of a token or done line, typed: `bytes` as a Uint8Array (the wire has a
// list of ints), `top_logprobs` as `topLogprobs`.
function toTokenLogprob(entry) {
  return {
    token: entry.token,
    text: entry.text,
    bytes: Uint8Array.from(entry.bytes),
    logprob: entry.logprob,
    topLogprobs: (entry.top_logprobs ?? []).map((top) => ({
      token: top.token, text: top.text, bytes: Uint8Array.from(top.bytes), logprob: top.logprob,
    })),
  };
}

// A call of the done line's `tool_calls`, typed: `arguments` is the JSON object the daemon
// sent (valid against the tool's parameters), not JSON text as in OpenAI's API.
function toToolCall(call) {
  return {
    id: call.id,
    type: call.type ?? "function",
    function: { name: call.function.name, arguments: call.function.arguments },
  };
}

// Messages as the protocol has them: `toolCalls`/`toolCallId` may be camelCase, and a
// call's `arguments` may be JSON text (as OpenAI's API and its client libraries hold
// them): it goes out as the object it encodes. Text that is not JSON goes out as is, for
// the daemon to refuse naming the field.
function toWireMessages(messages) {
  if (!Array.isArray(messages)) return messages;
  return messages.map((message) => {
    if (message === null || typeof message !== "object") return message;
    const out = {};
    for (const key of Object.keys(message)) {
      const value = message[key];
      if (value === undefined) continue;
      if (key === "toolCalls" || key === "tool_calls") out.tool_calls = wireCalls(value);
      else if (key === "toolCallId") out.tool_call_id = value;
      else out[key] = value;
    }
    return out;
  });
}

function wireCalls(calls) {
  if (!Array.isArray(calls)) return calls;
  return calls.map((call) => {
    const args = call?.function?.arguments;
    if (typeof args !== "string") return call;
    let parsed;
    try {
      parsed = JSON.parse(args);
    } catch {
      return call;
    }
    return { ...call, function: { ...call.function, arguments: parsed } };
  });
}

// `streamed`: the logprobs entries the request's token lines carried; the done line holds
// the rest (all of them when not streamed). null when the request did not ask for them.
function toResult(done, text, streamed = []) {
  const entries = done.logprobs;
  return {
    id: done.id,
    text,
    finishReason: done.finish_reason,
    stopSequence: done.stop_sequence ?? null,
    // The daemon closed a JSON document early because max_tokens was near (absent: false).
    truncated: done.truncated === true,
    usage: camelize(done.usage),
    timings: camelize(done.timings),
    logprobs: entries === undefined || entries === null ? null
      : [...streamed, ...entries].map(toTokenLogprob),
    // The calls of an answer that called (finishReason "tool_calls"); else empty.
    toolCalls: (done.tool_calls ?? []).map(toToolCall),
  };
}

function toError(line) {
  return new SfcoreError(String(line.code), String(line.message), line.id);
}

function unexpected(line, want) {
  return new SfcoreError("protocol", `expected a '${want}' reply, got ${JSON.stringify(line)}`,
    line.id);
}

// Options of ours, not sent: `signal` (an AbortSignal), `onToken` (callback form),
// `onQueued` (the request's place in the daemon's wait queue), `stream` (each method
// decides). The rest are the protocol's fields (`priority` among them), in snake_case or
// camelCase (maxTokens -> max_tokens); undefined and null mean "the daemon's default" and
// are not sent. Only the names are converted: a `json_schema` or `tools` value goes out
// exactly as given.
function splitOptions(options) {
  const fields = {};
  let signal;
  let onToken;
  let onQueued;
  for (const key of Object.keys(options ?? {})) {
    const value = options[key];
    if (value === undefined || value === null) continue;
    if (key === "signal") signal = value;
    else if (key === "onToken") onToken = value;
    else if (key === "onQueued") onQueued = value;
    else if (key !== "stream") fields[key.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`)] = value;
  }
  return { fields, signal, onToken, onQueued };
}

// A `queued` line's place, typed; null when its fields are not numbers.
function toQueuePosition(line) {
  if (typeof line.position !== "number" || typeof line.queue_depth !== "number") return null;
  return { position: line.position, queueDepth: line.queue_depth };
}

/** The pieces of a streamed generation, as an async iterator. `result` holds the Result
 * once the `done` line has arrived; `completed` is a promise of it; `queuePosition` the
 * last place in the daemon's wait queue reported for the request (null if none). Leaving
 * the iteration early (`break`, an exception) sends `cancel` for the request, freeing the
 * daemon's slot. */
export class Stream {
  #abandon;
  #queue = [];
  #head = 0;
  #waiter = null;
  #error = null;
  #errorThrown = false;
  #finished = false;
  #abandoned = false;
  #completed = null;
  #settle = null;
  #entries = []; // the token lines' logprobs entries, for the Result

  constructor(id, abandon) {
    this.id = id;
    this.result = null;
    this.text = "";
    this.queuePosition = null;
    this.#abandon = abandon;
  }

  get finished() {
    return this.#finished || this.#error !== null;
  }

  /** A promise of the Result (rejected with the request's error). Pieces not yet iterated
   * stay readable. */
  get completed() {
    if (this.#completed === null) {
      if (this.result !== null) this.#completed = Promise.resolve(this.result);
      else if (this.#error !== null) this.#completed = Promise.reject(this.#error);
      else {
        this.#completed = new Promise((resolve, reject) => {
          this.#settle = { resolve, reject };
        });
      }
    }
    return this.#completed;
  }

  [Symbol.asyncIterator]() {
    return this;
  }

  next() {
    if (this.#head < this.#queue.length) {
      const value = this.#queue[this.#head];
      this.#queue[this.#head++] = undefined;
      if (this.#head === this.#queue.length) {
        this.#queue.length = 0;
        this.#head = 0;
      }
      return Promise.resolve({ value, done: false });
    }
    if (this.#error !== null && !this.#errorThrown) {
      this.#errorThrown = true;
      return Promise.reject(this.#error);
    }
    if (this.#finished || this.#errorThrown || this.#abandoned) {
      return Promise.resolve({ value: undefined, done: true });
    }
    return new Promise((resolve, reject) => {
      this.#waiter = { resolve, reject };
    });
  }

  /** Called by `break`: stop reading, cancel the request if it is still running. */
  return() {
    this.#stop();
    return Promise.resolve({ value: undefined, done: true });
  }

  throw(error) {
    this.#stop();
    return Promise.reject(error);
  }

  #stop() {
    this.#queue.length = 0;
    this.#head = 0;
    if (!this.#finished && this.#error === null && !this.#abandoned) {
      this.#abandoned = true;
      this.#abandon();
    }
  }

  // --- fed by the Client -----------------------------------------------------------------

  _token(text, entries) {
    this.text += text;
    if (entries) for (const entry of entries) this.#entries.push(entry);
    if (this.#abandoned) return;
    if (this.#waiter !== null) {
      const waiter = this.#waiter;
      this.#waiter = null;
      waiter.resolve({ value: text, done: false });
    } else {
      this.#queue.push(text);
    }
  }

  _queued(position) {
    this.queuePosition = position;
  }

  _done(line) {
    this.result = toResult(line, this.text, this.#entries);
    this.#entries = [];
    this.#finished = true;
    if (this.#waiter !== null) {
      const waiter = this.#waiter;
      this.#waiter = null;
      waiter.resolve({ value: undefined, done: true });
    }
    if (this.#settle !== null) this.#settle.resolve(this.result);
  }

  _abort(reason) {
    if (this.#finished || this.#error !== null) return;
    this.#stop();
    this._fail(reason);
  }

  _fail(error) {
    if (this.#finished || this.#error !== null) return;
    this.#error = error;
    if (this.#waiter !== null) {
      const waiter = this.#waiter;
      this.#waiter = null;
      this.#errorThrown = true;
      waiter.reject(error);
    }
    if (this.#settle !== null) this.#settle.reject(error);
  }
}

/** A connection to the daemon (see `connect`). If the connection ends (the daemon closes
 * connections idle for `idle_timeout_s`, or restarts), the requests waiting on it fail with
 * a "disconnected" error and the next request connects again. */
export class Client {
  #timeout;
  #socket = null; // null while disconnected
  #connecting = null; // while reconnecting: requests wait in #outbox
  #outbox = [];
  #pending = []; // calls waiting for reply lines, in request order
  #nextId = 1;
  #closing = null; // set by close()
  // State of the current socket:
  #buffer = "";
  #unsolicited = null; // an error line that came with no request waiting (e.g. too_many_connections)
  #socketError = null;

  constructor(socket, path, timeout = 10000) {
    this.path = path;
    this.#timeout = timeout;
    this.#attach(socket);
  }

  // --- generation ----------------------------------------------------------------------

  /** Complete `prompt`; resolves to a Result. With `options.onToken(piece)` the reply is
   * streamed and the callback gets each piece as it arrives; with `options.onQueued(place)`
   * it is streamed too, and the callback gets each place in the daemon's wait queue. */
  generate(prompt, options = {}) {
    return this.#generation({ op: "generate", prompt }, options);
  }

  /** Generate the assistant's turn after `messages` ({role, content}; an assistant's
   * `toolCalls`, a tool result's `toolCallId`); resolves to a Result. With `options.tools`
   * the answer may call them (`result.toolCalls`, finishReason "tool_calls"). */
  chat(messages, options = {}) {
    return this.#generation({ op: "chat", messages: toWireMessages(messages) }, options);
  }

  /** Stream a completion: an async iterator of text pieces (see Stream). */
  streamGenerate(prompt, options = {}) {
    return this.#stream({ op: "generate", prompt }, options);
  }

  streamChat(messages, options = {}) {
    return this.#stream({ op: "chat", messages: toWireMessages(messages) }, options);
  }

  // --- single-line requests ------------------------------------------------------------

  /** The `health` line: {status, model, busy, queue_depth, uptime_s, ...}. */
  async health() {
    return this.#expect(await this.#request({ op: "health" }), "health");
  }

  /** The `info` line: {model, config, system_info, versions, ...}. */
  async info() {
    return this.#expect(await this.#request({ op: "info" }), "info");
  }

  /** The `stats` line: {uptime_s, requests, tokens, errors, connections, decode_tok_s, ...}. */
  async stats() {
    return this.#expect(await this.#request({ op: "stats" }), "stats");
  }

  /** The counters, latency histograms and memory in Prometheus' text exposition format
   * (the text GET /metrics serves on the OpenAI listener). */
  async metrics() {
    return this.#expect(await this.#request({ op: "metrics" }), "metrics").text;
  }

  /** The `cache` line: what the prompt store holds, {enabled, dir, states: [{tokens, bytes,
   * ram, disk, preview}, ...] (most recently used first), removed_states, removed_files,
   * removed_bytes}. `{ clear: true }` first forgets every stored state, in RAM and on disk,
   * and resolves once the files are gone (the removed_* fields say what went). */
  async cache({ clear = false } = {}) {
    const request = { op: "cache", action: clear ? "clear" : "list" };
    return this.#expect(await this.#request(request), "cache");
  }

  /** Token ids of `text` (options.addSpecial / add_special: add BOS, default true). */
  async tokenize(text, options = {}) {
    const request = { op: "tokenize", text };
    const addSpecial = options.addSpecial ?? options.add_special;
    if (addSpecial !== undefined) request.add_special = addSpecial;
    return this.#expect(await this.#request(request), "tokens").tokens;
  }

  /** The text of a list of token ids. */
  async detokenize(tokens) {
    return this.#expect(await this.#request({ op: "detokenize", tokens }), "text").text;
  }

  /** Cancel an earlier request of this connection by its id; resolves to whether it was
   * still pending. Its own reply then ends with finishReason "cancelled". */
  async cancel(target) {
    return this.#expect(await this.#request({ op: "cancel", target }), "cancelled").found;
  }

  /** Close the connection; requests still waiting fail with a "disconnected" error. */
  close() {
    if (this.#closing !== null) return this.#closing;
    const socket = this.#socket;
    if (socket === null) {
      this.#closing = Promise.resolve();
      this.#outbox = [];
      this.#failPending(new SfcoreConnectionError("disconnected", this.path,
        `${this.path}: the client closed the connection`));
      return this.#closing;
    }
    this.#closing = new Promise((resolve) => {
      if (socket.destroyed) resolve();
      else socket.once("close", () => resolve());
    });
    // With requests still running, closing at once is what stops them (the daemon
    // cancels the requests of a vanished client); otherwise shut our side gracefully.
    if (this.#pending.length > 0) socket.destroy();
    else socket.end();
    // The daemon closes its side once ours is shut; destroy if it takes too long.
    setTimeout(() => socket.destroy(), 1000).unref();
    return this.#closing;
  }

  // --- internals -----------------------------------------------------------------------

  #newId(fields) {
    return fields.id ?? this.#nextId++;
  }

  #send(request, call) {
    if (this.#closing !== null) {
      throw new SfcoreConnectionError("disconnected", this.path,
        `${this.path}: the client was closed`);
    }
    const line = `${JSON.stringify(request)}\n`;
    this.#pending.push(call);
    if (this.#socket !== null) {
      this.#socket.write(line);
      return;
    }
    this.#outbox.push(line);
    if (this.#connecting === null) this.#reconnect();
  }

  #reconnect() {
    this.#connecting = openSocket(this.path, this.#timeout).then(
      (socket) => {
        this.#connecting = null;
        if (this.#closing !== null) {
          socket.destroy();
          return;
        }
        this.#attach(socket);
        const lines = this.#outbox;
        this.#outbox = [];
        socket.write(lines.join(""));
      },
      (error) => {
        this.#connecting = null;
        this.#outbox = [];
        this.#failPending(error);
      });
  }

  #attach(socket) {
    this.#socket = socket;
    this.#buffer = "";
    this.#unsolicited = null;
    this.#socketError = null;
    socket.setEncoding("utf8"); // a StringDecoder: characters split across reads stay whole
    socket.on("data", (chunk) => this.#onData(socket, chunk));
    socket.on("error", (error) => {
      this.#socketError = error;
    });
    // The daemon never half-closes: its end of the stream is the end of the connection.
    socket.once("end", () => this.#onClose(socket));
    socket.once("close", () => this.#onClose(socket));
  }

  #failPending(error) {
    const pending = this.#pending;
    this.#pending = [];
    for (const call of pending) call.fail(error);
  }

  #request(request) {
    return new Promise((resolve, reject) => {
      const id = this.#newId(request);
      const call = {
        id,
        line: (line) => (line.type === "error" ? reject(toError(line)) : resolve(line)),
        fail: reject,
      };
      this.#send({ ...request, id }, call);
    });
  }

  #expect(line, type) {
    if (line.type !== type) throw unexpected(line, type);
    return line;
  }

  #generation(base, options) {
    const { fields, signal, onToken, onQueued } = splitOptions(options);
    if (typeof onToken === "function" || typeof onQueued === "function") {
      return (async () => {
        const stream = this.#stream(base, { ...fields, signal, onQueued });
        for await (const piece of stream) onToken?.(piece);
        return stream.result;
      })();
    }
    return new Promise((resolve, reject) => {
      signal?.throwIfAborted();
      const id = this.#newId(fields);
      let settled = false;
      const settle = (fn, value) => {
        if (settled) return;
        settled = true;
        signal?.removeEventListener("abort", onAbort);
        fn(value);
      };
      const call = {
        id,
        ended: false,
        generation: true,
        line: (line) => {
          // Only `done` and `error` end it; a token, `queued` or a line type newer than
          // this client is skipped.
          if (line.type !== "done" && line.type !== "error") return;
          call.ended = true;
          if (line.type === "done") settle(resolve, toResult(line, line.text));
          else settle(reject, toError(line));
        },
        fail: (error) => {
          call.ended = true;
          settle(reject, error);
        },
      };
      const onAbort = () => {
        this.#abandon(call);
        settle(reject, signal.reason);
      };
      this.#send({ ...base, ...fields, id, stream: false }, call);
      signal?.addEventListener("abort", onAbort, { once: true });
    });
  }

  #stream(base, options) {
    const { fields, signal, onQueued } = splitOptions(options);
    const id = this.#newId(fields);
    const call = { id, ended: false, generation: true, line: null, fail: null };
    const stream = new Stream(id, () => this.#abandon(call));
    const onAbort = () => stream._abort(signal.reason);
    const detach = () => signal?.removeEventListener("abort", onAbort);
    call.line = (line) => {
      if (line.type === "token") {
        stream._token(line.text, line.logprobs);
        return;
      }
      if (line.type === "queued") {
        const position = toQueuePosition(line);
        if (position === null) return;
        stream._queued(position);
        if (typeof onQueued === "function" && !stream.finished) {
          try {
            onQueued(position);
          } catch (error) {
            stream._abort(error); // cancels the request; the iteration throws it
          }
        }
        return;
      }
      if (line.type !== "done" && line.type !== "error") return; // newer than this client
      call.ended = true;
      detach();
      if (line.type === "done") stream._done(line);
      else stream._fail(toError(line));
    };
    call.fail = (error) => {
      call.ended = true;
      detach();
      stream._fail(error);
    };
    if (signal?.aborted) {
      call.ended = true;
      stream._abort(signal.reason);
      return stream;
    }
    try {
      this.#send({ ...base, ...fields, id, stream: true }, call);
    } catch (error) {
      call.ended = true;
      stream._fail(error);
      return stream;
    }
    signal?.addEventListener("abort", onAbort, { once: true });
    return stream;
  }

  // A caller lost interest in a running request: ask the daemon to stop it. Its remaining
  // lines still arrive (ending with `done`, finish_reason "cancelled") and are dropped.
  #abandon(call) {
    if (call.ended || call.cancelSent || this.#closing !== null) {
      return;
    }
    call.cancelSent = true;
    this.#request({ op: "cancel", target: call.id }).catch(() => {});
  }

  #onData(socket, chunk) {
    if (socket !== this.#socket) return;
    const data = this.#buffer.length === 0 ? chunk : this.#buffer + chunk;
    let start = 0;
    let end;
    while ((end = data.indexOf("\n", start)) !== -1) {
      const line = data.slice(start, end);
      start = end + 1;
      this.#onLine(line);
      if (socket !== this.#socket) return; // the connection was dropped
    }
    this.#buffer = start === 0 ? data : data.slice(start);
  }

  #onLine(text) {
    let line;
    try {
      line = JSON.parse(text);
    } catch {
      if (text.trim() === "") return;
      this.#protocolError(`the daemon sent a line that is not JSON: ${text.slice(0, 200)}`);
      return;
    }
    const call = this.#pending[0];
    if (call === undefined || (line.id !== call.id && line.type !== "error")) {
      // Errors about the connection itself (too_many_connections, forbidden) can come
      // before any request and carry an id of the daemon's own.
      if (line.type === "error") {
        this.#unsolicited = toError(line);
        if (CLOSING_CODES.has(line.code)) this.#drop(this.#unsolicited);
      } else if (call === undefined) {
        this.#protocolError(`unexpected reply: ${text.slice(0, 200)}`);
      }
      return;
    }
    // A generation ends with `done` or `error`; its other lines (token, queued, a type
    // newer than this client) come before. Any other request has one line.
    if (!call.generation || line.type === "done" || line.type === "error") this.#pending.shift();
    call.line(line);
    if (line.type === "error" && CLOSING_CODES.has(line.code)) {
      // Known now, not at EOF: the next request must not be written to this connection.
      this.#drop(toError(line));
    }
  }

  #protocolError(message) {
    this.#drop(new SfcoreError("protocol", message));
  }

  // Give up the connection: the requests waiting on it fail with `error`; the next
  // request connects again.
  #drop(error) {
    const socket = this.#socket;
    this.#socket = null;
    socket.destroy();
    this.#failPending(error);
  }

  #onClose(socket) {
    if (socket !== this.#socket) return;
    this.#socket = null;
    socket.destroy();
    let error = this.#unsolicited;
    if (error === null) {
      const why = this.#closing !== null ? "the client closed the connection"
        : this.#socketError !== null ? `connection to the daemon failed: ${this.#socketError.message}`
          : "the daemon closed the connection";
      error = new SfcoreConnectionError("disconnected", this.path, `${this.path}: ${why}`,
        this.#socketError ?? undefined);
    }
    this.#failPending(error);
  }
}

if (typeof Symbol.asyncDispose === "symbol") {
  Client.prototype[Symbol.asyncDispose] = function dispose() {
    return this.close();
  };
}
