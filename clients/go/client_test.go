package sfcore

// Unit tests of the line parsing and the request/reply plumbing against a fake daemon
// on a real Unix socket (no model needed), and a benchmark of the per-token path.

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestParseLine(t *testing.T) {
	tok, err := parseLine([]byte(`{"type":"token","id":7,"text":"\u65e5\u672c \"q\"\n"}` + "\n"))
	if err != nil || tok.Type != "token" || string(tok.ID) != "7" || tok.Text != "日本 \"q\"\n" {
		t.Fatalf("token line: %+v %v", tok, err)
	}
	done, err := parseLine([]byte(`{"type":"done","id":"x","text":"","finish_reason":"stop_sequence",` +
		`"stop_sequence":"END","usage":{"prompt_tokens":4,"cached_tokens":1,"completion_tokens":9},` +
		`"timings":{"queued_ms":0.5,"prompt_ms":1,"prompt_tok_s":2,"first_token_ms":3,` +
		`"decode_ms":4,"decode_tok_s":5,"total_ms":6,"cache_source":"disk"}}`))
	if err != nil || done.FinishReason != "stop_sequence" || *done.StopSequence != "END" ||
		done.Usage != (Usage{PromptTokens: 4, CachedTokens: 1, CompletionTokens: 9}) || done.Timings != (Timings{QueuedMs: 0.5, PromptMs: 1, PromptTokS: 2, FirstTokenMs: 3,
		DecodeMs: 4, DecodeTokS: 5, TotalMs: 6, CacheSource: "disk"}) {
		t.Fatalf("done line: %+v %v", done, err)
	}
	e, err := parseLine([]byte(`{"type":"error","id":"sfc-3","code":"bad_json","message":"m"}`))
	if err != nil || e.Code != "bad_json" || e.Message != "m" || string(e.ID) != `"sfc-3"` {
		t.Fatalf("error line: %+v %v", e, err)
	}
	// Other replies may use the same names differently (stats: "tokens" is an object).
	st, err := parseLine([]byte(`{"type":"stats","id":3,"tokens":{"prompt":1},"text":{}}`))
	if err != nil || st.Type != "stats" || string(st.ID) != "3" {
		t.Fatalf("stats line: %+v %v", st, err)
	}
	if l, err := parseLine([]byte(" \r\n")); l != nil || err != nil {
		t.Fatalf("blank line: %+v %v", l, err)
	}
	for _, bad := range []string{"not json\n", "[1,2]\n", `{"id":1}`} {
		if _, err := parseLine([]byte(bad)); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

// fakeDaemon serves every connection: serve gets each request line and writes replies;
// returning false closes the connection.
func fakeDaemon(t testing.TB, serve func(req map[string]any, w *bufio.Writer) bool) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "sfgo")
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "d.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ln.Close()
		os.RemoveAll(dir)
	})
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				r := bufio.NewReader(conn)
				w := bufio.NewWriterSize(conn, 1<<16)
				for {
					b, err := r.ReadBytes('\n')
					if err != nil {
						return
					}
					var req map[string]any
					if err := json.Unmarshal(b, &req); err != nil {
						return
					}
					more := serve(req, w)
					if w.Flush() != nil || !more {
						return
					}
				}
			}()
		}
	}()
	return path
}

func reply(w *bufio.Writer, v map[string]any) {
	b, _ := json.Marshal(v)
	w.Write(b)
	w.WriteByte('\n')
}

func mustDial(t testing.TB, path string) *Client {
	t.Helper()
	c, err := Dial(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestLongNonStreamedDone(t *testing.T) {
	long := strings.Repeat("日本語のテキスト ", 40000) // ~1 MiB, far past bufio.Scanner's 64 KiB
	path := fakeDaemon(t, func(req map[string]any, w *bufio.Writer) bool {
		reply(w, map[string]any{"type": "done", "id": req["id"], "text": long,
			"finish_reason": "length", "stop_sequence": nil,
			"usage": map[string]int{"completion_tokens": 3}, "timings": map[string]float64{}})
		return true
	})
	res, err := mustDial(t, path).Generate(context.Background(), "p", &Options{MaxTokens: Int(3)})
	if err != nil || res.Text != long || res.FinishReason != "length" ||
		res.Usage.CompletionTokens != 3 || res.StopSequence != "" {
		t.Fatalf("%v %v", err, res != nil && res.Text == long)
	}
}

func TestStructuredOutputFieldsAndTruncated(t *testing.T) {
	// Unset structured fields are not sent at all (the daemon takes at most one of them).
	b, err := json.Marshal(genRequest{Op: "generate", ID: 1, Options: &Options{Grammar: `root ::= "a"`}})
	if err != nil || string(b) != `{"op":"generate","id":1,"stream":false,"grammar":"root ::= \"a\""}` {
		t.Fatalf("%s %v", b, err)
	}
	requests := make(chan map[string]any, 2)
	path := fakeDaemon(t, func(req map[string]any, w *bufio.Writer) bool {
		requests <- req
		done := map[string]any{"type": "done", "id": req["id"], "text": "{}", "finish_reason": "stop"}
		if req["op"] == "chat" {
			done["finish_reason"], done["truncated"] = "length", true
		}
		reply(w, done)
		return true
	})
	c := mustDial(t, path)
	ctx := context.Background()
	schema := json.RawMessage(`{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}`)
	res, err := c.Generate(ctx, "p", &Options{JSONSchema: schema})
	if err != nil || res.Truncated || res.Text != "{}" {
		t.Fatalf("generate: %+v %v", res, err)
	}
	req := <-requests
	want := map[string]any{"type": "object", "properties": map[string]any{
		"n": map[string]any{"type": "integer"}}, "required": []any{"n"}}
	if fmt.Sprint(req["json_schema"]) != fmt.Sprint(want) || req["format"] != nil || req["grammar"] != nil {
		t.Fatalf("generate request: %v", req)
	}
	res, err = c.Chat(ctx, []Message{{Role: "user", Content: "c"}}, &Options{Format: "json"})
	if err != nil || !res.Truncated || res.FinishReason != "length" {
		t.Fatalf("chat: %+v %v", res, err)
	}
	if req := <-requests; req["format"] != "json" || req["json_schema"] != nil {
		t.Fatalf("chat request: %v", req)
	}
	// A schema that is not JSON fails before anything is sent.
	if _, err := c.Generate(ctx, "p", &Options{JSONSchema: json.RawMessage(`{type: object}`)}); err == nil ||
		!strings.Contains(err.Error(), "encoding the request") {
		t.Fatalf("bad schema: %v", err)
	}
}

func TestToolCallFieldsAndTypedCalls(t *testing.T) {
	// On the wire: the tools in OpenAI's shape (an empty Type is "function"), a named
	// choice as an object, the messages' calls and the id a tool result answers.
	call := ToolCall{ID: "call_1", Type: "function", Function: FunctionCall{Name: "add",
		Arguments: map[string]any{"a": 2.0, "b": 3.0}}}
	b, err := json.Marshal(genRequest{Op: "chat", ID: 1, Messages: []Message{
		{Role: "assistant", Content: "", ToolCalls: []ToolCall{call}},
		{Role: "tool", Content: "5", ToolCallID: "call_1"}}, Options: &Options{
		Tools: []Tool{{Function: FunctionSpec{Name: "add", Parameters: map[string]any{
			"type": "object", "properties": map[string]any{"someNumber": map[string]any{"type": "integer"}}}}}},
		ToolChoice: CallFunction("add"), ParallelToolCalls: Bool(false)}})
	want := `{"op":"chat","id":1,"messages":[` +
		`{"role":"assistant","content":"","tool_calls":[{"id":"call_1","type":"function","function":{"name":"add","arguments":{"a":2,"b":3}}}]},` +
		`{"role":"tool","content":"5","tool_call_id":"call_1"}],"stream":false,` +
		`"tools":[{"type":"function","function":{"name":"add","parameters":{"properties":{"someNumber":{"type":"integer"}},"type":"object"}}}],` +
		`"tool_choice":{"type":"function","function":{"name":"add"}},"parallel_tool_calls":false}`
	if err != nil || string(b) != want {
		t.Fatalf("request:\n%s\n%v", b, err)
	}
	for choice, want := range map[*ToolChoice]string{ToolChoiceAuto: `"auto"`,
		ToolChoiceRequired: `"required"`, ToolChoiceNone: `"none"`} {
		if b, err := json.Marshal(choice); err != nil || string(b) != want {
			t.Fatalf("%+v: %s %v", choice, b, err)
		}
	}

	requests := make(chan map[string]any, 3)
	path := fakeDaemon(t, func(req map[string]any, w *bufio.Writer) bool {
		requests <- req
		done := map[string]any{"type": "done", "id": req["id"], "text": "", "finish_reason": "stop"}
		if req["tools"] != nil {
			done["finish_reason"] = "tool_calls"
			done["tool_calls"] = []any{map[string]any{"id": "call_9", "type": "function",
				"function": map[string]any{"name": "get_weather",
					"arguments": map[string]any{"city": "Paris", "days": 3}}}}
		}
		reply(w, done)
		return true
	})
	c := mustDial(t, path)
	ctx := context.Background()
	tools := []Tool{{Type: "function", Function: FunctionSpec{Name: "get_weather"}}}
	user := []Message{{Role: "user", Content: "Weather?"}}
	res, err := c.Chat(ctx, user, &Options{Tools: tools, ToolChoice: ToolChoiceRequired})
	if err != nil {
		t.Fatal(err)
	}
	streamed, err := c.StreamChat(ctx, user, &Options{Tools: tools}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range []*Result{res, streamed} {
		if r.FinishReason != "tool_calls" || len(r.ToolCalls) != 1 {
			t.Fatalf("result: %+v", r)
		}
		got := r.ToolCalls[0]
		if got.ID != "call_9" || got.Type != "function" || got.Function.Name != "get_weather" ||
			got.Function.Arguments["city"] != "Paris" || got.Function.Arguments["days"] != 3.0 {
			t.Fatalf("call: %+v", got)
		}
		var args struct {
			City string `json:"city"`
			Days int    `json:"days"`
		}
		if err := got.Function.Decode(&args); err != nil || args.City != "Paris" || args.Days != 3 {
			t.Fatalf("decoded: %+v %v", args, err)
		}
	}
	if req := <-requests; req["tool_choice"] != "required" || req["parallel_tool_calls"] != nil ||
		fmt.Sprint(req["tools"]) != "[map[function:map[name:get_weather] type:function]]" {
		t.Fatalf("chat request: %v", req)
	}
	if req := <-requests; req["tool_choice"] != nil || req["stream"] != true {
		t.Fatalf("streamed request: %v", req)
	}
	if plain, err := c.Chat(ctx, user, nil); err != nil || plain.ToolCalls != nil ||
		plain.FinishReason != "stop" {
		t.Fatalf("without tools: %+v %v", plain, err)
	}
}

func TestLogprobsEntriesAndMetrics(t *testing.T) {
	entry := func(token int, bytes []int, logprob float64) map[string]any {
		top := map[string]any{"token": token, "text": "x", "bytes": bytes, "logprob": logprob}
		return map[string]any{"token": token, "text": "x", "bytes": bytes, "logprob": logprob,
			"top_logprobs": []any{top}}
	}
	first, second, third := entry(5, []int{0xe6, 0x97}, -0.5), entry(6, []int{0xa5}, -0.25),
		entry(7, []int{0x21}, 0)
	requests := make(chan map[string]any, 4)
	path := fakeDaemon(t, func(req map[string]any, w *bufio.Writer) bool {
		requests <- req
		id := req["id"]
		done := map[string]any{"type": "done", "id": id, "text": "日!", "finish_reason": "stop"}
		switch {
		case req["op"] == "metrics":
			reply(w, map[string]any{"type": "metrics", "id": id, "text": "# TYPE a counter\na 1\n"})
			return true
		case req["stream"] == true:
			reply(w, map[string]any{"type": "token", "id": id, "text": "日",
				"logprobs": []any{first, second}})
			reply(w, map[string]any{"type": "token", "id": id, "text": "!", "logprobs": []any{third}})
			done["text"], done["logprobs"] = "", []any{}
		case req["logprobs"] != nil:
			done["logprobs"] = []any{first, second, third}
		}
		reply(w, done)
		return true
	})
	c := mustDial(t, path)
	ctx := context.Background()
	streamed, err := c.StreamGenerate(ctx, "p", &Options{Logprobs: Int(1),
		FrequencyPenalty: Float(0.5)}, func(string) error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	if req := <-requests; req["logprobs"] != 1.0 || req["frequency_penalty"] != 0.5 {
		t.Fatalf("stream request: %v", req)
	}
	whole, err := c.Chat(ctx, []Message{{Role: "user", Content: "c"}}, &Options{Logprobs: Int(1),
		PresencePenalty: Float(-1)})
	if err != nil {
		t.Fatal(err)
	}
	if req := <-requests; req["presence_penalty"] != -1.0 {
		t.Fatalf("chat request: %v", req)
	}
	for _, res := range []*Result{streamed, whole} {
		var joined []byte
		var tokens []int
		for _, e := range res.Logprobs {
			joined = append(joined, e.Bytes...)
			tokens = append(tokens, e.Token)
		}
		if string(joined) != "日!" || fmt.Sprint(tokens) != "[5 6 7]" ||
			res.Logprobs[0].TopLogprobs[0].Logprob != -0.5 ||
			string(res.Logprobs[1].TopLogprobs[0].Bytes) != "\xa5" {
			t.Fatalf("logprobs: %+v", res.Logprobs)
		}
	}
	plain, err := c.Generate(ctx, "p", nil)
	if err != nil || plain.Logprobs != nil {
		t.Fatalf("no logprobs asked: %+v %v", plain, err)
	}
	<-requests
	text, err := c.Metrics(ctx)
	if err != nil || text != "# TYPE a counter\na 1\n" {
		t.Fatalf("metrics: %q %v", text, err)
	}
	if req := <-requests; req["op"] != "metrics" || len(req) != 2 {
		t.Fatalf("metrics request: %v", req)
	}
}

// hardNumbers are decimals a parser that does not round correctly can land a ULP off: the
// last few are halfway cases or long expansions.
var hardNumbers = []string{
	"-0.9871219318255093",
	"0.1",
	"2.2250738585072014e-308",
	"2.2250738585072011e-308",
	"5e-324",
	"1.7976931348623157e308",
	"9007199254740993",
	"-0.30000000000000004",
	"1e23",
	"8.98846567431158e307",
	"1.00000000000000011102230246251565404236316680908203125",
	"1.00000000000000011102230246251565404236316680908203125000000000000000001",
	"0." + strings.Repeat("0", 323) + "24703282292062328",
}

func TestTheDaemonsNumbersComeThroughExactly(t *testing.T) {
	// The fake daemon writes each decimal as given: re-encoding it would hand the client
	// Go's shortest form of the float instead.
	number := make(chan string, 1)
	path := fakeDaemon(t, func(req map[string]any, w *bufio.Writer) bool {
		n := <-number
		entry := `{"token":1,"text":"x","bytes":[120],"logprob":` + n +
			`,"top_logprobs":[{"token":1,"text":"x","bytes":[120],"logprob":` + n + `}]}`
		id := fmt.Sprint(req["id"])
		switch {
		case req["op"] == "stats":
			fmt.Fprintf(w, `{"type":"stats","id":%s,"uptime_s":%s,"decode_tok_s":%s}`+"\n", id, n, n)
		case req["stream"] == true:
			fmt.Fprintf(w, `{"type":"token","id":%s,"text":"x","logprobs":[%s]}`+"\n", id, entry)
			fmt.Fprintf(w, `{"type":"done","id":%s,"text":"","finish_reason":"stop","logprobs":[]}`+"\n",
				id)
		default:
			fmt.Fprintf(w, `{"type":"done","id":%s,"text":"","finish_reason":"tool_calls",`+
				`"timings":{"decode_tok_s":%s},"logprobs":[%s],"tool_calls":[{"id":"c",`+
				`"type":"function","function":{"name":"f","arguments":{"v":%s}}}]}`+"\n",
				id, n, entry, n)
		}
		return true
	})
	c := mustDial(t, path)
	ctx := context.Background()
	for _, n := range hardNumbers {
		want, err := strconv.ParseFloat(n, 64)
		if err != nil {
			t.Fatal(err)
		}
		exact := func(what string, got float64) {
			if math.Float64bits(got) != math.Float64bits(want) {
				t.Errorf("%.40s: %s is %v, not %v", n, what, got, want)
			}
		}
		number <- n
		whole, err := c.Generate(ctx, "p", &Options{Logprobs: Int(1)})
		if err != nil {
			t.Fatal(err)
		}
		exact("logprob", whole.Logprobs[0].Logprob)
		exact("top logprob", whole.Logprobs[0].TopLogprobs[0].Logprob)
		exact("timing", whole.Timings.DecodeTokS)
		exact("argument", whole.ToolCalls[0].Function.Arguments["v"].(float64))
		var args struct{ V float64 }
		if err := whole.ToolCalls[0].Function.Decode(&args); err != nil {
			t.Fatal(err)
		}
		exact("decoded argument", args.V)
		number <- n
		streamed, err := c.StreamGenerate(ctx, "p", &Options{Logprobs: Int(1)},
			func(string) error { return nil })
		if err != nil {
			t.Fatal(err)
		}
		exact("streamed logprob", streamed.Logprobs[0].Logprob)
		number <- n
		st, err := c.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		exact("stats", st.DecodeTokS)
	}
}

func TestStreamErrorAndPipelinedReplies(t *testing.T) {
	path := fakeDaemon(t, func(req map[string]any, w *bufio.Writer) bool {
		switch req["op"] {
		case "generate":
			if req["stream"] != true || req["temperature"] != 0.0 || req["seed"] != 7.0 {
				reply(w, map[string]any{"type": "error", "id": req["id"], "code": "invalid_request",
					"message": fmt.Sprint(req)})
				return true
			}
			for _, p := range []string{"a", "é", "日"} {
				reply(w, map[string]any{"type": "token", "id": req["id"], "text": p})
			}
			reply(w, map[string]any{"type": "done", "id": req["id"], "text": "",
				"finish_reason": "stop", "stop_sequence": nil})
		case "tokenize":
			reply(w, map[string]any{"type": "tokens", "id": req["id"], "tokens": []int{2, 9259}})
		default:
			reply(w, map[string]any{"type": "error", "id": req["id"], "code": "invalid_request",
				"message": "unknown op"})
		}
		return true
	})
	c := mustDial(t, path)
	ctx := context.Background()
	var pieces []string
	res, err := c.StreamGenerate(ctx, "p", &Options{Temperature: Float(0), Seed: Int64(7)},
		func(p string) error { pieces = append(pieces, p); return nil })
	if err != nil || res.Text != "aé日" || strings.Join(pieces, "|") != "a|é|日" ||
		res.FinishReason != "stop" {
		t.Fatalf("%v %+v %v", err, res, pieces)
	}
	// Concurrent calls share the connection; each gets its own reply.
	errs := make(chan error, 2)
	go func() {
		toks, err := c.Tokenize(ctx, "Hi", true)
		if err == nil && fmt.Sprint(toks) != "[2 9259]" {
			err = fmt.Errorf("tokens %v", toks)
		}
		errs <- err
	}()
	go func() {
		_, err := c.Info(ctx)
		var e *Error
		if !errors.As(err, &e) || e.Code != "invalid_request" || e.Message != "unknown op" {
			err = fmt.Errorf("want invalid_request, got %v", err)
		} else {
			err = nil
		}
		errs <- err
	}()
	for i := 0; i < 2; i++ {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
}

func TestQueuedLinesAndPriority(t *testing.T) {
	// Streamed requests wait in the queue first (queued lines, place 2 then 1), then get a
	// line of a type newer than the client, their tokens and done; a non-streamed request
	// gets the unknown line and its done. Priority goes out only when set.
	requests := make(chan map[string]any, 16)
	path := fakeDaemon(t, func(req map[string]any, w *bufio.Writer) bool {
		requests <- req
		id := req["id"]
		switch req["op"] {
		case "cancel":
			reply(w, map[string]any{"type": "done", "id": req["target"], "text": "",
				"finish_reason": "cancelled"})
			reply(w, map[string]any{"type": "cancelled", "id": id, "target": req["target"],
				"found": true})
			return true
		case "health":
			reply(w, map[string]any{"type": "health", "id": id, "status": "ok"})
			return true
		}
		if req["stream"] == true {
			reply(w, map[string]any{"type": "queued", "id": id, "position": 2, "queue_depth": 3})
			reply(w, map[string]any{"type": "queued", "id": id, "position": 1, "queue_depth": 2})
			if req["prompt"] == "wait" { // still waiting until cancelled
				return true
			}
		}
		reply(w, map[string]any{"type": "future_kind", "id": id, "position": "n/a"})
		text := "Hi!"
		if req["stream"] == true {
			text = ""
			reply(w, map[string]any{"type": "token", "id": id, "text": "Hi"})
			reply(w, map[string]any{"type": "token", "id": id, "text": "!"})
		}
		reply(w, map[string]any{"type": "done", "id": id, "text": text, "finish_reason": "stop"})
		return true
	})
	c := mustDial(t, path)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	var places []QueuePosition
	opts := &Options{Priority: PriorityBackground, OnQueued: func(q QueuePosition) error {
		places = append(places, q)
		return nil
	}}
	var pieces []string
	res, err := c.StreamGenerate(ctx, "p", opts, func(p string) error {
		pieces = append(pieces, p)
		return nil
	})
	want := []QueuePosition{{Position: 2, QueueDepth: 3}, {Position: 1, QueueDepth: 2}}
	if err != nil || res.Text != "Hi!" || res.FinishReason != "stop" ||
		strings.Join(pieces, "|") != "Hi|!" || fmt.Sprint(places) != fmt.Sprint(want) {
		t.Fatalf("stream: %+v %v %v %v", res, err, pieces, places)
	}
	// The iterator form, without a callback: the same pieces; the place is kept.
	s, err := c.StartChat(ctx, []Message{{Role: "user", Content: "c"}},
		&Options{Priority: PriorityInteractive})
	if err != nil {
		t.Fatal(err)
	}
	if s.QueuePosition() != nil {
		t.Fatalf("a place before reading: %v", s.QueuePosition())
	}
	pieces = nil
	for s.Next() {
		pieces = append(pieces, s.Text())
	}
	if s.Err() != nil || s.Result().Text != "Hi!" || strings.Join(pieces, "|") != "Hi|!" ||
		s.QueuePosition() == nil || *s.QueuePosition() != want[1] {
		t.Fatalf("iterator: %v %+v %v %v", s.Err(), s.Result(), pieces, s.QueuePosition())
	}
	// Not streamed: the unknown line is skipped.
	if res, err := c.Generate(ctx, "p", nil); err != nil || res.Text != "Hi!" {
		t.Fatalf("generate: %+v %v", res, err)
	}
	if res, err := c.Chat(ctx, []Message{{Role: "user", Content: "c"}},
		&Options{Priority: PriorityBackground}); err != nil || res.Text != "Hi!" {
		t.Fatalf("chat: %+v %v", res, err)
	}
	// OnQueued's error cancels the request and ends the stream with it.
	stop := errors.New("stop here")
	_, err = c.StreamGenerate(ctx, "wait", &Options{OnQueued: func(QueuePosition) error { return stop }},
		func(string) error { return nil })
	if !errors.Is(err, stop) {
		t.Fatalf("OnQueued error: %v", err)
	}
	if h, err := c.Health(ctx); err != nil || h.Status != "ok" {
		t.Fatalf("health after: %+v %v", h, err)
	}
	var sent []string
	for i := 0; i < 7; i++ {
		req := <-requests
		priority, ok := req["priority"]
		if !ok {
			priority = "-"
		}
		sent = append(sent, fmt.Sprint(req["op"], ":", priority))
		if _, ok := req["OnQueued"]; ok {
			t.Errorf("the callback went on the wire: %v", req)
		}
	}
	if got := strings.Join(sent, " "); got != "generate:background chat:interactive "+
		"generate:- chat:background generate:- cancel:- health:-" {
		t.Fatalf("requests on the wire: %s", got)
	}
}

func TestCache(t *testing.T) {
	// The fake store holds one state until a clear. The clear's null dir is what a daemon
	// without a disk tier sends; the last listing's null states come out as an empty slice.
	requests := make(chan map[string]any, 3)
	served := 0
	path := fakeDaemon(t, func(req map[string]any, w *bufio.Writer) bool {
		requests <- req
		served++
		switch {
		case served == 1 && req["action"] == "list":
			reply(w, map[string]any{"type": "cache", "id": req["id"], "enabled": true,
				"dir": "/tmp/p/3f9c", "states": []map[string]any{{"tokens": 1989,
					"bytes": 13945128, "ram": true, "disk": false, "preview": "You are"}},
				"removed_states": 0, "removed_files": 0, "removed_bytes": 0})
		case req["action"] == "clear":
			reply(w, map[string]any{"type": "cache", "id": req["id"], "enabled": true,
				"dir": nil, "states": []any{}, "removed_states": 1, "removed_files": 2,
				"removed_bytes": 13945200})
		default:
			reply(w, map[string]any{"type": "cache", "id": req["id"], "enabled": true,
				"dir": nil, "states": nil, "removed_states": 0, "removed_files": 0,
				"removed_bytes": 0})
		}
		return true
	})
	c := mustDial(t, path)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	want := []CacheState{{Tokens: 1989, Bytes: 13945128, RAM: true, Preview: "You are"}}
	listed, err := c.Cache(ctx, false)
	if err != nil || !listed.Enabled || listed.Dir != "/tmp/p/3f9c" || listed.RemovedStates != 0 ||
		fmt.Sprint(listed.States) != fmt.Sprint(want) ||
		!strings.Contains(string(listed.Raw), `"tokens":1989`) {
		t.Fatalf("list: %+v %v", listed, err)
	}
	cleared, err := c.Cache(ctx, true)
	if err != nil || cleared.Dir != "" || cleared.States == nil || len(cleared.States) != 0 ||
		cleared.RemovedStates != 1 || cleared.RemovedFiles != 2 || cleared.RemovedBytes != 13945200 {
		t.Fatalf("clear: %+v %v", cleared, err)
	}
	after, err := c.Cache(ctx, false)
	if err != nil || after.States == nil || len(after.States) != 0 || after.RemovedStates != 0 {
		t.Fatalf("list after clear: %+v %v", after, err)
	}
	for i, action := range []string{"list", "clear", "list"} {
		if req := <-requests; req["op"] != "cache" || req["action"] != action {
			t.Errorf("request %d: %v, want action %q", i, req, action)
		}
	}
}

func TestContextCancelSendsCancel(t *testing.T) {
	cancelled := make(chan any, 1)
	path := fakeDaemon(t, func(req map[string]any, w *bufio.Writer) bool {
		switch req["op"] {
		case "generate":
			reply(w, map[string]any{"type": "token", "id": req["id"], "text": "x"})
		case "cancel":
			cancelled <- req["target"]
			reply(w, map[string]any{"type": "done", "id": req["target"], "text": "",
				"finish_reason": "cancelled"})
			reply(w, map[string]any{"type": "cancelled", "id": req["id"], "target": req["target"],
				"found": true})
		case "health":
			reply(w, map[string]any{"type": "health", "id": req["id"], "status": "ok"})
		}
		return true
	})
	c := mustDial(t, path)
	ctx, cancel := context.WithCancel(context.Background())
	s, err := c.StartGenerate(ctx, "p", nil)
	if err != nil {
		t.Fatal(err)
	}
	if !s.Next() || s.Text() != "x" {
		t.Fatalf("first piece: %v", s.Err())
	}
	cancel()
	if s.Next() || !errors.Is(s.Err(), context.Canceled) {
		t.Fatalf("after cancel: %v", s.Err())
	}
	select {
	case target := <-cancelled:
		if target != float64(s.ID()) {
			t.Fatalf("cancel target %v, stream %d", target, s.ID())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no cancel request")
	}
	// The abandoned reply and the cancel's answer are skipped; the connection still works.
	h, err := c.Health(context.Background())
	if err != nil || h.Status != "ok" {
		t.Fatalf("health after cancel: %+v %v", h, err)
	}
}

func TestConnectionErrors(t *testing.T) {
	_, err := Dial(context.Background(), "/nonexistent/sfcore.sock")
	var ce *ConnError
	if !errors.As(err, &ce) || ce.Op != "dial" || !strings.Contains(err.Error(), "/nonexistent/sfcore.sock") ||
		!strings.Contains(err.Error(), "may not be running") || !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("dial error: %v", err)
	}
	t.Setenv("SFCORE_SOCKET", "/nonexistent/env.sock")
	if _, err := Dial(context.Background(), ""); err == nil || !strings.Contains(err.Error(), "/nonexistent/env.sock") {
		t.Fatalf("SFCORE_SOCKET not used: %v", err)
	}
	// The daemon refuses a request with an error line of its own id and closes the
	// connection (as for too_many_connections); the next call connects again.
	path := fakeDaemon(t, func(req map[string]any, w *bufio.Writer) bool {
		if req["op"] == "health" {
			reply(w, map[string]any{"type": "health", "id": req["id"], "status": "ok"})
			return true
		}
		reply(w, map[string]any{"type": "error", "id": "sfc-1", "code": "too_many_connections",
			"message": "limit"})
		return false
	})
	c := mustDial(t, path)
	_, err = c.Generate(context.Background(), "p", nil)
	var e *Error
	if !errors.As(err, &e) || e.Code != "too_many_connections" {
		t.Fatalf("want too_many_connections, got %v", err)
	}
	if h, err := c.Health(context.Background()); err != nil || h.Status != "ok" {
		t.Fatalf("no reconnection: %+v %v", h, err)
	}
	// After Close, calls fail at once.
	c.Close()
	if _, err := c.Health(context.Background()); !errors.Is(err, ErrClosed) {
		t.Fatalf("after Close: %v", err)
	}
}

func TestReconnectAfterTheDaemonClosed(t *testing.T) {
	// Every connection answers one request, then the daemon closes it (as after its idle
	// timeout): each next call dials again.
	path := fakeDaemon(t, func(req map[string]any, w *bufio.Writer) bool {
		reply(w, map[string]any{"type": "health", "id": req["id"], "status": "ok"})
		return false
	})
	c := mustDial(t, path)
	for i := 0; i < 3; i++ {
		if h, err := c.Health(context.Background()); err != nil || h.Status != "ok" {
			t.Fatalf("call %d: %+v %v", i, h, err)
		}
		// The reader of the connection this call used (taken before the call, it was the
		// previous connection's: then the next call could write on this one just as the
		// daemon closed it, and fail with "connection reset by peer").
		c.mu.Lock()
		readerDone := c.readerDone
		c.mu.Unlock()
		select {
		case <-readerDone: // the client has seen the daemon close the connection
		case <-time.After(10 * time.Second):
			t.Fatal("the daemon's close went unnoticed")
		}
	}
}

func TestCloseWithAStreamLeftUnread(t *testing.T) {
	// More token lines than a call buffers: the reader blocks handing them over until
	// someone reads the stream, or the client is closed.
	path := fakeDaemon(t, func(req map[string]any, w *bufio.Writer) bool {
		for i := 0; i < 500; i++ {
			reply(w, map[string]any{"type": "token", "id": req["id"], "text": "x"})
		}
		return true
	})
	c := mustDial(t, path)
	s, err := c.StartGenerate(context.Background(), "p", nil)
	if err != nil || !s.Next() {
		t.Fatalf("no first piece: %v", err)
	}
	closed := make(chan error, 1)
	go func() { closed <- c.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return with a stream left unread")
	}
	for s.Next() { // the buffered pieces, then the end
	}
	var connErr *ConnError
	if !errors.As(s.Err(), &connErr) || !errors.Is(s.Err(), ErrClosed) {
		t.Fatalf("the stream ended with %v", s.Err())
	}
}

// BenchmarkTokenLines measures the per-token cost of the real read path: bufio.Reader
// line reading, JSON decoding, dispatch to the call and the StreamGenerate callback, on
// token lines served from memory by a fake daemon over a Unix socket.
func BenchmarkTokenLines(b *testing.B) {
	pieces := []string{" the", " 日本", "の", " café", ",", "\n", " \"quoted\"", " model", "’s", " 2019"}
	type token struct { // the daemon's key order
		Type string `json:"type"`
		ID   int    `json:"id"`
		Text string `json:"text"`
	}
	var tokens []byte
	for i := 0; i < b.N; i++ {
		line, _ := json.Marshal(token{"token", 1, pieces[i%len(pieces)]})
		tokens = append(append(tokens, line...), '\n')
	}
	done := `{"type":"done","id":1,"text":"","finish_reason":"length","stop_sequence":null,` +
		`"usage":{"prompt_tokens":4,"cached_tokens":0,"completion_tokens":1},"timings":{}}` + "\n"
	path := fakeDaemon(b, func(req map[string]any, w *bufio.Writer) bool {
		w.Write(tokens)
		w.WriteString(done)
		return true
	})
	c := mustDial(b, path)
	n := 0
	b.ResetTimer()
	_, err := c.StreamGenerate(context.Background(), "p", nil, func(string) error { n++; return nil })
	b.StopTimer()
	if err != nil || n != b.N {
		b.Fatalf("%v: %d pieces of %d", err, n, b.N)
	}
}

// BenchmarkParseLine is the decoding part alone: one token line through parseLine.
func BenchmarkParseLine(b *testing.B) {
	line := []byte(`{"type":"token","id":1,"text":" 日本"}` + "\n")
	for i := 0; i < b.N; i++ {
		l, err := parseLine(line)
		if err != nil || l.Text != " 日本" {
			b.Fatal(l, err)
		}
	}
}
