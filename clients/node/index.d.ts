// Types of sfcore-client (index.js).

export declare const DEFAULT_SOCKET_PATH: "/tmp/sfcore-ai.sock";

export type RequestId = string | number;

/** An `error` line from the daemon (protocol codes: bad_json, invalid_request,
 * context_overflow, queue_full, line_too_long, too_many_connections, forbidden,
 * shutting_down, internal, grammar_dead_end), or a client-side failure ("unreachable",
 * "disconnected", "protocol"). */
export declare class SfcoreError extends Error {
  constructor(code: string, message: string, id?: RequestId);
  readonly code: string;
  /** The id the error line carried, if any. */
  readonly id: RequestId | undefined;
}

/** The daemon could not be reached ("unreachable") or the connection ended before the
 * replies did ("disconnected"). */
export declare class SfcoreConnectionError extends SfcoreError {
  constructor(code: string, path: string, message: string, cause?: unknown);
  readonly path: string;
}

/** A JSON Schema object, for `json_schema` (docs/protocol.md lists the keywords the
 * daemon supports; any other is refused with invalid_request). */
export type JsonSchema = { [keyword: string]: unknown };

/** A function the model may call (OpenAI's shape): its `name` (1-64 of A-Z a-z 0-9 _ . -,
 * unique among the tools), what it does, and a JSON Schema of its arguments object (the
 * structured-output subset; absent: any object). */
export interface FunctionSpec {
  name: string;
  description?: string;
  parameters?: JsonSchema;
  /** OpenAI's flag; accepted, and the arguments always validate anyway. */
  strict?: boolean;
}

export interface Tool {
  type: "function";
  function: FunctionSpec;
}

/** "auto" (the default with tools): text, or calls once the model starts one;
 * "required": one or more calls; "none": text; a named function: exactly one call of it. */
export type ToolChoice =
  | "auto"
  | "required"
  | "none"
  | { type: "function"; function: { name: string } };

/** A call the model made: the function's name (one of the request's tools) and its
 * arguments, a JSON object valid against that tool's `parameters`. */
export interface FunctionCall {
  name: string;
  arguments: { [name: string]: unknown };
}

export interface ToolCall {
  /** "call_..."; a tool message answers it by this id. */
  id: string;
  type: "function";
  function: FunctionCall;
}

/** The protocol's generation fields; snake_case or camelCase. Undefined or null: the
 * daemon's default. Any other field is sent as is (the daemon rejects unknown ones). */
export interface GenerationOptions {
  max_tokens?: number | null;
  maxTokens?: number | null;
  temperature?: number | null;
  top_k?: number | null;
  topK?: number | null;
  top_p?: number | null;
  topP?: number | null;
  min_p?: number | null;
  minP?: number | null;
  repeat_penalty?: number | null;
  repeatPenalty?: number | null;
  /** OpenAI's penalties, -2 to 2 (0 disables): subtracted from the logit of each token
   * among the last 64, once per occurrence (frequency) or once (presence). */
  frequency_penalty?: number | null;
  frequencyPenalty?: number | null;
  presence_penalty?: number | null;
  presencePenalty?: number | null;
  seed?: number | null;
  stop?: string | string[] | null;
  cache_prompt?: boolean | null;
  cachePrompt?: boolean | null;
  /** 0 to 20: each generated token's log-probability and its N likeliest alternatives
   * (`Result.logprobs`). */
  logprobs?: number | null;
  /** false: the daemon drafts no tokens for this request (speculative decoding). */
  speculative?: boolean | null;
  /** "interactive" (the daemon's default) or "background": which waiting requests the
   * daemon starts first. Sent only when given (a daemon without priorities refuses it). */
  priority?: "interactive" | "background" | null;
  /** Structured output (at most one of json_schema, format and grammar; the daemon
   * answers invalid_request otherwise): the output is a JSON document valid against this
   * JSON Schema, sent as given. */
  json_schema?: JsonSchema | null;
  jsonSchema?: JsonSchema | null;
  /** "json": the output is one JSON object (any keys and values). */
  format?: "json" | null;
  /** The output matches this GBNF grammar (llama.cpp's format; the start rule is `root`). */
  grammar?: string | null;
  /** Chat only: functions the model may call (up to 64; not with json_schema, format or
   * grammar). Sent as given. */
  tools?: Tool[] | null;
  tool_choice?: ToolChoice | null;
  toolChoice?: ToolChoice | null;
  /** false: one call at most per answer (default true). */
  parallel_tool_calls?: boolean | null;
  parallelToolCalls?: boolean | null;
  /** The request's id (default: a number counting up on this connection). */
  id?: RequestId;
  /** Aborting sends `cancel` for the request; the call rejects (or the iteration throws)
   * with the signal's reason. */
  signal?: AbortSignal;
  /** Called with the request's place in the daemon's wait queue each time a `queued` line
   * reports it (streamed requests, before their first piece). If it throws, the request
   * is cancelled and the iteration (or the call) rejects with that error. With `generate`
   * or `chat` it makes the reply streamed (the Result is the same). */
  onQueued?: (place: QueuePosition) => void;
  [field: string]: unknown;
}

/** A streamed request's place in the daemon's wait queue (a `queued` line). */
export interface QueuePosition {
  /** 1: the next request to start. */
  position: number;
  /** How many requests wait in all. */
  queueDepth: number;
}

export interface CallbackOptions extends GenerationOptions {
  /** Stream the reply and call this with each piece of text as it arrives. */
  onToken?: (piece: string) => void;
}

/** A call as a message may carry it: `type` defaults to "function", and `arguments` may
 * also be JSON text (as OpenAI's API has it); it is sent as the object it encodes. */
export interface ToolCallInput {
  id: string;
  type?: "function";
  function: { name: string; arguments: { [name: string]: unknown } | string };
}

export interface SystemOrUserMessage {
  role: "system" | "user";
  content: string;
}

/** An assistant's turn; one that called carries its calls (`result.toolCalls` as given). */
export interface AssistantMessage {
  role: "assistant";
  content: string;
  toolCalls?: ToolCallInput[];
  tool_calls?: ToolCallInput[];
}

/** A function's result, answering the call of that id. */
export type ToolMessage =
  | { role: "tool"; content: string; toolCallId: string }
  | { role: "tool"; content: string; tool_call_id: string };

export type ChatMessage = SystemOrUserMessage | AssistantMessage | ToolMessage;

export interface Usage {
  promptTokens: number;
  cachedTokens: number;
  completionTokens: number;
  /** Tokens drafted by speculative decoding, and those of them accepted. */
  draftedTokens: number;
  acceptedTokens: number;
  /** Of those, the tokens a json_schema's grammar forced (0 from older daemons). */
  forcedDraftedTokens: number;
  forcedAcceptedTokens: number;
}

export interface Timings {
  queuedMs: number;
  promptMs: number;
  promptTokS: number;
  firstTokenMs: number;
  decodeMs: number;
  decodeTokS: number;
  totalMs: number;
}

/** One of a token's likeliest alternatives under the model. */
export interface TopLogprob {
  /** The token's id. */
  token: number;
  /** Its bytes as UTF-8 (an incomplete character replaced by U+FFFD; `bytes` has the truth). */
  text: string;
  bytes: Uint8Array;
  /** Natural log of its probability, <= 0. */
  logprob: number;
}

/** A generated token, its log-probability under the model and (logprobs N > 0) its N
 * likeliest alternatives, best first. */
export interface TokenLogprob extends TopLogprob {
  topLogprobs: TopLogprob[];
}

export interface Result {
  /** The request's id. */
  id: RequestId;
  /** The whole completion (streamed or not). */
  text: string;
  /** "tool_calls": the answer called functions (`toolCalls`; `text` is what came before,
   * usually ""). */
  finishReason: "stop" | "stop_sequence" | "length" | "cancelled" | "tool_calls";
  /** The stop string that matched, else null. */
  stopSequence: string | null;
  /** true when the daemon closed a JSON document (json_schema, format) early because
   * max_tokens was near; false when the done line does not say so. */
  truncated: boolean;
  usage: Usage;
  timings: Timings;
  /** One entry per completion token (in order) when the request asked for `logprobs`
   * (a stop sequence drops those of tokens wholly inside it); null when it did not. */
  logprobs: TokenLogprob[] | null;
  /** The calls of an answer that called (finishReason "tool_calls"), each valid against
   * its tool's parameters; empty otherwise. */
  toolCalls: ToolCall[];
}

/** A streamed generation: `for await (const piece of stream)`. Leaving the loop early
 * sends `cancel` for the request. */
export declare class Stream implements AsyncIterableIterator<string> {
  /** The request's id (for `client.cancel`). */
  readonly id: RequestId;
  /** The Result once the `done` line has arrived, else null. */
  readonly result: Result | null;
  /** The text received so far. */
  readonly text: string;
  /** Whether the reply has ended (done or error). */
  readonly finished: boolean;
  /** The last place in the daemon's wait queue reported for the request; null if it
   * never waited (or the daemon does not report it). */
  readonly queuePosition: QueuePosition | null;
  /** The Result once the reply has ended; rejects with the request's error. */
  readonly completed: Promise<Result>;
  [Symbol.asyncIterator](): AsyncIterableIterator<string>;
  next(): Promise<IteratorResult<string, undefined>>;
  return(): Promise<IteratorResult<string, undefined>>;
  throw(error?: unknown): Promise<IteratorResult<string, undefined>>;
}

export interface HealthReply {
  type: "health";
  id: RequestId;
  status: "ok" | "loading" | "draining";
  model: string;
  busy: boolean;
  queue_depth: number;
  uptime_s: number;
}

export interface InfoReply {
  type: "info";
  id: RequestId;
  model: {
    path: string;
    name: string;
    architecture: string;
    n_params: number;
    n_ctx_train: number;
    n_vocab: number;
    size_bytes: number;
    has_chat_template: boolean;
  };
  config: {
    n_ctx: number;
    threads: number;
    threads_batch: number;
    batch: number;
    ubatch: number;
    cpu_affinity: number[];
    mmap: boolean;
    mlock: boolean;
    /** Bytes of the daemon's load in 2 MiB pages (0: huge_pages off or unavailable). */
    huge_page_bytes: number;
    gpu_layers: number;
    flash_attn: boolean | "auto";
    reproducible: boolean;
    chat_template: string | null;
  };
  system_info: string;
  versions: { sfcore: string; llama_cpp_python: string; llama_cpp: string };
}

export interface StatsReply {
  type: "stats";
  id: RequestId;
  uptime_s: number;
  requests: {
    total: number;
    by_op: Record<string, number>;
    by_outcome: Record<"stop" | "stop_sequence" | "length" | "cancelled" | "error", number>;
  };
  tokens: { prompt: number; cached: number; generated: number };
  errors: Record<string, number>;
  connections: { current: number; total: number; rejected: number };
  decode_tok_s: number;
}

/** A state the prompt store holds (see `Client.cache`). */
export interface CacheState {
  /** Its length in tokens: a prompt that starts with these tokens restores them. */
  tokens: number;
  /** The state's size. */
  bytes: number;
  /** Where it is kept. */
  ram: boolean;
  disk: boolean;
  /** The first 80 characters of its text. */
  preview: string;
  /** Seconds a cache mark keeps it pinned (evicted after every unpinned state); 0: none. */
  pinned_s: number;
}

export interface CacheReply {
  type: "cache";
  id: RequestId;
  /** false when the store is off (`[cache] enabled = false`, or reproducible mode); then
   * `states` is empty and a clear does nothing. */
  enabled: boolean;
  /** The folder of this model and build's state files; null without a disk tier. */
  dir: string | null;
  /** Most recently used first (empty after a clear). */
  states: CacheState[];
  /** What a clear removed; 0 for a list. */
  removed_states: number;
  removed_files: number;
  removed_bytes: number;
}

export interface ConnectOptions {
  socketPath?: string;
  /** Milliseconds to wait for the connection (default 10000; 0: no limit). */
  timeout?: number;
}

/** A connection to the daemon. Requests may be issued concurrently; they are pipelined
 * and answered in request order. If the connection ends, the requests waiting on it fail
 * with SfcoreConnectionError (or the daemon's closing error line) and the next request
 * connects again. */
export declare class Client {
  readonly path: string;
  generate(prompt: string, options?: CallbackOptions): Promise<Result>;
  chat(messages: ChatMessage[], options?: CallbackOptions): Promise<Result>;
  streamGenerate(prompt: string, options?: GenerationOptions): Stream;
  streamChat(messages: ChatMessage[], options?: GenerationOptions): Stream;
  health(): Promise<HealthReply>;
  info(): Promise<InfoReply>;
  stats(): Promise<StatsReply>;
  /** The counters in Prometheus' text exposition format (what GET /metrics serves). */
  metrics(): Promise<string>;
  /** What the prompt store holds; `clear: true` first forgets all of it (RAM and disk). */
  cache(options?: { clear?: boolean }): Promise<CacheReply>;
  tokenize(text: string, options?: { addSpecial?: boolean; add_special?: boolean }): Promise<number[]>;
  detokenize(tokens: number[]): Promise<string>;
  /** Cancel an earlier request of this connection; resolves to whether it was pending. */
  cancel(target: RequestId): Promise<boolean>;
  /** Close the connection (at once if requests are running, which stops them). */
  close(): Promise<void>;
}

/** Connect to the daemon: `socketPath`, else $SFCORE_SOCKET, else /tmp/sfcore-ai.sock.
 * Rejects with SfcoreConnectionError (code "unreachable") naming the path. */
export declare function connect(socketPath?: string, options?: ConnectOptions): Promise<Client>;
export declare function connect(options: ConnectOptions): Promise<Client>;
