//! Streams a completion to stdout.
//!
//! ```sh
//! cargo run --example generate -- "Jelaskan Rust dalam 1 kalimat"
//! cargo run --example generate -- --socket /tmp/my.sock --max-tokens 32 --temperature 0 "Hello"
//! ```
//!
//! stdout gets the generated text and a final newline; a one-line summary goes to stderr.
//! Exit status: 0 done, 1 the daemon answered with an error line (or the connection
//! failed mid-reply; the message goes to stderr), 2 bad arguments, 3 the daemon is
//! unreachable.

use std::io::{self, Write};
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::process::ExitCode;

use sfcore_client::{Client, Error, Message, Options};

const USAGE: &str = "usage: generate [--socket PATH] [--chat] [--max-tokens N] [--temperature T] \
[--top-k K] [--top-p P] [--min-p P] [--repeat-penalty R] [--seed S] [--stop TEXT]... \
[--no-cache-prompt] PROMPT";

struct Args {
    socket: Option<PathBuf>,
    chat: bool,
    options: Options,
    prompt: String,
}

fn parse_args() -> Result<Args, String> {
    let mut socket = None;
    let mut chat = false;
    let mut options = Options::new();
    let mut prompt = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        fn number<T: std::str::FromStr>(name: &str, text: String) -> Result<T, String> {
            text.parse()
                .map_err(|_| format!("{name}: not a number: {text:?}"))
        }
        match arg.as_str() {
            "--socket" => socket = Some(PathBuf::from(value("--socket")?)),
            "--chat" => chat = true,
            "--max-tokens" => options.max_tokens = Some(number(&arg, value(&arg)?)?),
            "--temperature" => options.temperature = Some(number(&arg, value(&arg)?)?),
            "--top-k" => options.top_k = Some(number(&arg, value(&arg)?)?),
            "--top-p" => options.top_p = Some(number(&arg, value(&arg)?)?),
            "--min-p" => options.min_p = Some(number(&arg, value(&arg)?)?),
            "--repeat-penalty" => options.repeat_penalty = Some(number(&arg, value(&arg)?)?),
            "--seed" => options.seed = Some(number(&arg, value(&arg)?)?),
            "--stop" => options.stop.push(value(&arg)?),
            "--no-cache-prompt" => options.cache_prompt = Some(false),
            "-h" | "--help" => return Err(String::new()),
            "--" => {
                prompt = args.next();
                break;
            }
            flag if flag.starts_with("--") => return Err(format!("unknown option {flag}")),
            _ if prompt.is_none() => prompt = Some(arg),
            _ => return Err("only one PROMPT, please (quote it)".into()),
        }
    }
    let prompt = prompt.ok_or("missing PROMPT")?;
    Ok(Args {
        socket,
        chat,
        options,
        prompt,
    })
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            if !message.is_empty() {
                eprintln!("generate: {message}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let mut client = match Client::connect(args.socket.as_deref()) {
        Ok(client) => client,
        Err(error) => {
            eprintln!("generate: {error}");
            return ExitCode::from(3);
        }
    };
    let stdout = io::stdout();
    let mut out = stdout.lock();
    let mut write_failed = None;
    // Stop (and cancel the generation) if stdout goes away, e.g. `| head -c 10`.
    let on_piece = |piece: &str| match out.write_all(piece.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => ControlFlow::Continue(()),
        Err(error) => {
            write_failed = Some(error);
            ControlFlow::Break(())
        }
    };
    let result = if args.chat {
        client.stream_chat(&[Message::user(args.prompt)], &args.options, on_piece)
    } else {
        client.stream_generate(&args.prompt, &args.options, on_piece)
    };
    if let Some(error) = write_failed {
        eprintln!("generate: writing stdout: {error}");
        return ExitCode::from(1);
    }
    match result {
        Ok(done) => {
            let _ = writeln!(out).and_then(|()| out.flush());
            eprintln!(
                "[{}{}, {} prompt + {} generated tokens, first token {:.0} ms, {:.1} tok/s]",
                done.finish_reason,
                done.stop_sequence
                    .map(|s| format!(" {s:?}"))
                    .unwrap_or_default(),
                done.usage.prompt_tokens,
                done.usage.completion_tokens,
                done.timings.first_token_ms,
                done.timings.decode_tok_s,
            );
            ExitCode::SUCCESS
        }
        Err(error @ Error::Connect { .. }) => {
            eprintln!("generate: {error}");
            ExitCode::from(3)
        }
        Err(error) => {
            let _ = out.flush();
            eprintln!("generate: {error}");
            ExitCode::from(1)
        }
    }
}
