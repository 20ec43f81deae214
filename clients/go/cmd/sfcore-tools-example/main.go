// Command sfcore-tools-example does a tool-call round trip with the sfcore-ai daemon:
// it offers two functions, runs the calls the model makes here, sends their results back
// and prints the final answer.
//
//	go run ./cmd/sfcore-tools-example "What is the weather in Paris, and what is 2 + 3?"
//	go run ./cmd/sfcore-tools-example -tool-choice add -json "What is 2 + 3?"
//
// stdout gets one line per call (`name(arguments) -> result`) and then the answer; with
// -json, one JSON object instead: {tools, first: {finishReason, text}, calls: [{id, name,
// arguments, result}], answer: {finishReason, text, toolCalls}}. Exit status: 0 done, 1
// the daemon answered with an error line (message on stderr), 2 bad arguments, 3 the
// daemon is unreachable, 130 interrupted.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"sfcore.local/sfcore"
)

const defaultPrompt = "What is the weather in Paris, and what is 2 + 3?"

var tools = []sfcore.Tool{
	{Type: "function", Function: sfcore.FunctionSpec{
		Name: "get_weather", Description: "The weather in a city now",
		Parameters: map[string]any{"type": "object", "properties": map[string]any{
			"city": map[string]any{"type": "string", "maxLength": 40},
			"unit": map[string]any{"enum": []string{"c", "f"}}},
			"required": []string{"city"}, "additionalProperties": false}}},
	{Type: "function", Function: sfcore.FunctionSpec{
		Name: "add", Description: "The sum of two integers",
		Parameters: map[string]any{"type": "object", "properties": map[string]any{
			"a": map[string]any{"type": "integer"}, "b": map[string]any{"type": "integer"}},
			"required": []string{"a", "b"}, "additionalProperties": false}}},
}

// The functions themselves, run here: the daemon only says which to call and with what.
// Their arguments are already valid against the tools' parameters.
var functions = map[string]func(sfcore.FunctionCall) (string, error){
	"get_weather": func(call sfcore.FunctionCall) (string, error) {
		var args struct {
			City string `json:"city"`
			Unit string `json:"unit"`
		}
		if err := call.Decode(&args); err != nil {
			return "", err
		}
		temperature := "21 C"
		if args.Unit == "f" {
			temperature = "70 F"
		}
		return args.City + ": " + temperature + ", sunny", nil
	},
	"add": func(call sfcore.FunctionCall) (string, error) {
		// Integers of any size are valid here: add them as JSON numbers decode into any.
		a, _ := call.Arguments["a"].(float64)
		b, _ := call.Arguments["b"].(float64)
		return strconv.FormatFloat(a+b, 'f', -1, 64), nil
	},
}

type callRecord struct {
	ID        string         `json:"id"`
	Name      string         `json:"name"`
	Arguments map[string]any `json:"arguments"`
	Result    string         `json:"result"`
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	flags := flag.NewFlagSet("sfcore-tools-example", flag.ContinueOnError)
	flags.SetOutput(stderr)
	flags.Usage = func() {
		fmt.Fprintln(stderr, "usage: sfcore-tools-example [flags] [PROMPT...]")
		flags.PrintDefaults()
	}
	choice := flags.String("tool-choice", "auto", "auto, required, none, or a function's "+
		"name (get_weather, add): exactly one call of it")
	socket := flags.String("socket", "", "daemon socket (default: $SFCORE_SOCKET, else "+
		sfcore.DefaultSocketPath+")")
	maxTokens := flags.Int("max-tokens", 64, "most tokens per answer")
	temperature := flags.Float64("temperature", 0, "sampling temperature (0: greedy)")
	seed := flags.Int64("seed", 0, "sampler seed")
	noParallel := flags.Bool("no-parallel", false, "one call at most (parallel_tool_calls false)")
	asJSON := flags.Bool("json", false, "print the round trip as one JSON object")
	if err := flags.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	prompt := strings.Join(flags.Args(), " ")
	if prompt == "" {
		prompt = defaultPrompt
	}
	opts := sfcore.Options{MaxTokens: maxTokens, Tools: tools}
	flags.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "temperature":
			opts.Temperature = temperature
		case "seed":
			opts.Seed = seed
		}
	})
	first := opts
	switch *choice {
	case "auto", "required", "none":
		first.ToolChoice = &sfcore.ToolChoice{Mode: *choice}
	default:
		if functions[*choice] == nil {
			fmt.Fprintf(stderr, "sfcore-tools-example: -tool-choice: not auto, required, "+
				"none or a function: %s\n", *choice)
			flags.Usage()
			return 2
		}
		first.ToolChoice = sfcore.CallFunction(*choice)
	}
	first.ParallelToolCalls = sfcore.Bool(!*noParallel)

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	client, err := sfcore.Dial(ctx, *socket)
	if err != nil {
		fmt.Fprintln(stderr, "sfcore-tools-example:", err)
		return 3
	}
	defer client.Close()

	messages := []sfcore.Message{{Role: "user", Content: prompt}}
	called, err := client.Chat(ctx, messages, &first)
	if err != nil {
		return failed(ctx, err, stderr)
	}
	calls := []callRecord{}
	answer := called
	if called.FinishReason == "tool_calls" {
		// The conversation goes back with the assistant's calls and one tool message per
		// result.
		messages = append(messages, sfcore.Message{Role: "assistant", Content: called.Text,
			ToolCalls: called.ToolCalls})
		for _, call := range called.ToolCalls {
			result, err := functions[call.Function.Name](call.Function)
			if err != nil {
				result = "error: " + err.Error()
			}
			calls = append(calls, callRecord{ID: call.ID, Name: call.Function.Name,
				Arguments: call.Function.Arguments, Result: result})
			messages = append(messages, sfcore.Message{Role: "tool", Content: result,
				ToolCallID: call.ID})
		}
		if answer, err = client.Chat(ctx, messages, &opts); err != nil {
			return failed(ctx, err, stderr)
		}
	}

	if *asJSON {
		toolCalls := answer.ToolCalls
		if toolCalls == nil {
			toolCalls = []sfcore.ToolCall{}
		}
		out, err := json.Marshal(map[string]any{
			"tools": tools,
			"first": map[string]any{"finishReason": called.FinishReason, "text": called.Text},
			"calls": calls,
			"answer": map[string]any{"finishReason": answer.FinishReason, "text": answer.Text,
				"toolCalls": toolCalls},
		})
		if err != nil {
			fmt.Fprintln(stderr, "sfcore-tools-example:", err)
			return 1
		}
		fmt.Fprintln(stdout, string(out))
		return 0
	}
	for _, call := range calls {
		args, _ := json.Marshal(call.Arguments)
		fmt.Fprintf(stdout, "%s(%s) -> %s\n", call.Name, args, call.Result)
	}
	fmt.Fprintln(stdout, answer.Text)
	if answer.FinishReason == "tool_calls" {
		// This example runs one round of calls; an agent would loop until a text answer.
		names := make([]string, len(answer.ToolCalls))
		for i, call := range answer.ToolCalls {
			names[i] = call.Function.Name
		}
		fmt.Fprintf(stderr, "sfcore-tools-example: the model asked for more calls: %s\n",
			strings.Join(names, ", "))
	}
	return 0
}

func failed(ctx context.Context, err error, stderr io.Writer) int {
	var daemonErr *sfcore.Error
	var connErr *sfcore.ConnError
	switch {
	case errors.As(err, &daemonErr):
		fmt.Fprintf(stderr, "sfcore-tools-example: %s: %s\n", daemonErr.Code, daemonErr.Message)
		return 1
	case errors.As(err, &connErr):
		fmt.Fprintln(stderr, "sfcore-tools-example:", err)
		return 3
	case ctx.Err() != nil:
		return 130
	default:
		fmt.Fprintln(stderr, "sfcore-tools-example:", err)
		return 1
	}
}
