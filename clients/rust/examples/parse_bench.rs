//! Per-token cost of the client's reply path, on recorded-style `token` lines from memory.
//!
//! ```sh
//! cargo run --release --example parse_bench -- [N_TOKENS]
//! ```
//!
//! 1. `ReplyReader` over an in-memory buffer: line reading + JSON parsing only.
//! 2. `Client::stream_generate` over a socket pair whose other end replays the lines from
//!    memory: the whole client path (socket reads, parsing, id check, text accumulation,
//!    callback), as when talking to the daemon.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use sfcore_client::{Client, Options, Reply, ReplyReader};

/// Pieces like the ones Gemma 3 streams: words, sub-words, whitespace, non-ASCII, escapes.
const PIECES: &[&str] = &[
    " dengan",
    " menggunakan",
    " Rust",
    " adalah",
    " bahasa",
    " pemrograman",
    ",",
    ".",
    " the",
    " memory",
    " safety",
    "\n",
    "\n\n",
    " 日本",
    "語",
    " café",
    " straße",
    " —",
    " \"quoted\"",
    "\t",
    " 😀",
    " über",
    " ownership",
    " borrow",
    "ing",
    " compiler",
    " é",
];

fn token_lines(id: &str, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * 48);
    for i in 0..n {
        let line = serde_json::json!({"type": "token", "id": id, "text": PIECES[i % PIECES.len()]});
        serde_json::to_writer(&mut out, &line).unwrap();
        out.push(b'\n');
    }
    let done = format!(
        "{{\"type\":\"done\",\"id\":\"{id}\",\"text\":\"\",\"finish_reason\":\"length\",\
\"stop_sequence\":null,\"usage\":{{\"prompt_tokens\":9,\"cached_tokens\":0,\
\"completion_tokens\":{n}}},\"timings\":{{\"queued_ms\":1.3,\"prompt_ms\":75.2,\
\"prompt_tok_s\":119.5,\"first_token_ms\":86.0,\"decode_ms\":2440.3,\"decode_tok_s\":40.5,\
\"total_ms\":2526.5}}}}\n"
    );
    out.extend_from_slice(done.as_bytes());
    out
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .map_or(100_000, |s| s.parse().expect("N_TOKENS"));
    let rounds = 5;

    // 1. Reader + JSON only.
    let data = token_lines("rs-1", n);
    let mut best = f64::INFINITY;
    let mut chars = 0;
    for _ in 0..rounds {
        let start = Instant::now();
        let mut reader = ReplyReader::new(&data[..]);
        chars = 0;
        while let Some(reply) = reader.next_reply().unwrap() {
            if let Reply::Token { text, .. } = reply {
                chars += text.len();
            }
        }
        best = best.min(start.elapsed().as_secs_f64());
    }
    println!(
        "reader+json: {:.3} us/token ({n} lines, {} bytes, best of {rounds})",
        best * 1e6 / n as f64,
        data.len()
    );

    // 2. The whole client path over a socket pair.
    let mut best = f64::INFINITY;
    for _ in 0..rounds {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let data = data.clone();
        let daemon = std::thread::spawn(move || {
            let mut request = String::new();
            BufReader::new(&theirs).read_line(&mut request).unwrap();
            (&theirs).write_all(&data).unwrap();
        });
        let mut client = Client::from_stream(ours);
        let mut pieces = 0usize;
        let start = Instant::now();
        let done = client
            .stream_generate("x", &Options::new(), |piece: &str| {
                pieces += piece.len();
            })
            .unwrap();
        best = best.min(start.elapsed().as_secs_f64());
        daemon.join().unwrap();
        assert_eq!(pieces, chars);
        assert_eq!(done.text.len(), chars);
        assert_eq!(done.usage.completion_tokens, n as u64);
    }
    println!(
        "client stream_generate over a socket pair: {:.3} us/token",
        best * 1e6 / n as f64
    );
}
