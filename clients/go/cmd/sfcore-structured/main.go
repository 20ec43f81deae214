// Command sfcore-structured asks the sfcore-ai daemon for a JSON document shaped by a
// JSON Schema, and prints it.
//
//	go run ./cmd/sfcore-structured -json-schema person.json "A person as JSON:"
//	go run ./cmd/sfcore-structured -format json -chat "Describe a cat as JSON."
//	go run ./cmd/sfcore-structured -grammar yesno.gbnf "Is the sky blue? Answer:"
//
// stdout gets the document and a newline (ready for jq). Exit status: 0 a whole
// document, 1 the daemon answered with an error line (a schema it refuses is
// invalid_request; the message goes to stderr), 2 bad arguments or a file that cannot be
// read, 3 the daemon is unreachable, 4 the reply ended before the document did
// (max_tokens; what came is still printed).
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
	"strings"
	"syscall"

	"sfcore.local/sfcore"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	flags := flag.NewFlagSet("sfcore-structured", flag.ContinueOnError)
	flags.SetOutput(stderr)
	flags.Usage = func() {
		fmt.Fprintln(stderr, "usage: sfcore-structured (-json-schema FILE | -format json | "+
			"-grammar FILE) [flags] PROMPT...")
		flags.PrintDefaults()
	}
	schemaFile := flags.String("json-schema", "", "the output is a JSON document valid against "+
		"the JSON Schema in this file")
	format := flags.String("format", "", "json: the output is a JSON object")
	grammarFile := flags.String("grammar", "", "the output matches the GBNF grammar in this file")
	socket := flags.String("socket", "", "daemon socket (default: $SFCORE_SOCKET, else "+
		sfcore.DefaultSocketPath+")")
	chat := flags.Bool("chat", false, "send PROMPT as a user message through the chat template")
	maxTokens := flags.Int("max-tokens", 256, "most tokens to generate")
	temperature := flags.Float64("temperature", 0, "sampling temperature (0: greedy)")
	seed := flags.Int64("seed", 0, "sampler seed")
	noCache := flags.Bool("no-cache-prompt", false, "evaluate the prompt from an empty cache")
	if err := flags.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	usage := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "sfcore-structured: "+format+"\n", a...)
		flags.Usage()
		return 2
	}
	if flags.NArg() == 0 {
		return usage("missing PROMPT")
	}
	prompt := strings.Join(flags.Args(), " ")

	opts := &sfcore.Options{MaxTokens: maxTokens, Format: *format}
	// More than one of -json-schema, -format and -grammar is sent as given: the daemon
	// answers invalid_request.
	if *schemaFile != "" {
		schema, err := os.ReadFile(*schemaFile)
		if err != nil {
			return usage("-json-schema: %v", err)
		}
		if !json.Valid(schema) {
			return usage("-json-schema %s: not JSON", *schemaFile)
		}
		opts.JSONSchema = schema
	}
	if *grammarFile != "" {
		grammar, err := os.ReadFile(*grammarFile)
		if err != nil {
			return usage("-grammar: %v", err)
		}
		opts.Grammar = string(grammar)
	}
	if opts.JSONSchema == nil && opts.Format == "" && opts.Grammar == "" {
		return usage("give -json-schema FILE, -format json or -grammar FILE")
	}
	flags.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "temperature":
			opts.Temperature = temperature
		case "seed":
			opts.Seed = seed
		case "no-cache-prompt":
			opts.CachePrompt = sfcore.Bool(!*noCache)
		}
	})

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	client, err := sfcore.Dial(ctx, *socket)
	if err != nil {
		fmt.Fprintln(stderr, "sfcore-structured:", err)
		return 3
	}
	defer client.Close()

	var res *sfcore.Result
	if *chat {
		res, err = client.Chat(ctx, []sfcore.Message{{Role: "user", Content: prompt}}, opts)
	} else {
		res, err = client.Generate(ctx, prompt, opts)
	}
	var daemonErr *sfcore.Error
	var connErr *sfcore.ConnError
	switch {
	case err == nil:
	case errors.As(err, &daemonErr):
		fmt.Fprintf(stderr, "sfcore-structured: %s: %s\n", daemonErr.Code, daemonErr.Message)
		return 1
	case errors.As(err, &connErr):
		fmt.Fprintln(stderr, "sfcore-structured:", err)
		return 3
	case ctx.Err() != nil:
		return 130
	default:
		fmt.Fprintln(stderr, "sfcore-structured:", err)
		return 1
	}
	fmt.Fprintln(stdout, res.Text)
	switch {
	case res.Truncated:
		fmt.Fprintln(stderr, "sfcore-structured: the daemon closed the document early (max_tokens)")
	case res.FinishReason != "stop":
		fmt.Fprintf(stderr, "sfcore-structured: the reply ended before the document did "+
			"(finish_reason %s)\n", res.FinishReason)
		return 4
	}
	return 0
}
