//! Exercises the library's non-generation calls and the ways to stop a stream, printing
//! one JSON object with what each call returned (`{"error": ...}` where it failed).
//!
//! ```sh
//! cargo run --example ops -- /tmp/sfcore-ai.sock "What is the capital of France?" "Hello, world"
//! ```
//!
//! Arguments: SOCKET CHAT_TEXT TOKENIZE_TEXT. The chat is greedy (temperature 0, seed 7,
//! max_tokens 24, cache_prompt false), so its text is reproducible.

use std::ops::ControlFlow;
use std::path::Path;
use std::process::ExitCode;

use serde::Serialize;
use serde_json::{json, Value};
use sfcore_client::{Client, Error, Message, Options};

/// The value of a call, or what went wrong.
fn record<T: Serialize>(result: Result<T, Error>) -> Value {
    match result {
        Ok(value) => serde_json::to_value(value).expect("serializable"),
        Err(Error::Protocol { code, message }) => json!({"error": code, "message": message}),
        Err(error) => json!({"error": "client", "message": error.to_string()}),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [socket, chat_text, tokenize_text] = args.as_slice() else {
        eprintln!("usage: ops SOCKET CHAT_TEXT TOKENIZE_TEXT");
        return ExitCode::from(2);
    };
    let mut client = match Client::connect(Some(Path::new(socket))) {
        Ok(client) => client,
        Err(error) => {
            eprintln!("ops: {error}");
            return ExitCode::from(3);
        }
    };
    let mut out = serde_json::Map::new();
    let long = Options::new()
        .max_tokens(200)
        .temperature(0.0)
        .cache_prompt(false);
    let prompt = "Write a long story about a dragon.";

    let chat_options = Options::new()
        .max_tokens(24)
        .temperature(0.0)
        .seed(7)
        .cache_prompt(false);
    out.insert(
        "chat".into(),
        record(client.chat(&[Message::user(chat_text.as_str())], &chat_options)),
    );

    let tokens = client.tokenize(tokenize_text, true);
    out.insert(
        "detokenize".into(),
        match &tokens {
            Ok(tokens) => record(client.detokenize(tokens)),
            Err(_) => json!(null),
        },
    );
    out.insert("tokenize".into(), record(tokens));

    // An explicit cancel of a running stream, after its first piece.
    out.insert("stream_cancel".into(), {
        let result = client.generate_iter(prompt, &long).and_then(|mut stream| {
            let first = stream.next().transpose()?;
            let found = stream.cancel()?;
            Ok(json!({
                "first_piece": first,
                "found": found,
                "completion": stream.completion(),
                "more_after_cancel": stream.next().is_some(),
            }))
        });
        record(result)
    });

    // A callback that asks to stop after one piece.
    out.insert("callback_stop".into(), {
        let mut pieces = 0;
        let result = client.stream_generate(prompt, &long, |_piece: &str| {
            pieces += 1;
            ControlFlow::Break(())
        });
        json!({"pieces": pieces, "completion": record(result)})
    });

    // Dropping an iterator after one piece; the slot must be free again afterwards.
    out.insert("dropped_iterator".into(), {
        let first = client
            .generate_iter(prompt, &long)
            .and_then(|mut stream| stream.next().transpose());
        json!({"first_piece": record(first), "health_after": record(client.health())})
    });

    // Every call above finished its request, so this id is no longer pending.
    out.insert("cancel_finished".into(), record(client.cancel("rs-1")));
    out.insert(
        "cancel_unknown".into(),
        record(client.cancel("no-such-request")),
    );
    out.insert(
        "error".into(),
        record(client.generate("x", &Options::new().stop(""))),
    );
    out.insert("health".into(), record(client.health()));
    out.insert("info".into(), record(client.info()));
    out.insert("stats".into(), record(client.stats()));

    println!("{}", Value::Object(out));
    ExitCode::SUCCESS
}
