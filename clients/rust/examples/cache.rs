//! Lists the prompt states the daemon's prompt store keeps, or clears them.
//!
//! ```sh
//! cargo run --example cache
//! cargo run --example cache -- --socket /tmp/my.sock --clear
//! ```
//!
//! stdout gets the daemon's `cache` line as one line of JSON (`enabled`, `dir`, `states`
//! most recently used first, and with `--clear` what was removed). Exit status: 0 done,
//! 1 the daemon answered with an error line (or the connection failed mid-reply; the
//! message goes to stderr), 2 bad arguments, 3 the daemon is unreachable.

use std::path::PathBuf;
use std::process::ExitCode;

use sfcore_client::{Client, Error};

const USAGE: &str = "usage: cache [--socket PATH] [--clear]";

struct Args {
    socket: Option<PathBuf>,
    clear: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut socket = None;
    let mut clear = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--socket" => {
                socket = Some(PathBuf::from(args.next().ok_or("--socket needs a value")?))
            }
            "--clear" => clear = true,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(Args { socket, clear })
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            if !message.is_empty() {
                eprintln!("cache: {message}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let result = Client::connect(args.socket.as_deref()).and_then(|mut c| c.cache(args.clear));
    match result {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(error @ Error::Connect { .. }) => {
            eprintln!("cache: {error}");
            ExitCode::from(3)
        }
        Err(error) => {
            eprintln!("cache: {error}");
            ExitCode::from(1)
        }
    }
}
