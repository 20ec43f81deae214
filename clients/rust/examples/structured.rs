//! Asks for a JSON document shaped by a JSON Schema, and prints it.
//!
//! ```sh
//! cargo run --example structured -- --json-schema person.json "A person as JSON:"
//! cargo run --example structured -- --format json --chat "Describe a cat as JSON."
//! cargo run --example structured -- --grammar yesno.gbnf "Is the sky blue? Answer:"
//! ```
//!
//! stdout gets the document and a newline (ready for `jq`). Exit status: 0 a whole
//! document, 1 the daemon answered with an error line (a schema it refuses is
//! `invalid_request`; the message goes to stderr) or the connection failed mid-reply,
//! 2 bad arguments or a file that cannot be read, 3 the daemon is unreachable, 4 the reply
//! ended before the document did (`max_tokens`; what came is still printed).

use std::path::PathBuf;
use std::process::ExitCode;

use sfcore_client::{Client, Error, FinishReason, Message, Options};

const USAGE: &str = "usage: structured (--json-schema FILE | --format json | --grammar FILE) \
[--socket PATH] [--chat] [--max-tokens N (default 256)] [--temperature T] [--seed S] \
[--no-cache-prompt] PROMPT";

struct Args {
    socket: Option<PathBuf>,
    chat: bool,
    options: Options,
    prompt: String,
}

fn read_file(flag: &str, path: &str) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|error| format!("{flag} {path}: {error}"))
}

fn parse_args() -> Result<Args, String> {
    let mut socket = None;
    let mut chat = false;
    let mut options = Options::new().max_tokens(256);
    let mut prompt = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        fn number<T: std::str::FromStr>(name: &str, text: String) -> Result<T, String> {
            text.parse()
                .map_err(|_| format!("{name}: not a number: {text:?}"))
        }
        // More than one of --json-schema, --format and --grammar is sent as given: the
        // daemon answers invalid_request.
        match arg.as_str() {
            "--json-schema" => {
                let path = value(&arg)?;
                let schema = serde_json::from_str(&read_file(&arg, &path)?)
                    .map_err(|error| format!("--json-schema {path}: not JSON: {error}"))?;
                options.json_schema = Some(schema);
            }
            "--format" => options.format = Some(value(&arg)?),
            "--grammar" => options.grammar = Some(read_file(&arg, &value(&arg)?)?),
            "--socket" => socket = Some(PathBuf::from(value("--socket")?)),
            "--chat" => chat = true,
            "--max-tokens" => options.max_tokens = Some(number(&arg, value(&arg)?)?),
            "--temperature" => options.temperature = Some(number(&arg, value(&arg)?)?),
            "--seed" => options.seed = Some(number(&arg, value(&arg)?)?),
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
    if options.json_schema.is_none() && options.format.is_none() && options.grammar.is_none() {
        return Err("give --json-schema FILE, --format json or --grammar FILE".into());
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
                eprintln!("structured: {message}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let mut client = match Client::connect(args.socket.as_deref()) {
        Ok(client) => client,
        Err(error) => {
            eprintln!("structured: {error}");
            return ExitCode::from(3);
        }
    };
    let result = if args.chat {
        client.chat(&[Message::user(args.prompt)], &args.options)
    } else {
        client.generate(&args.prompt, &args.options)
    };
    match result {
        Ok(done) => {
            println!("{}", done.text);
            if done.truncated {
                eprintln!("structured: the daemon closed the document early (max_tokens)");
            } else if done.finish_reason != FinishReason::Stop {
                eprintln!(
                    "structured: the reply ended before the document did (finish_reason {})",
                    done.finish_reason
                );
                return ExitCode::from(4);
            }
            ExitCode::SUCCESS
        }
        Err(Error::Protocol { code, message }) => {
            eprintln!("structured: {code}: {message}");
            ExitCode::from(1)
        }
        Err(error @ Error::Connect { .. }) => {
            eprintln!("structured: {error}");
            ExitCode::from(3)
        }
        Err(error) => {
            eprintln!("structured: {error}");
            ExitCode::from(1)
        }
    }
}
