// Package sfcore is a client for the sfcore-ai daemon: NDJSON over a Unix socket,
// standard library only.
//
//	client, err := sfcore.Dial(ctx, "") // $SFCORE_SOCKET, else /tmp/sfcore-ai.sock
//	if err != nil { ... }
//	defer client.Close()
//	res, err := client.Generate(ctx, "Hello", &sfcore.Options{MaxTokens: sfcore.Int(32)})
//	res, err = client.StreamGenerate(ctx, "Hello", nil, func(piece string) error {
//		fmt.Print(piece)
//		return nil
//	})
//
// A Client is one connection and is safe for concurrent use: requests are pipelined on
// the connection, and since the daemon answers them in request order, every reply line
// goes to the oldest unfinished request (checked against its id). Cancelling the context
// of a call sends `cancel` for its request, which frees the daemon's slot, and the call
// returns ctx.Err().
package sfcore

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
)

// DefaultSocketPath is where the daemon listens unless configured otherwise.
const DefaultSocketPath = "/tmp/sfcore-ai.sock"

// Error is an `error` line from the daemon. Code is one of the protocol's error codes:
// bad_json, invalid_request, context_overflow, queue_full, line_too_long,
// too_many_connections, forbidden, shutting_down, internal, grammar_dead_end.
type Error struct {
	Code    string
	Message string
	// ID is the raw JSON id the error line carried.
	ID json.RawMessage
}

func (e *Error) Error() string { return "sfcore: " + e.Code + ": " + e.Message }

// ConnError means the daemon could not be reached (Op "dial") or the connection failed
// or was closed while requests were outstanding (Op "read", "write").
type ConnError struct {
	Path string
	Op   string
	Err  error
}

func (e *ConnError) Error() string {
	if e.Op == "dial" {
		return fmt.Sprintf("sfcore: cannot connect to the daemon at %s (%v); the daemon may "+
			"not be running: start it (scripts/run.sh) or set SFCORE_SOCKET to its socket path",
			e.Path, e.Err)
	}
	return fmt.Sprintf("sfcore: connection to %s: %s: %v", e.Path, e.Op, e.Err)
}

func (e *ConnError) Unwrap() error { return e.Err }

// After an error line with one of these codes the daemon closes the connection.
var closingCodes = map[string]bool{"line_too_long": true, "too_many_connections": true,
	"forbidden": true, "shutting_down": true}

// ErrClosed is the cause (in a ConnError) for calls on, or cut short by, Client.Close.
var ErrClosed = errors.New("client closed")

// ErrStreamClosed is what Stream.Err reports after Stream.Close ended it early.
var ErrStreamClosed = errors.New("sfcore: stream closed before its reply ended")

// Message is one chat message.
type Message struct {
	Role    string `json:"role"` // "system", "user", "assistant" or "tool"
	Content string `json:"content"`
	// ToolCalls are an assistant's calls (Result.ToolCalls as they came), sent back with
	// the conversation together with a "tool" message per result.
	ToolCalls []ToolCall `json:"tool_calls,omitempty"`
	// ToolCallID is, in a "tool" message, the ID of the call whose result Content is.
	ToolCallID string `json:"tool_call_id,omitempty"`
}

// Tool is a function the model may call, in OpenAI's shape. An empty Type is sent as
// "function", the only kind.
type Tool struct {
	Type     string       `json:"type"`
	Function FunctionSpec `json:"function"`
}

// MarshalJSON sends an empty Type as "function".
func (t Tool) MarshalJSON() ([]byte, error) {
	type plain Tool // without this method
	if t.Type == "" {
		t.Type = "function"
	}
	return json.Marshal(plain(t))
}

// FunctionSpec describes a function: Name (1-64 of A-Z a-z 0-9 _ . -, unique among the
// tools), what it does, and Parameters, a JSON Schema of its arguments object (the
// structured-output subset; nil: any object).
type FunctionSpec struct {
	Name        string         `json:"name"`
	Description string         `json:"description,omitempty"`
	Parameters  map[string]any `json:"parameters,omitempty"`
	// Strict is OpenAI's flag; accepted, and the arguments always validate anyway.
	Strict *bool `json:"strict,omitempty"`
}

// ToolChoice says whether and which functions an answer calls: Mode "auto" (the default
// with tools: text, or calls once the model starts one), "required" (one or more calls),
// "none" (text), or Function, a function's name: exactly one call of it. Use
// ToolChoiceAuto, ToolChoiceRequired, ToolChoiceNone or CallFunction.
type ToolChoice struct {
	Mode     string
	Function string
}

// The tool choices without a function (shared values: do not modify them).
var (
	ToolChoiceAuto     = &ToolChoice{Mode: "auto"}
	ToolChoiceRequired = &ToolChoice{Mode: "required"}
	ToolChoiceNone     = &ToolChoice{Mode: "none"}
)

// CallFunction is the ToolChoice of exactly one call of the function name.
func CallFunction(name string) *ToolChoice { return &ToolChoice{Function: name} }

// MarshalJSON writes the protocol's form: the Mode's string, or {"type": "function",
// "function": {"name": Function}}.
func (t ToolChoice) MarshalJSON() ([]byte, error) {
	if t.Function == "" {
		return json.Marshal(t.Mode)
	}
	type name struct {
		Name string `json:"name"`
	}
	return json.Marshal(struct {
		Type     string `json:"type"`
		Function name   `json:"function"`
	}{"function", name{t.Function}})
}

// ToolCall is a call the model made (Result.ToolCalls): the function's name, one of the
// request's tools, and its arguments, valid against that tool's Parameters.
type ToolCall struct {
	ID       string       `json:"id"` // "call_...": a "tool" message answers it by this ID
	Type     string       `json:"type,omitempty"`
	Function FunctionCall `json:"function"`
}

// FunctionCall is the function a ToolCall calls. Arguments is the JSON object the daemon
// sent (not JSON text as in OpenAI's API); its numbers are float64, as encoding/json
// decodes them into any. Decode reads them into a struct of yours instead.
type FunctionCall struct {
	Name      string         `json:"name"`
	Arguments map[string]any `json:"arguments"`
}

// Decode stores the arguments in the value v points to, as json.Unmarshal would.
func (f FunctionCall) Decode(v any) error {
	b, err := json.Marshal(f.Arguments)
	if err != nil {
		return err
	}
	return json.Unmarshal(b, v)
}

// Options are the protocol's generation fields. A nil field means the daemon's default;
// use Int, Float and Bool to set one (Float(0) is greedy decoding, not "unset").
type Options struct {
	MaxTokens     *int     `json:"max_tokens,omitempty"`
	Temperature   *float64 `json:"temperature,omitempty"`
	TopK          *int     `json:"top_k,omitempty"`
	TopP          *float64 `json:"top_p,omitempty"`
	MinP          *float64 `json:"min_p,omitempty"`
	RepeatPenalty *float64 `json:"repeat_penalty,omitempty"`
	// OpenAI's penalties, -2 to 2 (0 disables): subtracted from the logit of each token
	// among the last 64, once per occurrence (frequency) or once (presence).
	FrequencyPenalty *float64 `json:"frequency_penalty,omitempty"`
	PresencePenalty  *float64 `json:"presence_penalty,omitempty"`
	Seed             *int64   `json:"seed,omitempty"`
	Stop             []string `json:"stop,omitempty"`
	CachePrompt      *bool    `json:"cache_prompt,omitempty"`
	// Speculative set to Bool(false) stops the daemon from drafting tokens for the request.
	Speculative *bool `json:"speculative,omitempty"`
	// Logprobs N (0 to 20): Result.Logprobs gets each generated token's log-probability
	// and its N likeliest alternatives.
	Logprobs *int `json:"logprobs,omitempty"`

	// Structured output: set at most one of JSONSchema, Format and Grammar (the daemon
	// answers invalid_request to more). JSONSchema is a JSON Schema object, sent as is:
	// json.RawMessage(`{"type": "object", ...}`), or marshal a map or struct into it.
	JSONSchema json.RawMessage `json:"json_schema,omitempty"`
	// Format "json": the output is one JSON object (any keys and values).
	Format string `json:"format,omitempty"`
	// Grammar is GBNF text (llama.cpp's format; the start rule is root).
	Grammar string `json:"grammar,omitempty"`

	// Tool calls, for Chat and its streaming forms only (Generate answers invalid_request):
	// the functions the model may call (up to 64; not with JSONSchema, Format or
	// Grammar), whether and which it calls (nil: "auto"), and ParallelToolCalls
	// Bool(false) for one call at most. An answer that called ends with FinishReason
	// "tool_calls" and Result.ToolCalls.
	Tools             []Tool      `json:"tools,omitempty"`
	ToolChoice        *ToolChoice `json:"tool_choice,omitempty"`
	ParallelToolCalls *bool       `json:"parallel_tool_calls,omitempty"`

	// Priority is PriorityInteractive (the daemon's default) or PriorityBackground: which
	// waiting requests the daemon starts first. "" is not sent (a daemon without
	// priorities refuses the field).
	Priority string `json:"priority,omitempty"`

	// OnQueued, not sent, is called with the request's place in the daemon's wait queue
	// each time a `queued` line reports it: streamed requests only (StreamGenerate,
	// StreamChat, StartGenerate, StartChat), before their first piece, on the goroutine
	// reading the stream. If it returns an error, the request is cancelled and the stream
	// ends with that error.
	OnQueued func(QueuePosition) error `json:"-"`
}

// The values of Options.Priority.
const (
	PriorityInteractive = "interactive"
	PriorityBackground  = "background"
)

// QueuePosition is a streamed request's place in the daemon's wait queue (a `queued`
// line): Position 1 is the next to start; QueueDepth requests wait in all.
type QueuePosition struct {
	Position   int `json:"position"`
	QueueDepth int `json:"queue_depth"`
}

// Int returns a pointer to n, for Options.
func Int(n int) *int { return &n }

// Int64 returns a pointer to n, for Options.Seed.
func Int64(n int64) *int64 { return &n }

// Float returns a pointer to f, for Options.
func Float(f float64) *float64 { return &f }

// Bool returns a pointer to b, for Options.
func Bool(b bool) *bool { return &b }

// Usage counts the tokens of a request.
type Usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CachedTokens     int `json:"cached_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	// Tokens drafted by speculative decoding, and those of them accepted.
	DraftedTokens  int `json:"drafted_tokens"`
	AcceptedTokens int `json:"accepted_tokens"`
	// Of those, the tokens a json_schema's grammar forced.
	ForcedDraftedTokens  int `json:"forced_drafted_tokens"`
	ForcedAcceptedTokens int `json:"forced_accepted_tokens"`
}

// Timings of a request, in milliseconds and tokens per second.
type Timings struct {
	QueuedMs     float64 `json:"queued_ms"`
	PromptMs     float64 `json:"prompt_ms"`
	PromptTokS   float64 `json:"prompt_tok_s"`
	FirstTokenMs float64 `json:"first_token_ms"`
	DecodeMs     float64 `json:"decode_ms"`
	DecodeTokS   float64 `json:"decode_tok_s"`
	TotalMs      float64 `json:"total_ms"`
	// Where the cached prompt tokens came from: "slot", "ram" or "disk" (the
	// daemon's prompt store), or "none" (empty from daemons older than the store).
	CacheSource string `json:"cache_source"`
}

// TopLogprob is one of a token's likeliest alternatives under the model. Bytes are the
// token's true bytes (a list of ints on the wire; Text replaces an incomplete character
// with U+FFFD). Marshalled again, Bytes is base64, as any []byte in encoding/json.
type TopLogprob struct {
	Token   int     `json:"token"`
	Text    string  `json:"text"`
	Bytes   []byte  `json:"bytes"`
	Logprob float64 `json:"logprob"` // natural log of its probability, <= 0
}

// TokenLogprob is a generated token, its log-probability under the model and (Logprobs
// N > 0) its N likeliest alternatives, best first.
type TokenLogprob struct {
	Token       int          `json:"token"`
	Text        string       `json:"text"`
	Bytes       []byte       `json:"bytes"`
	Logprob     float64      `json:"logprob"`
	TopLogprobs []TopLogprob `json:"top_logprobs"`
}

// Result is a finished generation.
type Result struct {
	ID   int64
	Text string // the whole completion, streamed or not
	// FinishReason is "stop", "stop_sequence", "length", "cancelled", or "tool_calls"
	// (the answer called functions: ToolCalls; Text is what came before, usually "").
	FinishReason string
	StopSequence string // the stop string that matched, else ""
	// Truncated: the daemon closed a JSON document (JSONSchema, Format) early because
	// max_tokens was near; false when the done line does not say so.
	Truncated bool
	Usage     Usage
	Timings   Timings
	// Logprobs: one entry per completion token, in order, when the request asked for
	// them (a stop sequence drops those of tokens wholly inside it); nil when it did not.
	Logprobs []TokenLogprob
	// ToolCalls are the calls of an answer that called (FinishReason "tool_calls"), each
	// valid against its tool's Parameters; nil otherwise.
	ToolCalls []ToolCall
}

// Health is the `health` reply.
type Health struct {
	Status     string  `json:"status"` // "ok", "loading" or "draining"
	Model      string  `json:"model"`
	Busy       bool    `json:"busy"`
	QueueDepth int     `json:"queue_depth"`
	UptimeS    float64 `json:"uptime_s"`
	// Raw is the whole reply line.
	Raw json.RawMessage `json:"-"`
}

// Info is the `info` reply.
type Info struct {
	Model struct {
		Path            string `json:"path"`
		Name            string `json:"name"`
		Architecture    string `json:"architecture"`
		NParams         int64  `json:"n_params"`
		NCtxTrain       int    `json:"n_ctx_train"`
		NVocab          int    `json:"n_vocab"`
		SizeBytes       int64  `json:"size_bytes"`
		HasChatTemplate bool   `json:"has_chat_template"`
	} `json:"model"`
	Config struct {
		NCtx          int     `json:"n_ctx"`
		Threads       int     `json:"threads"`
		ThreadsBatch  int     `json:"threads_batch"`
		Batch         int     `json:"batch"`
		Ubatch        int     `json:"ubatch"`
		CPUAffinity   []int   `json:"cpu_affinity"`
		Mmap          bool    `json:"mmap"`
		Mlock         bool    `json:"mlock"`
		HugePageBytes int64   `json:"huge_page_bytes"`
		GPULayers     int     `json:"gpu_layers"`
		FlashAttn     any     `json:"flash_attn"` // true, false or "auto"
		Reproducible  bool    `json:"reproducible"`
		ChatTemplate  *string `json:"chat_template"`
	} `json:"config"`
	SystemInfo string            `json:"system_info"`
	Versions   map[string]string `json:"versions"` // sfcore, llama_cpp_python, llama_cpp
	Raw        json.RawMessage   `json:"-"`
}

// Stats is the `stats` reply: counters since the daemon started.
type Stats struct {
	UptimeS  float64 `json:"uptime_s"`
	Requests struct {
		Total     int            `json:"total"`
		ByOp      map[string]int `json:"by_op"`
		ByOutcome map[string]int `json:"by_outcome"`
	} `json:"requests"`
	Tokens struct {
		Prompt    int `json:"prompt"`
		Cached    int `json:"cached"`
		Generated int `json:"generated"`
	} `json:"tokens"`
	Errors      map[string]int `json:"errors"`
	Connections struct {
		Current  int `json:"current"`
		Total    int `json:"total"`
		Rejected int `json:"rejected"`
	} `json:"connections"`
	DecodeTokS float64         `json:"decode_tok_s"`
	Raw        json.RawMessage `json:"-"`
}

// CacheState is one state the daemon's prompt store holds.
type CacheState struct {
	// Tokens is the stored prefix's length: a prompt that starts with its text restores it.
	Tokens int `json:"tokens"`
	// Bytes is the state's size (in RAM; its file adds a header).
	Bytes int64 `json:"bytes"`
	// RAM and Disk say where it is kept.
	RAM  bool `json:"ram"`
	Disk bool `json:"disk"`
	// Preview is the first 80 characters of its text.
	Preview string `json:"preview"`
	// PinnedS is how many seconds a cache mark keeps it pinned (evicted after every
	// unpinned state); 0 when it is not pinned.
	PinnedS int `json:"pinned_s"`
}

// CacheReply is the `cache` reply: what the prompt store holds, and what a clear removed.
type CacheReply struct {
	// Enabled is false when the store is off (by config, or in reproducible mode); then
	// States is empty and a clear does nothing.
	Enabled bool `json:"enabled"`
	// Dir is the folder of this model and build's state files; "" without a disk tier
	// (null in the reply).
	Dir string `json:"dir"`
	// States are the stored states, most recently used first; empty (not nil) after a
	// clear.
	States []CacheState `json:"states"`
	// What a clear removed: states forgotten (RAM and disk), files and their bytes
	// removed from Dir. 0 for a list.
	RemovedStates int             `json:"removed_states"`
	RemovedFiles  int             `json:"removed_files"`
	RemovedBytes  int64           `json:"removed_bytes"`
	Raw           json.RawMessage `json:"-"`
}

// line is one reply line: the fields of token, done, error and queued lines. The fields of the
// other replies are decoded from raw by the call that asked for them.
type line struct {
	Type         string          `json:"type"`
	ID           json.RawMessage `json:"id"`
	Text         string          `json:"text"`
	FinishReason string          `json:"finish_reason"`
	StopSequence *string         `json:"stop_sequence"`
	Truncated    bool            `json:"truncated"`
	Usage        Usage           `json:"usage"`
	Timings      Timings         `json:"timings"`
	Code         string          `json:"code"`
	Message      string          `json:"message"`
	// Token and done lines of a request that asked for logprobs; nil when absent.
	Logprobs []TokenLogprob `json:"logprobs"`
	// The done line of an answer that called.
	ToolCalls []ToolCall `json:"tool_calls"`
	// A queued line's place (nil when absent).
	Position   *int `json:"position"`
	QueueDepth *int `json:"queue_depth"`
	raw        []byte
}

// envelope is what every reply line has.
type envelope struct {
	Type string          `json:"type"`
	ID   json.RawMessage `json:"id"`
}

// parseLine decodes one reply line (its trailing newline included or not). It returns
// nil, nil for a blank line.
func parseLine(b []byte) (*line, error) {
	if len(bytes.TrimSpace(b)) == 0 {
		return nil, nil
	}
	l := &line{raw: b}
	if err := json.Unmarshal(b, l); err != nil {
		// A reply of another type may use one of these names differently: keep its type
		// and id, the rest stays in raw.
		var env envelope
		if json.Unmarshal(b, &env) != nil {
			return nil, fmt.Errorf("reply line is not a JSON object (%v): %.200q", err, b)
		}
		l = &line{Type: env.Type, ID: env.ID, raw: b}
	}
	if l.Type == "" {
		return nil, fmt.Errorf("reply line without a type: %.200q", b)
	}
	return l, nil
}

// call is one request waiting for its reply lines.
type call struct {
	id       int64
	idJSON   []byte
	lines    chan *line    // closed by the reader if the connection fails first
	gone     chan struct{} // closed when the caller stops waiting
	goneOnce sync.Once
	finished bool  // its final line was read, or its connection failed (guarded by Client.mu)
	err      error // why lines was closed (set before closing it)
	// generation: a generate or chat request, whose reply ends only with done or error
	// (token, queued and line types newer than this client come before). Set before send.
	generation bool
}

func (cl *call) abandon() { cl.goneOnce.Do(func() { close(cl.gone) }) }

// Client is a connection to the daemon. If the connection ends (the daemon closes
// connections idle for its idle_timeout_s, or restarts), the calls waiting on it fail
// with a *ConnError and the next call dials again.
type Client struct {
	path   string
	nextID int64 // atomic

	wmu sync.Mutex // orders writes together with their place in pending; held to redial

	mu          sync.Mutex
	conn        net.Conn
	readerDone  chan struct{} // closed when conn's reader has failed every call and exited
	pending     []*call       // in request order
	err         error         // why conn ended (nil while it is up)
	unsolicited *Error        // an error line on conn that came with no request waiting
	closed      bool          // Close was called
	// Closed by Close: a reader blocked handing a line to a stream nobody reads (its
	// buffer full) gives up the line, so it can see the connection close and exit.
	shut chan struct{}
}

// Dial connects to the daemon at path; an empty path means $SFCORE_SOCKET, else
// DefaultSocketPath. A failure is a *ConnError naming the path.
func Dial(ctx context.Context, path string) (*Client, error) {
	if path == "" {
		path = os.Getenv("SFCORE_SOCKET")
	}
	if path == "" {
		path = DefaultSocketPath
	}
	conn, err := dial(ctx, path)
	if err != nil {
		return nil, err
	}
	c := &Client{path: path, shut: make(chan struct{})}
	c.attach(conn)
	return c, nil
}

func dial(ctx context.Context, path string) (net.Conn, error) {
	var dialer net.Dialer
	conn, err := dialer.DialContext(ctx, "unix", path)
	if err != nil {
		var opErr *net.OpError
		if errors.As(err, &opErr) && opErr.Err != nil {
			err = opErr.Err // "connect: no such file or directory", without the path again
		}
		return nil, &ConnError{Path: path, Op: "dial", Err: err}
	}
	return conn, nil
}

// attach makes conn the connection and starts its reader (c.mu held or no other user).
func (c *Client) attach(conn net.Conn) {
	c.conn = conn
	c.readerDone = make(chan struct{})
	c.err = nil
	c.unsolicited = nil
	go c.readLoop(conn, c.readerDone)
}

// redial replaces a connection that has ended (c.wmu held).
func (c *Client) redial(ctx context.Context) error {
	c.mu.Lock()
	done := c.readerDone
	c.mu.Unlock()
	<-done // the old reader has failed its calls
	conn, err := dial(ctx, c.path)
	if err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		conn.Close()
		return &ConnError{Path: c.path, Op: "write", Err: ErrClosed}
	}
	c.attach(conn)
	return nil
}

// Path is the socket path of the connection.
func (c *Client) Path() string { return c.path }

// Close closes the connection. Requests still running are stopped by the daemon (it
// cancels the requests of a client that has gone); calls still waiting fail with a
// *ConnError wrapping ErrClosed.
func (c *Client) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	if c.err == nil {
		c.err = &ConnError{Path: c.path, Op: "read", Err: ErrClosed}
	}
	conn, done := c.conn, c.readerDone
	c.mu.Unlock()
	close(c.shut)
	err := conn.Close()
	<-done
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}

// --- generation ------------------------------------------------------------------------

type genRequest struct {
	Op       string    `json:"op"`
	ID       int64     `json:"id"`
	Prompt   *string   `json:"prompt,omitempty"`
	Messages []Message `json:"messages,omitempty"`
	Stream   bool      `json:"stream"`
	*Options
}

// Generate completes prompt and returns the whole result (one `done` line, stream=false).
func (c *Client) Generate(ctx context.Context, prompt string, opts *Options) (*Result, error) {
	s, err := c.start(ctx, genRequest{Op: "generate", Prompt: &prompt, Options: opts})
	return c.collect(s, err, nil)
}

// Chat generates the assistant's turn after messages, through the model's chat template.
func (c *Client) Chat(ctx context.Context, messages []Message, opts *Options) (*Result, error) {
	s, err := c.start(ctx, genRequest{Op: "chat", Messages: messages, Options: opts})
	return c.collect(s, err, nil)
}

// StreamGenerate streams the completion of prompt: onPiece gets each piece of text as it
// arrives. If onPiece returns an error, the request is cancelled and that error returned.
// The Result's Text is the whole completion.
func (c *Client) StreamGenerate(ctx context.Context, prompt string, opts *Options,
	onPiece func(piece string) error) (*Result, error) {
	s, err := c.start(ctx, genRequest{Op: "generate", Prompt: &prompt, Options: opts, Stream: true})
	return c.collect(s, err, onPiece)
}

// StreamChat is StreamGenerate for chat messages.
func (c *Client) StreamChat(ctx context.Context, messages []Message, opts *Options,
	onPiece func(piece string) error) (*Result, error) {
	s, err := c.start(ctx, genRequest{Op: "chat", Messages: messages, Options: opts, Stream: true})
	return c.collect(s, err, onPiece)
}

// StartGenerate sends a streaming generate request and returns its Stream, to read with
// Next (and to cancel by its ID from elsewhere). Close the Stream if you stop early.
func (c *Client) StartGenerate(ctx context.Context, prompt string, opts *Options) (*Stream, error) {
	return c.start(ctx, genRequest{Op: "generate", Prompt: &prompt, Options: opts, Stream: true})
}

// StartChat is StartGenerate for chat messages.
func (c *Client) StartChat(ctx context.Context, messages []Message, opts *Options) (*Stream, error) {
	return c.start(ctx, genRequest{Op: "chat", Messages: messages, Options: opts, Stream: true})
}

func (c *Client) start(ctx context.Context, req genRequest) (*Stream, error) {
	cl := c.newCall()
	cl.generation = true
	req.ID = cl.id
	if err := c.send(ctx, req, cl); err != nil {
		return nil, err
	}
	s := &Stream{c: c, cl: cl, ctx: ctx, streaming: req.Stream}
	if req.Options != nil {
		s.onQueued = req.Options.OnQueued
	}
	return s, nil
}

func (c *Client) collect(s *Stream, err error, onPiece func(string) error) (*Result, error) {
	if err != nil {
		return nil, err
	}
	for s.Next() {
		if onPiece != nil {
			if err := onPiece(s.Text()); err != nil {
				s.Close()
				return nil, err
			}
		}
	}
	return s.Result(), s.Err()
}

// Stream is a generation being received, read like a bufio.Scanner:
//
//	for stream.Next() { fmt.Print(stream.Text()) }
//	if err := stream.Err(); err != nil { ... }
//	res := stream.Result()
type Stream struct {
	c         *Client
	cl        *call
	ctx       context.Context
	streaming bool
	piece     string
	text      strings.Builder
	entries   []TokenLogprob // the token lines' logprobs entries, for the Result
	res       *Result
	err       error
	done      bool
	onQueued  func(QueuePosition) error
	queued    *QueuePosition // the last place reported
}

// ID is the request's id, for Client.Cancel.
func (s *Stream) ID() int64 { return s.cl.id }

// Next waits for the next piece of text; false at the end of the reply, on an error (see
// Err) or when the context is cancelled (then `cancel` is sent and Err is ctx.Err()).
// While the request waits in the daemon's queue, Next calls Options.OnQueued for each
// `queued` line; it skips lines of types this client does not know.
func (s *Stream) Next() bool {
	for !s.done {
		if s.next() {
			return true
		}
	}
	return false
}

// next reads one line: true for a piece; false when the stream has ended or the line
// was not a piece (then s.done says which).
func (s *Stream) next() bool {
	select {
	case l, ok := <-s.cl.lines:
		if !ok {
			s.end(s.cl.err)
			return false
		}
		switch l.Type {
		case "token":
			s.piece = l.Text
			if s.streaming {
				s.text.WriteString(l.Text)
				s.entries = append(s.entries, l.Logprobs...)
			}
			return true
		case "done":
			text := l.Text
			if s.streaming {
				text = s.text.String()
			}
			s.res = &Result{ID: s.cl.id, Text: text, FinishReason: l.FinishReason,
				Truncated: l.Truncated, Usage: l.Usage, Timings: l.Timings,
				ToolCalls: l.ToolCalls}
			if l.StopSequence != nil {
				s.res.StopSequence = *l.StopSequence
			}
			if l.Logprobs != nil { // the done line holds the entries no token line took
				s.res.Logprobs = append(append(make([]TokenLogprob, 0,
					len(s.entries)+len(l.Logprobs)), s.entries...), l.Logprobs...)
			}
			s.entries = nil
			s.end(nil)
		case "error":
			s.end(&Error{Code: l.Code, Message: l.Message, ID: l.ID})
		case "queued":
			if l.Position == nil || l.QueueDepth == nil {
				return false
			}
			q := QueuePosition{Position: *l.Position, QueueDepth: *l.QueueDepth}
			s.queued = &q
			if s.onQueued != nil {
				if err := s.onQueued(q); err != nil {
					s.c.abandon(s.cl)
					s.end(err)
				}
			}
		default: // a line type newer than this client: skipped
		}
		return false
	case <-s.ctx.Done():
		s.c.abandon(s.cl)
		s.end(s.ctx.Err())
		return false
	}
}

func (s *Stream) end(err error) {
	s.done = true
	s.err = err
	s.piece = ""
}

// QueuePosition is the last place in the daemon's wait queue reported for the request
// (a `queued` line), or nil: it never waited, or the daemon does not report it.
func (s *Stream) QueuePosition() *QueuePosition {
	if s.queued == nil {
		return nil
	}
	q := *s.queued
	return &q
}

// Text is the piece of text Next has just received.
func (s *Stream) Text() string { return s.piece }

// Err is the error that ended the stream: an *Error for an error line, a *ConnError,
// ctx.Err(), ErrStreamClosed, or nil.
func (s *Stream) Err() error { return s.err }

// Result is the finished generation, nil until Next has returned false without an error.
func (s *Stream) Result() *Result { return s.res }

// Close ends the stream early: if the request is still running it sends `cancel` for it
// (not waiting for the answer). Closing a finished stream does nothing.
func (s *Stream) Close() {
	if s.done {
		return
	}
	s.c.abandon(s.cl)
	s.end(ErrStreamClosed)
}

// --- single-line requests --------------------------------------------------------------

// Health asks for the daemon's health line.
func (c *Client) Health(ctx context.Context) (*Health, error) {
	var h Health
	if err := c.object(ctx, map[string]any{"op": "health"}, "health", &h, &h.Raw); err != nil {
		return nil, err
	}
	return &h, nil
}

// Info describes the model, the effective configuration and versions.
func (c *Client) Info(ctx context.Context) (*Info, error) {
	var info Info
	if err := c.object(ctx, map[string]any{"op": "info"}, "info", &info, &info.Raw); err != nil {
		return nil, err
	}
	return &info, nil
}

// Stats returns the daemon's counters.
func (c *Client) Stats(ctx context.Context) (*Stats, error) {
	var st Stats
	if err := c.object(ctx, map[string]any{"op": "stats"}, "stats", &st, &st.Raw); err != nil {
		return nil, err
	}
	return &st, nil
}

// Metrics returns the counters, latency histograms and memory in Prometheus' text
// exposition format (the text GET /metrics serves on the OpenAI listener).
func (c *Client) Metrics(ctx context.Context) (string, error) {
	var reply struct {
		Text string `json:"text"`
	}
	err := c.decode(ctx, map[string]any{"op": "metrics"}, "metrics", &reply)
	return reply.Text, err
}

// Cache lists the states of the daemon's prompt store; with clear it first forgets all
// of them, in RAM and on disk (this model and build's files), and returns once the files
// are gone. What the slots hold at that moment is not a stored state and stays.
func (c *Client) Cache(ctx context.Context, clear bool) (*CacheReply, error) {
	action := "list"
	if clear {
		action = "clear"
	}
	var reply CacheReply
	err := c.object(ctx, map[string]any{"op": "cache", "action": action}, "cache", &reply,
		&reply.Raw)
	if err != nil {
		return nil, err
	}
	if reply.States == nil {
		reply.States = []CacheState{}
	}
	return &reply, nil
}

// Tokenize returns the token ids of text; addSpecial adds the BOS token as the model
// expects (the daemon's default is true).
func (c *Client) Tokenize(ctx context.Context, text string, addSpecial bool) ([]int, error) {
	var reply struct {
		Tokens []int `json:"tokens"`
	}
	err := c.decode(ctx, map[string]any{"op": "tokenize", "text": text,
		"add_special": addSpecial}, "tokens", &reply)
	if err != nil {
		return nil, err
	}
	if reply.Tokens == nil {
		reply.Tokens = []int{}
	}
	return reply.Tokens, nil
}

// Detokenize returns the text of token ids.
func (c *Client) Detokenize(ctx context.Context, tokens []int) (string, error) {
	if tokens == nil {
		tokens = []int{}
	}
	var reply struct {
		Text string `json:"text"`
	}
	err := c.decode(ctx, map[string]any{"op": "detokenize", "tokens": tokens}, "text", &reply)
	return reply.Text, err
}

// Cancel ends an earlier request of this connection (queued or running) by its id; it
// reports whether the request was still pending. The target's own reply ends with
// finish reason "cancelled" (and arrives before Cancel returns).
func (c *Client) Cancel(ctx context.Context, target int64) (bool, error) {
	var reply struct {
		Found bool `json:"found"`
	}
	err := c.decode(ctx, map[string]any{"op": "cancel", "target": target}, "cancelled", &reply)
	return reply.Found, err
}

func (c *Client) object(ctx context.Context, req map[string]any, want string, into any,
	raw *json.RawMessage) error {
	l, err := c.roundTrip(ctx, req, want)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(l.raw, into); err != nil {
		return fmt.Errorf("sfcore: decoding the %s reply: %w", want, err)
	}
	*raw = json.RawMessage(bytes.TrimSpace(l.raw))
	return nil
}

// decode sends req and decodes its reply line (of type want) into into.
func (c *Client) decode(ctx context.Context, req map[string]any, want string, into any) error {
	var raw json.RawMessage
	return c.object(ctx, req, want, into, &raw)
}

func (c *Client) roundTrip(ctx context.Context, req map[string]any, want string) (*line, error) {
	cl := c.newCall()
	req["id"] = cl.id
	if err := c.send(ctx, req, cl); err != nil {
		return nil, err
	}
	select {
	case l, ok := <-cl.lines:
		switch {
		case !ok:
			return nil, cl.err
		case l.Type == "error":
			return nil, &Error{Code: l.Code, Message: l.Message, ID: l.ID}
		case l.Type != want:
			return nil, unexpected(l, want)
		}
		return l, nil
	case <-ctx.Done():
		c.abandon(cl)
		return nil, ctx.Err()
	}
}

func unexpected(l *line, want string) error {
	return fmt.Errorf("sfcore: expected a %q reply, got %.200q", want, l.raw)
}

// --- connection ------------------------------------------------------------------------

func (c *Client) newCall() *call {
	id := atomic.AddInt64(&c.nextID, 1)
	return &call{
		id:     id,
		idJSON: strconv.AppendInt(nil, id, 10),
		lines:  make(chan *line, 64),
		gone:   make(chan struct{}),
	}
}

// send writes one request and queues its call; the call's place in the queue is the
// request's place on the wire.
func (c *Client) send(ctx context.Context, req any, cl *call) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	data, err := json.Marshal(req)
	if err != nil {
		return fmt.Errorf("sfcore: encoding the request: %w", err)
	}
	data = append(data, '\n')
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.mu.Lock()
	if c.err != nil && !c.closed {
		c.mu.Unlock()
		if err := c.redial(ctx); err != nil {
			return err
		}
		c.mu.Lock()
	}
	if c.closed {
		c.mu.Unlock()
		return &ConnError{Path: c.path, Op: "write", Err: ErrClosed}
	}
	c.pending = append(c.pending, cl)
	conn := c.conn
	c.mu.Unlock()
	deadline, _ := ctx.Deadline() // zero: none
	_ = conn.SetWriteDeadline(deadline)
	if _, err := conn.Write(data); err != nil {
		conn.Close() // the reader then fails every pending call
		return &ConnError{Path: c.path, Op: "write", Err: err}
	}
	return nil
}

// abandon: the caller stopped waiting for cl. If its request is still running, ask the
// daemon to stop it; its remaining lines are dropped as they arrive.
func (c *Client) abandon(cl *call) {
	cl.abandon()
	c.mu.Lock()
	skip := cl.finished || c.err != nil
	c.mu.Unlock()
	if skip {
		return
	}
	cancel := c.newCall()
	cancel.abandon() // nobody waits for the `cancelled` line
	_ = c.send(context.Background(), map[string]any{"op": "cancel", "id": cancel.id,
		"target": cl.id}, cancel)
}

func (c *Client) readLoop(conn net.Conn, done chan struct{}) {
	defer close(done)
	r := bufio.NewReaderSize(conn, 64<<10)
	for {
		b, err := r.ReadBytes('\n') // no line length limit: a non-streamed done can be long
		if err != nil {
			if errors.Is(err, io.EOF) {
				if len(b) > 0 {
					err = io.ErrUnexpectedEOF
				} else {
					err = errors.New("the daemon closed the connection")
				}
			}
			c.fail(&ConnError{Path: c.path, Op: "read", Err: err})
			return
		}
		l, err := parseLine(b)
		if err != nil {
			c.fail(&ConnError{Path: c.path, Op: "read", Err: err})
			conn.Close()
			return
		}
		if l != nil && !c.dispatch(l) {
			conn.Close()
			return
		}
	}
}

// dispatch hands l to its call; false if the daemon is closing the connection after it.
func (c *Client) dispatch(l *line) bool {
	closing := l.Type == "error" && closingCodes[l.Code]
	var target *call
	var rest []*call
	c.mu.Lock()
	if len(c.pending) > 0 {
		head := c.pending[0]
		// An error about the connection itself (too_many_connections, forbidden) carries
		// an id of the daemon's own; it ends whatever request is waiting.
		if bytes.Equal(l.ID, head.idJSON) || l.Type == "error" {
			target = head
			// A generation ends with done or error; any other request with its line.
			if l.Type == "error" || l.Type == "done" || (!head.generation && l.Type != "token") {
				c.pending[0] = nil
				c.pending = c.pending[1:]
				head.finished = true
			}
		}
	} else if l.Type == "error" {
		c.unsolicited = &Error{Code: l.Code, Message: l.Message, ID: l.ID}
	}
	if closing && c.err == nil {
		// Known now, not at EOF: the next call must not be written to this connection.
		c.err = &Error{Code: l.Code, Message: l.Message, ID: l.ID}
		rest = c.pending
		c.pending = nil
		for _, cl := range rest {
			cl.finished = true
		}
	}
	failure := c.err
	c.mu.Unlock()
	if target != nil {
		select {
		case target.lines <- l:
		case <-target.gone:
		case <-c.shut:
		}
	}
	for _, cl := range rest {
		cl.err = failure
		close(cl.lines)
	}
	return !closing
}

// fail ends the connection: every waiting call gets c.err (the first failure, or the
// daemon's error line if it sent one unasked) and its lines channel closed.
func (c *Client) fail(err error) {
	c.mu.Lock()
	if c.err == nil {
		if c.unsolicited != nil {
			c.err = c.unsolicited
		} else {
			c.err = err
		}
	}
	failure := c.err
	pending := c.pending
	c.pending = nil
	for _, cl := range pending {
		cl.finished = true
	}
	c.mu.Unlock()
	for _, cl := range pending {
		cl.err = failure
		close(cl.lines)
	}
}
