// Command sfcore-example streams a completion from the sfcore-ai daemon to stdout.
//
//	go run ./cmd/sfcore-example "Jelaskan Rust dalam 1 kalimat"
//	go run ./cmd/sfcore-example -socket /tmp/my.sock -max-tokens 32 -temperature 0 "Hello"
//
// Exit status: 0 done, 1 the daemon answered with an error line (message on stderr),
// 2 bad arguments, 3 the daemon is unreachable or the connection broke, 130 interrupted.
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

type stringList []string

func (l *stringList) String() string     { return strings.Join(*l, ",") }
func (l *stringList) Set(v string) error { *l = append(*l, v); return nil }

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	flags := flag.NewFlagSet("sfcore-example", flag.ContinueOnError)
	flags.SetOutput(stderr)
	flags.Usage = func() {
		fmt.Fprintln(stderr, "usage: sfcore-example [flags] PROMPT...")
		flags.PrintDefaults()
	}
	socket := flags.String("socket", "", "daemon socket (default: $SFCORE_SOCKET, else "+
		sfcore.DefaultSocketPath+")")
	chat := flags.Bool("chat", false, "send PROMPT as a user message through the chat template")
	maxTokens := flags.Int("max-tokens", 0, "most tokens to generate")
	temperature := flags.Float64("temperature", 0, "sampling temperature (0: greedy)")
	topK := flags.Int("top-k", 0, "top-k sampling (0 disables)")
	topP := flags.Float64("top-p", 0, "nucleus sampling")
	minP := flags.Float64("min-p", 0, "min-p sampling")
	repeatPenalty := flags.Float64("repeat-penalty", 0, "repeat penalty (1 disables)")
	seed := flags.Int64("seed", 0, "sampler seed")
	var stops stringList
	flags.Var(&stops, "stop", "stop sequence (repeatable)")
	noCache := flags.Bool("no-cache-prompt", false, "evaluate the prompt from an empty cache")
	verbose := flags.Bool("verbose", false, "print finish reason, usage and timings to stderr")
	if err := flags.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if flags.NArg() == 0 {
		fmt.Fprintln(stderr, "sfcore-example: missing PROMPT")
		flags.Usage()
		return 2
	}
	prompt := strings.Join(flags.Args(), " ")

	// Only the flags given are sent; the daemon's defaults apply to the rest.
	opts := &sfcore.Options{}
	flags.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "max-tokens":
			opts.MaxTokens = maxTokens
		case "temperature":
			opts.Temperature = temperature
		case "top-k":
			opts.TopK = topK
		case "top-p":
			opts.TopP = topP
		case "min-p":
			opts.MinP = minP
		case "repeat-penalty":
			opts.RepeatPenalty = repeatPenalty
		case "seed":
			opts.Seed = seed
		case "stop":
			opts.Stop = stops
		case "no-cache-prompt":
			opts.CachePrompt = sfcore.Bool(!*noCache)
		}
	})

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	client, err := sfcore.Dial(ctx, *socket)
	if err != nil {
		fmt.Fprintln(stderr, "sfcore-example:", err)
		return 3
	}
	defer client.Close()

	wrote := false
	onPiece := func(piece string) error {
		wrote = true
		_, err := io.WriteString(stdout, piece)
		return err
	}
	var res *sfcore.Result
	if *chat {
		messages := []sfcore.Message{{Role: "user", Content: prompt}}
		res, err = client.StreamChat(ctx, messages, opts, onPiece)
	} else {
		res, err = client.StreamGenerate(ctx, prompt, opts, onPiece)
	}
	if wrote || err == nil {
		fmt.Fprintln(stdout)
	}
	var daemonErr *sfcore.Error
	var connErr *sfcore.ConnError
	switch {
	case err == nil:
		if *verbose {
			summary, _ := json.Marshal(map[string]any{"finish_reason": res.FinishReason,
				"stop_sequence": res.StopSequence, "usage": res.Usage, "timings": res.Timings})
			fmt.Fprintln(stderr, string(summary))
		}
		return 0
	case errors.As(err, &daemonErr):
		fmt.Fprintf(stderr, "sfcore-example: %s: %s\n", daemonErr.Code, daemonErr.Message)
		return 1
	case errors.As(err, &connErr):
		fmt.Fprintln(stderr, "sfcore-example:", err)
		return 3
	case ctx.Err() != nil:
		return 130
	default:
		fmt.Fprintln(stderr, "sfcore-example:", err)
		return 1
	}
}
