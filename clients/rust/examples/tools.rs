//! A tool call's round trip: offer two functions, run the call(s) the model makes here,
//! send the results back, and print the final answer.
//!
//! ```sh
//! cargo run --example tools -- "What is the weather in Paris, and what is 2 + 3?"
//! cargo run --example tools -- --choice add --temperature 1 --seed 3 "What is 2 + 3?"
//! ```
//!
//! stdout gets one JSON line per step: `{"step": "tools", "tools": [...]}` (what was
//! offered), `{"step": "call", "finish_reason", "text", "tool_calls": [...]}` (the first
//! answer), one `{"step": "result", "tool_call_id", "name", "content"}` per call run here,
//! and `{"step": "answer", "finish_reason", "text", "tool_calls"}` (the answer to the
//! results, which may call again; absent when the first answer made no calls). `--choice`
//! is `auto` (the default), `required`, `none` or a function's name. Exit status: 0 done, 1 the daemon answered with an error
//! line or the connection failed mid-reply, 2 bad arguments, 3 the daemon is unreachable.

use std::path::PathBuf;
use std::process::ExitCode;

use serde_json::json;
use sfcore_client::{Client, Error, Message, Options, Tool, ToolCall, ToolChoice};

const USAGE: &str = "usage: tools [--socket PATH] [--choice auto|required|none|NAME] \
[--max-tokens N (default 64)] [--temperature T] [--seed S] [--no-parallel] QUESTION";

struct Args {
    socket: Option<PathBuf>,
    options: Options,
    question: String,
}

fn offered() -> Vec<Tool> {
    vec![
        Tool::function(
            "get_weather",
            "The weather in a city now",
            json!({"type": "object", "properties": {
                      "city": {"type": "string", "maxLength": 40},
                      "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": false}),
        ),
        Tool::function(
            "add",
            "The sum of two integers",
            json!({"type": "object", "properties": {
                      "a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": false}),
        ),
    ]
}

/// Runs a call here. The arguments are valid against the function's parameters (the
/// daemon holds them to it); what a function cannot do still becomes a result the model
/// reads, as a tool would report it.
fn run_call(call: &ToolCall) -> String {
    let arguments = &call.function.arguments;
    match call.function.name.as_str() {
        "get_weather" => {
            let celsius = arguments["unit"] != "f";
            let (temperature, unit) = if celsius { (21, "c") } else { (70, "f") };
            json!({"city": arguments["city"], "temperature": temperature, "unit": unit,
                   "sky": "sunny"})
            .to_string()
        }
        "add" => match (arguments["a"].as_i64(), arguments["b"].as_i64()) {
            (Some(a), Some(b)) => match a.checked_add(b) {
                Some(sum) => sum.to_string(),
                None => "error: the sum overflows 64 bits".into(),
            },
            _ => "error: a and b must be 64-bit integers".into(),
        },
        other => format!("error: no function {other}"),
    }
}

fn parse_args() -> Result<Args, String> {
    let mut socket = None;
    let mut options = Options::new().max_tokens(64).tools(offered());
    let mut question = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        fn number<T: std::str::FromStr>(name: &str, text: String) -> Result<T, String> {
            text.parse()
                .map_err(|_| format!("{name}: not a number: {text:?}"))
        }
        match arg.as_str() {
            "--socket" => socket = Some(PathBuf::from(value(&arg)?)),
            "--choice" => {
                options.tool_choice = Some(match value(&arg)?.as_str() {
                    "auto" => ToolChoice::Auto,
                    "required" => ToolChoice::Required,
                    "none" => ToolChoice::None,
                    // A name that is not among the tools: the daemon says invalid_request.
                    name => ToolChoice::function(name),
                })
            }
            "--max-tokens" => options.max_tokens = Some(number(&arg, value(&arg)?)?),
            "--temperature" => options.temperature = Some(number(&arg, value(&arg)?)?),
            "--seed" => options.seed = Some(number(&arg, value(&arg)?)?),
            "--no-parallel" => options.parallel_tool_calls = Some(false),
            "-h" | "--help" => return Err(String::new()),
            "--" => {
                question = args.next();
                break;
            }
            flag if flag.starts_with("--") => return Err(format!("unknown option {flag}")),
            _ if question.is_none() => question = Some(arg),
            _ => return Err("only one QUESTION, please (quote it)".into()),
        }
    }
    let question = question.ok_or("missing QUESTION")?;
    Ok(Args {
        socket,
        options,
        question,
    })
}

fn round_trip(client: &mut Client, args: &Args) -> Result<(), Error> {
    println!("{}", json!({"step": "tools", "tools": args.options.tools}));
    let mut messages = vec![Message::user(args.question.as_str())];
    let first = client.chat(&messages, &args.options)?;
    println!(
        "{}",
        json!({"step": "call", "finish_reason": first.finish_reason, "text": first.text,
               "tool_calls": first.tool_calls})
    );
    let Some(calls) = first.tool_calls else {
        return Ok(());
    };
    let results: Vec<Message> = calls
        .iter()
        .map(|call| {
            let content = run_call(call);
            println!(
                "{}",
                json!({"step": "result", "tool_call_id": call.id,
                       "name": call.function.name, "content": content})
            );
            Message::tool(call.id.as_str(), content)
        })
        .collect();
    messages.push(Message::assistant_calls(first.text, calls));
    messages.extend(results);
    // The tools stay offered (the model sees what it called); the answer is free again.
    let options = Options {
        tool_choice: None,
        ..args.options.clone()
    };
    let answer = client.chat(&messages, &options)?;
    println!(
        "{}",
        json!({"step": "answer", "finish_reason": answer.finish_reason, "text": answer.text,
               "tool_calls": answer.tool_calls})
    );
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            if !message.is_empty() {
                eprintln!("tools: {message}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let mut client = match Client::connect(args.socket.as_deref()) {
        Ok(client) => client,
        Err(error) => {
            eprintln!("tools: {error}");
            return ExitCode::from(3);
        }
    };
    match round_trip(&mut client, &args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Error::Protocol { code, message }) => {
            eprintln!("tools: {code}: {message}");
            ExitCode::from(1)
        }
        Err(error) => {
            eprintln!("tools: {error}");
            ExitCode::from(1)
        }
    }
}
