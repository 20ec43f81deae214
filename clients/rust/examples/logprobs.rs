//! Asks for logprobs on a greedy completion, non-streamed and streamed, and prints both
//! completions and the daemon's metrics text as one JSON object.
//!
//! ```sh
//! cargo run --example logprobs -- /tmp/sfcore-ai.sock "The capital of France is" 3
//! ```
//!
//! Arguments: SOCKET PROMPT N (the number of alternatives per token, 0 to 20). The
//! completion is greedy (temperature 0, seed 7, max_tokens 16, cache_prompt false).
//! `bytes` are printed as lists of ints. Exit status: 0 done, 1 the daemon answered with
//! an error line or the connection failed, 2 bad arguments, 3 the daemon is unreachable.

use std::path::Path;
use std::process::ExitCode;

use serde_json::json;
use sfcore_client::{Client, Error, Options};

fn run(client: &mut Client, prompt: &str, n: u32) -> Result<serde_json::Value, Error> {
    let options = Options::new()
        .max_tokens(16)
        .temperature(0.0)
        .seed(7)
        .cache_prompt(false)
        .logprobs(n);
    let whole = client.generate(prompt, &options)?;
    let streamed = client.stream_generate(prompt, &options, |_: &str| ())?;
    let without = client.generate(prompt, &Options::new().max_tokens(2))?;
    Ok(json!({
        "whole": whole,
        "streamed": streamed,
        "without": without.logprobs,
        "metrics": client.metrics()?,
    }))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [socket, prompt, n] = args.as_slice() else {
        eprintln!("usage: logprobs SOCKET PROMPT N");
        return ExitCode::from(2);
    };
    let Ok(n) = n.parse::<u32>() else {
        eprintln!("logprobs: N must be a number, not {n:?}");
        return ExitCode::from(2);
    };
    let mut client = match Client::connect(Some(Path::new(socket))) {
        Ok(client) => client,
        Err(error) => {
            eprintln!("logprobs: {error}");
            return ExitCode::from(3);
        }
    };
    match run(&mut client, prompt, n) {
        Ok(out) => {
            println!("{out}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("logprobs: {error}");
            ExitCode::from(1)
        }
    }
}
