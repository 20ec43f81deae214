//! Client for the sfcore-ai daemon: NDJSON over a Unix domain socket.
//!
//! One [`Client`] is one connection. Every call sends one request (with a client id,
//! `"rs-1"`, `"rs-2"`, ...) and reads that request's reply lines; the daemon answers
//! requests in order, so a connection is only ever busy with one request at a time here.
//!
//! ```no_run
//! use sfcore_client::{Client, Message, Options};
//!
//! # fn main() -> Result<(), sfcore_client::Error> {
//! let mut client = Client::connect(None)?; // $SFCORE_SOCKET, else /tmp/sfcore-ai.sock
//! let options = Options::new().max_tokens(32).temperature(0.0);
//! let done = client.generate("Jelaskan Rust dalam 1 kalimat", &options)?;
//! println!("{} ({})", done.text, done.finish_reason);
//!
//! // Streaming: the callback gets each piece; returning `false` or
//! // `ControlFlow::Break(())` cancels the generation.
//! client.stream_generate("Once upon a time", &options, |piece: &str| print!("{piece}"))?;
//!
//! // Or as an iterator; dropping it early cancels the generation.
//! let mut stream = client.chat_iter(&[Message::user("Hi!")], &options)?;
//! for piece in &mut stream {
//!     print!("{}", piece?);
//! }
//! println!("\n{:?}", stream.completion().map(|c| &c.usage));
//! # Ok(())
//! # }
//! ```
//!
//! Lines are read with [`BufRead::read_until`], so a reply line (such as a non-streamed
//! `done` line holding a long completion) has no length limit on this side.

use std::borrow::Cow;
use std::fmt;
use std::io::{self, BufRead, BufReader, Write};
use std::marker::PhantomData;
use std::ops::ControlFlow;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use serde_json::Value;

/// The daemon's default socket path.
pub const DEFAULT_SOCKET: &str = "/tmp/sfcore-ai.sock";
/// Environment variable naming the socket when no path is given.
pub const SOCKET_ENV: &str = "SFCORE_SOCKET";

/// How long a dropped or stopped stream waits for each line while draining its
/// cancelled request (when the client itself has no shorter timeout).
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// `$SFCORE_SOCKET` when set and non-empty, else [`DEFAULT_SOCKET`].
pub fn default_socket_path() -> PathBuf {
    match std::env::var_os(SOCKET_ENV) {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => PathBuf::from(DEFAULT_SOCKET),
    }
}

// ---------------------------------------------------------------------------------------
// Errors

/// Everything a call can fail with.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The daemon answered with an `error` line (`code` as in the protocol:
    /// `invalid_request`, `context_overflow`, `queue_full`, ...).
    Protocol { code: String, message: String },
    /// The socket could not be connected to (the daemon may not be running).
    Connect { path: PathBuf, source: io::Error },
    /// Reading from or writing to the connection failed (including read timeouts).
    Io(io::Error),
    /// A reply line was not the JSON expected.
    Json(serde_json::Error),
    /// The daemon closed the connection before the reply was complete.
    Closed,
    /// A reply line that does not belong to the request (wrong id or type).
    Unexpected(String),
}

impl Error {
    /// The protocol error code, for [`Error::Protocol`].
    pub fn code(&self) -> Option<&str> {
        match self {
            Error::Protocol { code, .. } => Some(code),
            _ => None,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Protocol { code, message } => write!(f, "{code}: {message}"),
            Error::Connect { path, source } => write!(
                f,
                "cannot connect to {}: {source} (is the sfcore-ai daemon running?)",
                path.display()
            ),
            Error::Io(error) => write!(f, "connection to the daemon failed: {error}"),
            Error::Json(error) => write!(f, "unreadable reply from the daemon: {error}"),
            Error::Closed => f.write_str("the daemon closed the connection mid-reply"),
            Error::Unexpected(what) => write!(f, "unexpected reply from the daemon: {what}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Connect { source, .. } => Some(source),
            Error::Io(error) => Some(error),
            Error::Json(error) => Some(error),
            _ => None,
        }
    }
}

impl From<io::Error> for Error {
    fn from(error: io::Error) -> Self {
        Error::Io(error)
    }
}

impl From<serde_json::Error> for Error {
    fn from(error: serde_json::Error) -> Self {
        Error::Json(error)
    }
}

/// Error codes after which the daemon closes the connection.
fn closes_connection(code: &str) -> bool {
    matches!(
        code,
        "line_too_long" | "too_many_connections" | "forbidden" | "shutting_down"
    )
}

// ---------------------------------------------------------------------------------------
// Request ids

/// A request id: the protocol allows a string or an integer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Id<'a> {
    Str(Cow<'a, str>),
    Num(i64),
}

impl Id<'_> {
    /// An owned copy that no longer borrows the reply line.
    pub fn into_owned(self) -> Id<'static> {
        match self {
            Id::Str(s) => Id::Str(Cow::Owned(s.into_owned())),
            Id::Num(n) => Id::Num(n),
        }
    }

    /// Whether this is the string id `s`.
    pub fn is_str(&self, s: &str) -> bool {
        matches!(self, Id::Str(own) if own == s)
    }
}

impl fmt::Display for Id<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Id::Str(s) => f.write_str(s),
            Id::Num(n) => write!(f, "{n}"),
        }
    }
}

impl<'a> From<&'a str> for Id<'a> {
    fn from(s: &'a str) -> Self {
        Id::Str(Cow::Borrowed(s))
    }
}

impl From<String> for Id<'static> {
    fn from(s: String) -> Self {
        Id::Str(Cow::Owned(s))
    }
}

impl From<i64> for Id<'static> {
    fn from(n: i64) -> Self {
        Id::Num(n)
    }
}

impl<'a> From<&'a Id<'_>> for Id<'a> {
    fn from(id: &'a Id<'_>) -> Self {
        match id {
            Id::Str(s) => Id::Str(Cow::Borrowed(s)),
            Id::Num(n) => Id::Num(*n),
        }
    }
}

impl Serialize for Id<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Id::Str(s) => serializer.serialize_str(s),
            Id::Num(n) => serializer.serialize_i64(*n),
        }
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Id<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct IdVisitor<'a>(PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for IdVisitor<'a> {
            type Value = Id<'a>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or integer id")
            }

            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Id<'a>, E> {
                Ok(Id::Str(Cow::Borrowed(v)))
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Id<'a>, E> {
                Ok(Id::Str(Cow::Owned(v.to_owned())))
            }

            fn visit_string<E: de::Error>(self, v: String) -> Result<Id<'a>, E> {
                Ok(Id::Str(Cow::Owned(v)))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Id<'a>, E> {
                Ok(Id::Num(v))
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Id<'a>, E> {
                i64::try_from(v)
                    .map(Id::Num)
                    .map_err(|_| E::custom("id out of range"))
            }
        }

        deserializer.deserialize_any(IdVisitor(PhantomData))
    }
}

// ---------------------------------------------------------------------------------------
// Requests

/// Generation options; `None` (the default) leaves a field to the daemon's config.
///
/// ```
/// let options = sfcore_client::Options::new().max_tokens(32).temperature(0.0).seed(7);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Options {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repeat_penalty: Option<f64>,
    /// OpenAI's penalties, -2 to 2 (0 disables): subtracted from the logit of each token
    /// among the last 64, once per occurrence (frequency) or once (presence).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// Up to 8 stop strings; empty: none.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_prompt: Option<bool>,
    /// `Some(false)`: the daemon drafts no tokens for this request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculative: Option<bool>,
    /// 0 to 20: [`Completion::logprobs`] gets each generated token's log-probability and
    /// its N likeliest alternatives.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<u32>,
    /// Structured output: set at most one of `json_schema`, `format` and `grammar` (the
    /// daemon answers `invalid_request` to more). A JSON Schema object, sent as is: the
    /// output is a JSON document valid against it, its properties in the schema's order
    /// (this crate turns on serde_json's `preserve_order`, so a `Value` keeps that order).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub json_schema: Option<Value>,
    /// `"json"`: the output is one JSON object (any keys and values).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// GBNF text (llama.cpp's format; the start rule is `root`): the output matches it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grammar: Option<String>,
    /// Functions the model may call (chat only; up to 64, unique names). Not together with
    /// `json_schema`, `format` or `grammar`. A call's arguments always validate against
    /// its function's `parameters`; the calls come in [`Completion::tool_calls`].
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<Tool>,
    /// `None`: [`ToolChoice::Auto`] when `tools` are given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    /// `Some(false)`: one call at most per answer (the daemon's default is several).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// Which waiting requests the daemon starts first; `None`: not sent (the daemon's
    /// default, [`Priority::Interactive`]; a daemon without priorities refuses the field).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
}

/// A request's priority in the daemon's wait queue (`"interactive"` or `"background"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    /// The daemon's default.
    Interactive,
    /// Started after the interactive requests that wait.
    Background,
}

/// A streamed request's place in the daemon's wait queue (a `queued` line): `position` 1
/// is the next to start; `queue_depth` requests wait in all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct QueuePosition {
    pub position: u32,
    pub queue_depth: u32,
}

impl QueuePosition {
    /// The place a `queued` line reports; `None` for any other line, or one without the
    /// two numbers.
    pub fn from_line(line: &Value) -> Option<QueuePosition> {
        if line["type"] != "queued" {
            return None;
        }
        let number = |key: &str| line[key].as_u64().and_then(|n| u32::try_from(n).ok());
        Some(QueuePosition {
            position: number("position")?,
            queue_depth: number("queue_depth")?,
        })
    }
}

impl Options {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn max_tokens(mut self, n: u32) -> Self {
        self.max_tokens = Some(n);
        self
    }
    pub fn temperature(mut self, t: f64) -> Self {
        self.temperature = Some(t);
        self
    }
    pub fn top_k(mut self, k: u32) -> Self {
        self.top_k = Some(k);
        self
    }
    pub fn top_p(mut self, p: f64) -> Self {
        self.top_p = Some(p);
        self
    }
    pub fn min_p(mut self, p: f64) -> Self {
        self.min_p = Some(p);
        self
    }
    pub fn repeat_penalty(mut self, penalty: f64) -> Self {
        self.repeat_penalty = Some(penalty);
        self
    }
    pub fn frequency_penalty(mut self, penalty: f64) -> Self {
        self.frequency_penalty = Some(penalty);
        self
    }
    pub fn presence_penalty(mut self, penalty: f64) -> Self {
        self.presence_penalty = Some(penalty);
        self
    }
    pub fn logprobs(mut self, n: u32) -> Self {
        self.logprobs = Some(n);
        self
    }
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }
    /// Adds one stop string.
    pub fn stop(mut self, stop: impl Into<String>) -> Self {
        self.stop.push(stop.into());
        self
    }
    pub fn cache_prompt(mut self, cache: bool) -> Self {
        self.cache_prompt = Some(cache);
        self
    }
    pub fn speculative(mut self, speculative: bool) -> Self {
        self.speculative = Some(speculative);
        self
    }
    pub fn json_schema(mut self, schema: Value) -> Self {
        self.json_schema = Some(schema);
        self
    }
    pub fn format(mut self, format: impl Into<String>) -> Self {
        self.format = Some(format.into());
        self
    }
    pub fn grammar(mut self, grammar: impl Into<String>) -> Self {
        self.grammar = Some(grammar.into());
        self
    }
    /// Offers these functions (replacing any given before).
    pub fn tools(mut self, tools: impl IntoIterator<Item = Tool>) -> Self {
        self.tools = tools.into_iter().collect();
        self
    }
    pub fn tool_choice(mut self, choice: ToolChoice) -> Self {
        self.tool_choice = Some(choice);
        self
    }
    pub fn parallel_tool_calls(mut self, parallel: bool) -> Self {
        self.parallel_tool_calls = Some(parallel);
        self
    }
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = Some(priority);
        self
    }
}

// ---------------------------------------------------------------------------------------
// Tool calls

/// A function the model may call, in OpenAI's form: `{"type": "function", "function": ...}`.
///
/// ```
/// use sfcore_client::{Options, Tool, ToolChoice};
/// let weather = Tool::function(
///     "get_weather",
///     "The weather in a city now",
///     serde_json::json!({"type": "object", "properties": {"city": {"type": "string"}},
///                        "required": ["city"]}),
/// );
/// let options = Options::new().tools([weather]).tool_choice(ToolChoice::Required);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tool {
    /// Always `"function"`.
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionSpec,
}

impl Tool {
    pub fn function(
        name: impl Into<String>,
        description: impl Into<String>,
        parameters: Value,
    ) -> Self {
        Tool {
            kind: "function".into(),
            function: FunctionSpec {
                name: name.into(),
                description: description.into(),
                parameters,
                strict: None,
            },
        }
    }
}

/// A function's name (1-64 of `A-Z a-z 0-9 _ . -`), what it does, and the JSON Schema of
/// its arguments object (the structured output subset; `Value::Null`: any object).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionSpec {
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    #[serde(default, skip_serializing_if = "Value::is_null")]
    pub parameters: Value,
    /// OpenAI's flag; accepted, and the arguments always validate anyway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// Which calls the answer makes. On the wire: `"auto"`, `"required"`, `"none"`, or
/// `{"type": "function", "function": {"name": ...}}`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ToolChoice {
    /// Text, or calls once the model starts one (the default with tools).
    Auto,
    /// One or more calls.
    Required,
    /// Text only; the model is not shown the tools.
    None,
    /// Exactly one call, of the function of this name (one of the tools).
    Function(String),
}

impl ToolChoice {
    pub fn function(name: impl Into<String>) -> Self {
        ToolChoice::Function(name.into())
    }
}

#[derive(Serialize, Deserialize)]
struct ChosenFunction<'a> {
    #[serde(borrow)]
    name: Cow<'a, str>,
}

#[derive(Serialize, Deserialize)]
struct ChosenTool<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow)]
    function: ChosenFunction<'a>,
}

impl Serialize for ToolChoice {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            ToolChoice::Auto => serializer.serialize_str("auto"),
            ToolChoice::Required => serializer.serialize_str("required"),
            ToolChoice::None => serializer.serialize_str("none"),
            ToolChoice::Function(name) => ChosenTool {
                kind: Cow::Borrowed("function"),
                function: ChosenFunction {
                    name: Cow::Borrowed(name),
                },
            }
            .serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for ToolChoice {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Wire<'a> {
            Word(Cow<'a, str>),
            #[serde(borrow)]
            Chosen(ChosenTool<'a>),
        }
        match Wire::deserialize(deserializer)? {
            Wire::Word(word) => match &*word {
                "auto" => Ok(ToolChoice::Auto),
                "required" => Ok(ToolChoice::Required),
                "none" => Ok(ToolChoice::None),
                other => Err(de::Error::unknown_variant(
                    other,
                    &["auto", "required", "none"],
                )),
            },
            Wire::Chosen(chosen) if chosen.kind == "function" => {
                Ok(ToolChoice::Function(chosen.function.name.into_owned()))
            }
            Wire::Chosen(chosen) => Err(de::Error::invalid_value(
                de::Unexpected::Str(&chosen.kind),
                &"\"function\"",
            )),
        }
    }
}

/// A call the model made: `{"id": "call_...", "type": "function", "function": ...}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// What a [`Message::tool`] result names in `tool_call_id`.
    pub id: String,
    /// Always `"function"`.
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    pub function: FunctionCall,
}

fn function_kind() -> String {
    "function".into()
}

/// A function's name and its arguments: a JSON object valid against the function's
/// `parameters` (`serde_json::from_value` turns it into your own type).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: Value,
}

/// A chat message's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    /// A function's result ([`Message::tool`]).
    Tool,
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    pub content: String,
    /// An assistant's calls ([`Message::assistant_calls`]); empty: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A tool message: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Message {
            role,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
    /// The assistant's turn that made these calls (send it back before their results);
    /// `content` is what it wrote before them ([`Completion::text`], usually empty).
    pub fn assistant_calls(content: impl Into<String>, calls: Vec<ToolCall>) -> Self {
        Message {
            tool_calls: calls,
            ..Self::new(Role::Assistant, content)
        }
    }
    /// The result of the call with id `tool_call_id`, as text (often JSON).
    pub fn tool(tool_call_id: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            tool_call_id: Some(tool_call_id.into()),
            ..Self::new(Role::Tool, content)
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new(Role::System, content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new(Role::User, content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new(Role::Assistant, content)
    }
}

#[derive(Serialize)]
struct GenerationRequest<'a> {
    op: &'static str,
    id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    messages: Option<&'a [Message]>,
    stream: bool,
    #[serde(flatten)]
    options: &'a Options,
}

#[derive(Clone, Copy)]
enum Input<'a> {
    Prompt(&'a str),
    Messages(&'a [Message]),
}

// ---------------------------------------------------------------------------------------
// Replies

/// Why a generation ended.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// The model's end-of-generation token (or the chat template's end of turn).
    Stop,
    /// A `stop` string matched; [`Completion::stop_sequence`] names it.
    StopSequence,
    /// `max_tokens` reached or the context is full.
    Length,
    /// Cancelled (cancel op, client gone, or daemon shutdown).
    Cancelled,
    /// The answer is calls: [`Completion::tool_calls`].
    ToolCalls,
    /// A reason this client does not know yet.
    Other(String),
}

impl FinishReason {
    pub fn as_str(&self) -> &str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::StopSequence => "stop_sequence",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
            FinishReason::ToolCalls => "tool_calls",
            FinishReason::Other(other) => other,
        }
    }

    fn parse(s: &str) -> Self {
        match s {
            "stop" => FinishReason::Stop,
            "stop_sequence" => FinishReason::StopSequence,
            "length" => FinishReason::Length,
            "cancelled" => FinishReason::Cancelled,
            "tool_calls" => FinishReason::ToolCalls,
            other => FinishReason::Other(other.to_owned()),
        }
    }
}

impl fmt::Display for FinishReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for FinishReason {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

/// Token counts of a generation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Usage {
    pub prompt_tokens: u64,
    /// Prompt tokens reused from the KV cache.
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    /// Tokens drafted by speculative decoding (0 from daemons without it).
    pub drafted_tokens: u64,
    /// Drafted tokens the model's own sampling confirmed.
    pub accepted_tokens: u64,
    /// Of the drafted tokens, those a `json_schema`'s grammar forced (0 from older daemons).
    pub forced_drafted_tokens: u64,
    /// Of the accepted tokens, those a `json_schema`'s grammar forced.
    pub forced_accepted_tokens: u64,
}

/// Timings of a generation, in milliseconds and tokens per second.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Timings {
    pub queued_ms: f64,
    pub prompt_ms: f64,
    pub prompt_tok_s: f64,
    /// From the request's arrival to its first token.
    pub first_token_ms: f64,
    pub decode_ms: f64,
    pub decode_tok_s: f64,
    pub total_ms: f64,
}

/// One of a token's likeliest alternatives under the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    /// The token's id.
    pub token: u32,
    /// Its bytes as UTF-8, an incomplete character replaced by U+FFFD (`bytes` has the truth).
    pub text: String,
    pub bytes: Vec<u8>,
    /// The natural log of its probability, <= 0.
    pub logprob: f64,
}

/// A generated token, its log-probability under the model and (`logprobs` N > 0) its N
/// likeliest alternatives, best first.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub text: String,
    pub bytes: Vec<u8>,
    pub logprob: f64,
    #[serde(default)]
    pub top_logprobs: Vec<TopLogprob>,
}

/// A finished generation (the daemon's `done` line).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Completion {
    pub id: Id<'static>,
    /// The whole completion. For a streamed request the daemon's `done` line carries `""`;
    /// this client fills in the concatenation of every piece the daemon sent for it
    /// (after a cancel, that includes pieces that arrived after you asked to stop).
    pub text: String,
    pub finish_reason: FinishReason,
    pub stop_sequence: Option<String>,
    /// The daemon closed a JSON document (`json_schema`, `format`) early because
    /// `max_tokens` was near; `false` when the `done` line does not say so.
    pub truncated: bool,
    pub usage: Usage,
    pub timings: Timings,
    /// One entry per completion token, in order, when the request asked for `logprobs` (a
    /// stop sequence drops those of tokens wholly inside it); `None` when it did not. For
    /// a streamed request this client puts the token lines' entries before the `done`
    /// line's.
    pub logprobs: Option<Vec<TokenLogprob>>,
    /// The calls the answer made ([`FinishReason::ToolCalls`]); `text` is what the model
    /// wrote before them. `None` when it made none.
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// One parsed reply line. Token text borrows the line when it holds no escapes.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply<'a> {
    /// A `token` line: the next piece of a streamed generation, and the logprobs entries
    /// it carries (empty unless the request asked for them).
    Token {
        id: Id<'a>,
        text: Cow<'a, str>,
        logprobs: Vec<TokenLogprob>,
    },
    /// A `done` line.
    Done(Completion),
    /// An `error` line.
    Error {
        id: Option<Id<'a>>,
        code: String,
        message: String,
    },
    /// Any other line (`health`, `info`, `stats`, `cache`, `tokens`, `text`, `cancelled`,
    /// a streamed generation's `queued` ([`Reply::queue_position`]), ...), kept whole.
    Other {
        kind: String,
        id: Option<Id<'a>>,
        line: Value,
    },
}

impl Reply<'_> {
    /// The line's `id`, when it has one.
    pub fn id(&self) -> Option<&Id<'_>> {
        match self {
            Reply::Token { id, .. } => Some(id),
            Reply::Done(completion) => Some(&completion.id),
            Reply::Error { id, .. } | Reply::Other { id, .. } => id.as_ref(),
        }
    }

    /// Whether this line ends a generation's reply (`done` or `error`); a token, a
    /// `queued` line or a line type newer than this client does not.
    pub fn is_final(&self) -> bool {
        matches!(self, Reply::Done(_) | Reply::Error { .. })
    }

    /// The place a `queued` line reports (a streamed request waiting for a slot).
    pub fn queue_position(&self) -> Option<QueuePosition> {
        match self {
            Reply::Other { kind, line, .. } if kind == "queued" => QueuePosition::from_line(line),
            _ => None,
        }
    }
}

/// The fields this client reads from a line; every other field is skipped.
#[derive(Deserialize)]
struct RawLine<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow, default)]
    id: Option<Id<'a>>,
    #[serde(borrow, default)]
    text: Cow<'a, str>,
    #[serde(borrow, default)]
    finish_reason: Cow<'a, str>,
    #[serde(default)]
    stop_sequence: Option<String>,
    #[serde(default)]
    truncated: bool,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    timings: Option<Timings>,
    #[serde(borrow, default)]
    code: Cow<'a, str>,
    #[serde(borrow, default)]
    message: Cow<'a, str>,
    #[serde(default)]
    logprobs: Option<Vec<TokenLogprob>>,
    #[serde(default)]
    tool_calls: Option<Vec<ToolCall>>,
}

/// Parses one reply line (without or with its trailing newline).
pub fn parse_reply(line: &[u8]) -> Result<Reply<'_>, Error> {
    let raw: RawLine<'_> = serde_json::from_slice(line)?;
    Ok(match &*raw.kind {
        "token" => Reply::Token {
            id: raw
                .id
                .ok_or_else(|| Error::Unexpected("token line without id".into()))?,
            text: raw.text,
            logprobs: raw.logprobs.unwrap_or_default(),
        },
        "done" => Reply::Done(Completion {
            id: raw.id.map_or(Id::Str(Cow::Borrowed("")), Id::into_owned),
            text: raw.text.into_owned(),
            finish_reason: FinishReason::parse(&raw.finish_reason),
            stop_sequence: raw.stop_sequence,
            truncated: raw.truncated,
            usage: raw.usage.unwrap_or_default(),
            timings: raw.timings.unwrap_or_default(),
            logprobs: raw.logprobs,
            tool_calls: raw.tool_calls,
        }),
        "error" => Reply::Error {
            id: raw.id,
            code: raw.code.into_owned(),
            message: raw.message.into_owned(),
        },
        _ => Reply::Other {
            kind: raw.kind.into_owned(),
            id: raw.id,
            line: serde_json::from_slice(line)?,
        },
    })
}

/// Reads reply lines from any buffered reader (the client reads its socket through this).
#[derive(Debug)]
pub struct ReplyReader<R> {
    inner: R,
    line: Vec<u8>,
}

impl<R: BufRead> ReplyReader<R> {
    pub fn new(inner: R) -> Self {
        ReplyReader {
            inner,
            line: Vec::with_capacity(256),
        }
    }

    /// The next reply line, or `None` at a clean end of input. Blank lines are skipped;
    /// input that ends in the middle of a line is [`Error::Closed`].
    pub fn next_reply(&mut self) -> Result<Option<Reply<'_>>, Error> {
        loop {
            self.line.clear();
            if self.inner.read_until(b'\n', &mut self.line)? == 0 {
                return Ok(None);
            }
            if self.line.last() != Some(&b'\n') {
                return Err(Error::Closed);
            }
            if !self.line.iter().all(u8::is_ascii_whitespace) {
                break;
            }
        }
        parse_reply(&self.line).map(Some)
    }

    pub fn get_ref(&self) -> &R {
        &self.inner
    }

    pub fn into_inner(self) -> R {
        self.inner
    }
}

// ---------------------------------------------------------------------------------------
// Connection

/// One open connection; `broken` once it can no longer be trusted to be in step with the
/// daemon (I/O or parse error, reply for another request, a closing error code).
struct Conn {
    reader: ReplyReader<BufReader<UnixStream>>,
    broken: bool,
}

impl Conn {
    fn new(stream: UnixStream) -> Self {
        Conn {
            reader: ReplyReader::new(BufReader::with_capacity(64 * 1024, stream)),
            broken: false,
        }
    }

    fn stream(&self) -> &UnixStream {
        self.reader.get_ref().get_ref()
    }

    /// The next line of request `id`'s reply; an error line becomes `Error::Protocol`.
    fn read_for(&mut self, id: &str) -> Result<Reply<'_>, Error> {
        if self.broken {
            return Err(Error::Closed);
        }
        let failure = match self.reader.next_reply() {
            Ok(Some(Reply::Error {
                id: reply_id,
                code,
                message,
            })) => {
                // A protocol error is in step only when it answers this request.
                if !matches!(&reply_id, Some(r) if r.is_str(id)) || closes_connection(&code) {
                    self.broken = true;
                }
                Error::Protocol { code, message }
            }
            Ok(Some(reply)) => match reply.id() {
                Some(reply_id) if reply_id.is_str(id) => return Ok(reply),
                other => Error::Unexpected(format!(
                    "a reply for {:?} while waiting for {id:?}",
                    other.map(ToString::to_string)
                )),
            },
            Ok(None) => Error::Closed,
            Err(error) => error,
        };
        if !matches!(failure, Error::Protocol { .. }) {
            self.broken = true;
        }
        Err(failure)
    }
}

/// What a streaming callback returns: `()` or `true` or `ControlFlow::Continue(())` to keep
/// going, `false` or `ControlFlow::Break(())` to cancel the generation.
pub trait StreamControl {
    fn keep_going(self) -> bool;
}

impl StreamControl for () {
    fn keep_going(self) -> bool {
        true
    }
}

impl StreamControl for bool {
    fn keep_going(self) -> bool {
        self
    }
}

impl StreamControl for ControlFlow<()> {
    fn keep_going(self) -> bool {
        matches!(self, ControlFlow::Continue(()))
    }
}

/// A connection to the daemon.
pub struct Client {
    path: Option<PathBuf>,
    timeout: Option<Duration>,
    conn: Option<Conn>,
    next_id: u64,
    out: Vec<u8>,
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("path", &self.path)
            .field("timeout", &self.timeout)
            .field("connected", &matches!(&self.conn, Some(c) if !c.broken))
            .finish()
    }
}

impl Client {
    /// Connects to `path`, or with `None` to `$SFCORE_SOCKET`, else `/tmp/sfcore-ai.sock`.
    ///
    /// After a failed call leaves the connection out of step (an I/O error, a timeout, a
    /// closing error code), the next call opens a new connection to the same path.
    pub fn connect(path: Option<&Path>) -> Result<Client, Error> {
        let path = path.map_or_else(default_socket_path, Path::to_path_buf);
        let mut client = Client {
            path: Some(path),
            timeout: None,
            conn: None,
            next_id: 1,
            out: Vec::with_capacity(256),
        };
        client.conn()?;
        Ok(client)
    }

    /// A client on an already connected socket (socket activation, tests, `UnixStream::pair`).
    /// It cannot reconnect.
    pub fn from_stream(stream: UnixStream) -> Client {
        Client {
            path: None,
            timeout: None,
            conn: Some(Conn::new(stream)),
            next_id: 1,
            out: Vec::with_capacity(256),
        }
    }

    /// The socket path (`None` for [`Client::from_stream`]).
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Bounds every read and write on the connection (`None`, the default: wait forever).
    /// A request queued behind long generations waits for its first line that long too.
    pub fn set_timeout(&mut self, timeout: Option<Duration>) -> Result<(), Error> {
        self.timeout = timeout;
        if let Some(conn) = &self.conn {
            conn.stream().set_read_timeout(timeout)?;
            conn.stream().set_write_timeout(timeout)?;
        }
        Ok(())
    }

    fn conn(&mut self) -> Result<&mut Conn, Error> {
        if !matches!(&self.conn, Some(conn) if !conn.broken) {
            self.conn = None;
            let path = self.path.as_ref().ok_or(Error::Closed)?;
            let stream = UnixStream::connect(path).map_err(|source| Error::Connect {
                path: path.clone(),
                source,
            })?;
            stream.set_read_timeout(self.timeout)?;
            stream.set_write_timeout(self.timeout)?;
            self.conn = Some(Conn::new(stream));
        }
        Ok(self.conn.as_mut().expect("connected above"))
    }

    /// Closes a connection that is out of step now, so the daemon frees what it holds.
    fn reap(&mut self) {
        if matches!(&self.conn, Some(conn) if conn.broken) {
            self.conn = None;
        }
    }

    fn new_id(&mut self) -> String {
        let id = format!("rs-{}", self.next_id);
        self.next_id += 1;
        id
    }

    /// Sends one request line.
    fn send<T: Serialize>(&mut self, request: &T) -> Result<(), Error> {
        let mut out = std::mem::take(&mut self.out);
        out.clear();
        serde_json::to_writer(&mut out, request)?;
        out.push(b'\n');
        let result = self.conn().and_then(|conn| {
            let mut stream = conn.stream();
            stream.write_all(&out).map_err(|error| {
                conn.broken = true;
                Error::Io(error)
            })
        });
        self.out = out;
        self.reap();
        result
    }

    fn start(
        &mut self,
        input: Input<'_>,
        options: &Options,
        stream: bool,
    ) -> Result<String, Error> {
        let id = self.new_id();
        let (prompt, messages, op) = match input {
            Input::Prompt(prompt) => (Some(prompt), None, "generate"),
            Input::Messages(messages) => (None, Some(messages), "chat"),
        };
        self.send(&GenerationRequest {
            op,
            id: &id,
            prompt,
            messages,
            stream,
            options,
        })?;
        Ok(id)
    }

    fn whole(&mut self, input: Input<'_>, options: &Options) -> Result<Completion, Error> {
        let id = self.start(input, options, false)?;
        let result = loop {
            match self.conn.as_mut().ok_or(Error::Closed)?.read_for(&id) {
                Ok(Reply::Done(completion)) => break Ok(completion),
                // A line type newer than this client, before the `done`: skipped.
                Ok(Reply::Other { .. }) => continue,
                Ok(other) => break Err(Error::Unexpected(format!("{other:?} instead of done"))),
                Err(error) => break Err(error),
            }
        };
        if matches!(result, Err(Error::Unexpected(_))) {
            self.conn = None;
        }
        self.reap();
        result
    }

    /// Sends a single-line op and returns its reply line, which must be of type `kind`.
    fn single(&mut self, mut request: Value, kind: &str) -> Result<Value, Error> {
        let id = self.new_id();
        request["id"] = Value::from(id.as_str());
        self.send(&request)?;
        let result = match self.conn.as_mut().ok_or(Error::Closed)?.read_for(&id) {
            Ok(Reply::Other {
                kind: got, line, ..
            }) if got == kind => Ok(line),
            Ok(other) => Err(Error::Unexpected(format!("{other:?} instead of {kind}"))),
            Err(error) => Err(error),
        };
        if matches!(result, Err(Error::Unexpected(_))) {
            self.conn = None;
        }
        self.reap();
        result
    }

    /// Completes `prompt` (`stream: false`) and returns the whole text.
    pub fn generate(&mut self, prompt: &str, options: &Options) -> Result<Completion, Error> {
        self.whole(Input::Prompt(prompt), options)
    }

    /// The assistant's next turn after `messages` (`stream: false`).
    pub fn chat(&mut self, messages: &[Message], options: &Options) -> Result<Completion, Error> {
        self.whole(Input::Messages(messages), options)
    }

    /// Streams the completion of `prompt`, calling `on_piece` with each piece as it
    /// arrives. When the callback asks to stop, the generation is cancelled (the reply is
    /// drained up to its `done`) and the returned completion says `Cancelled` (or how it
    /// ended, if it ended first).
    pub fn stream_generate<F, C>(
        &mut self,
        prompt: &str,
        options: &Options,
        on_piece: F,
    ) -> Result<Completion, Error>
    where
        F: FnMut(&str) -> C,
        C: StreamControl,
    {
        self.stream_with(Input::Prompt(prompt), options, on_piece)
    }

    /// [`Client::stream_generate`] for a chat.
    pub fn stream_chat<F, C>(
        &mut self,
        messages: &[Message],
        options: &Options,
        on_piece: F,
    ) -> Result<Completion, Error>
    where
        F: FnMut(&str) -> C,
        C: StreamControl,
    {
        self.stream_with(Input::Messages(messages), options, on_piece)
    }

    fn stream_with<F, C>(
        &mut self,
        input: Input<'_>,
        options: &Options,
        mut on_piece: F,
    ) -> Result<Completion, Error>
    where
        F: FnMut(&str) -> C,
        C: StreamControl,
    {
        let mut stream = self.open_stream(input, options)?;
        loop {
            match stream.step(&mut |piece| on_piece(piece).keep_going())? {
                Step::Piece(true) => {}
                Step::Piece(false) | Step::Stop => {
                    stream.stop()?;
                    break;
                }
                Step::Finished => break,
            }
        }
        stream.completion.take().ok_or(Error::Closed)
    }

    /// Streams the completion of `prompt` as an iterator of pieces. After the last piece,
    /// [`Stream::completion`] holds the `done` line. Dropping the stream before the end
    /// cancels the generation. [`Stream::on_queued`] reports the request's place in the
    /// daemon's wait queue while it waits.
    pub fn generate_iter(&mut self, prompt: &str, options: &Options) -> Result<Stream<'_>, Error> {
        self.open_stream(Input::Prompt(prompt), options)
    }

    /// [`Client::generate_iter`] for a chat.
    pub fn chat_iter(
        &mut self,
        messages: &[Message],
        options: &Options,
    ) -> Result<Stream<'_>, Error> {
        self.open_stream(Input::Messages(messages), options)
    }

    fn open_stream(&mut self, input: Input<'_>, options: &Options) -> Result<Stream<'_>, Error> {
        let id = self.start(input, options, true)?;
        Ok(Stream {
            client: self,
            id,
            text: String::new(),
            entries: Vec::new(),
            completion: None,
            finished: false,
            queued: None,
            on_queued: None,
        })
    }

    /// The `health` line (`status`, `model`, `busy`, `queue_depth`, `uptime_s`).
    pub fn health(&mut self) -> Result<Value, Error> {
        self.single(serde_json::json!({"op": "health"}), "health")
    }

    /// The `info` line: model, effective config, llama.cpp system info, versions.
    pub fn info(&mut self) -> Result<Value, Error> {
        self.single(serde_json::json!({"op": "info"}), "info")
    }

    /// The `stats` line: counters since the daemon started.
    pub fn stats(&mut self) -> Result<Value, Error> {
        self.single(serde_json::json!({"op": "stats"}), "stats")
    }

    /// The counters, latency histograms and memory in Prometheus' text exposition format
    /// (the text `GET /metrics` serves on the OpenAI listener).
    pub fn metrics(&mut self) -> Result<String, Error> {
        let mut line = self.single(serde_json::json!({"op": "metrics"}), "metrics")?;
        Ok(serde_json::from_value(line["text"].take())?)
    }

    /// The `cache` line: what the prompt store holds (`enabled`, `dir`, and `states`, most
    /// recently used first, each with `tokens`, `bytes`, `ram`, `disk`, `preview`,
    /// `pinned_s`). With
    /// `clear` the daemon first forgets every stored state, in RAM and on disk, and
    /// `removed_states`, `removed_files`, `removed_bytes` say what went (0 for a list).
    pub fn cache(&mut self, clear: bool) -> Result<Value, Error> {
        let action = if clear { "clear" } else { "list" };
        self.single(
            serde_json::json!({"op": "cache", "action": action}),
            "cache",
        )
    }

    /// The model's token ids for `text` (`add_special`: add BOS etc. as the model expects).
    pub fn tokenize(&mut self, text: &str, add_special: bool) -> Result<Vec<u32>, Error> {
        let mut line = self.single(
            serde_json::json!({"op": "tokenize", "text": text, "add_special": add_special}),
            "tokens",
        )?;
        Ok(serde_json::from_value(line["tokens"].take())?)
    }

    /// The text of `tokens`.
    pub fn detokenize(&mut self, tokens: &[u32]) -> Result<String, Error> {
        let mut line = self.single(
            serde_json::json!({"op": "detokenize", "tokens": tokens}),
            "text",
        )?;
        Ok(serde_json::from_value(line["text"].take())?)
    }

    /// Cancels request `target` sent earlier on this connection; returns whether it was
    /// still pending. (Calls here finish their requests before returning, so to stop a
    /// running stream use [`Stream::cancel`] or drop it; this is for ids of requests the
    /// daemon may still hold, and answers `false` for any other.)
    pub fn cancel<'i>(&mut self, target: impl Into<Id<'i>>) -> Result<bool, Error> {
        let target = target.into();
        let line = self.single(
            serde_json::json!({"op": "cancel", "target": target}),
            "cancelled",
        )?;
        line["found"]
            .as_bool()
            .ok_or_else(|| Error::Unexpected("cancelled line without found".into()))
    }
}

enum Step {
    /// A piece went to the callback, which answered whether to go on.
    Piece(bool),
    /// The `done` line arrived.
    Finished,
    /// The `on_queued` callback asked to stop.
    Stop,
}

/// A streamed generation in progress: an iterator over its text pieces.
pub struct Stream<'c> {
    client: &'c mut Client,
    id: String,
    text: String,
    /// The token lines' logprobs entries, for the completion.
    entries: Vec<TokenLogprob>,
    completion: Option<Completion>,
    finished: bool,
    /// The last place in the wait queue the daemon reported.
    queued: Option<QueuePosition>,
    on_queued: Option<Box<dyn FnMut(QueuePosition) -> bool + 'c>>,
}

impl fmt::Debug for Stream<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Stream")
            .field("id", &self.id)
            .field("finished", &self.finished)
            .field("queue_position", &self.queued)
            .field("completion", &self.completion)
            .finish()
    }
}

impl<'c> Stream<'c> {
    /// The request's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Calls `on_queued` with the request's place in the daemon's wait queue each time a
    /// `queued` line reports it (before the first piece, while the iteration waits for
    /// it). Like a streaming callback it returns `()`, `true` or
    /// `ControlFlow::Continue(())` to keep waiting, `false` or `ControlFlow::Break(())` to
    /// cancel the generation (the iteration then ends, the completion `Cancelled`).
    ///
    /// ```no_run
    /// # fn main() -> Result<(), sfcore_client::Error> {
    /// use sfcore_client::{Client, Options, Priority, QueuePosition};
    /// let mut client = Client::connect(None)?;
    /// let options = Options::new().priority(Priority::Background);
    /// let stream = client.generate_iter("Summarise the log", &options)?.on_queued(
    ///     |q: QueuePosition| eprintln!("[waiting: {} of {}]", q.position, q.queue_depth),
    /// );
    /// for piece in stream {
    ///     print!("{}", piece?);
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn on_queued<F, C>(mut self, mut on_queued: F) -> Self
    where
        F: FnMut(QueuePosition) -> C + 'c,
        C: StreamControl,
    {
        self.on_queued = Some(Box::new(move |place| on_queued(place).keep_going()));
        self
    }

    /// The last place in the daemon's wait queue reported for the request (a `queued`
    /// line), or `None`: it never waited, or the daemon does not report it.
    pub fn queue_position(&self) -> Option<QueuePosition> {
        self.queued
    }

    /// The `done` line, once the stream has ended with one (its `text` filled in with the
    /// streamed pieces).
    pub fn completion(&self) -> Option<&Completion> {
        self.completion.as_ref()
    }

    /// Takes the completion out of a finished stream.
    pub fn into_completion(mut self) -> Option<Completion> {
        self.completion.take()
    }

    /// Whether the request's reply has ended (`done`, `error`, or a failed connection).
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    fn conn(&mut self) -> Result<&mut Conn, Error> {
        self.client.conn.as_mut().ok_or(Error::Closed)
    }

    /// Reads this request's reply up to its next piece or its end. A `queued` line goes to
    /// `on_queued`; a line type newer than this client is skipped.
    fn step(&mut self, on_piece: &mut dyn FnMut(&str) -> bool) -> Result<Step, Error> {
        loop {
            if let Some(step) = self.step_line(on_piece)? {
                return Ok(step);
            }
        }
    }

    /// Reads one line of this request's reply; `None` for a line that is neither a piece
    /// nor the end.
    fn step_line(&mut self, on_piece: &mut dyn FnMut(&str) -> bool) -> Result<Option<Step>, Error> {
        if self.finished {
            return Ok(Some(Step::Finished));
        }
        let id = &self.id;
        let reply = self
            .client
            .conn
            .as_mut()
            .ok_or(Error::Closed)
            .and_then(|conn| conn.read_for(id));
        match reply {
            Ok(Reply::Token { text, logprobs, .. }) => {
                self.text.push_str(&text);
                self.entries.extend(logprobs);
                Ok(Some(Step::Piece(on_piece(&text))))
            }
            Ok(Reply::Done(mut completion)) => {
                if completion.text.is_empty() {
                    completion.text = std::mem::take(&mut self.text);
                }
                if let Some(rest) = completion.logprobs.take() {
                    let mut entries = std::mem::take(&mut self.entries);
                    entries.extend(rest);
                    completion.logprobs = Some(entries);
                }
                self.completion = Some(completion);
                self.finished = true;
                Ok(Some(Step::Finished))
            }
            // Not the end: the request's place in the wait queue, or a line of a type newer
            // than this client (skipped).
            Ok(Reply::Other { line, .. }) => {
                let place = match QueuePosition::from_line(&line) {
                    Some(place) => place,
                    None => return Ok(None),
                };
                self.queued = Some(place);
                let stop = match &mut self.on_queued {
                    Some(on_queued) => !on_queued(place),
                    None => false,
                };
                Ok(if stop { Some(Step::Stop) } else { None })
            }
            Ok(other) => {
                let what = format!("{other:?} in a generation's reply");
                self.finished = true;
                if let Some(conn) = &mut self.client.conn {
                    conn.broken = true;
                }
                Err(Error::Unexpected(what))
            }
            Err(error) => {
                self.finished = true;
                Err(error)
            }
        }
    }

    /// Cancels the generation and reads its reply to the end. Returns whether the daemon
    /// still had it (`false` when it had finished already); [`Stream::completion`] then
    /// holds its `done` line (`finish_reason` `Cancelled` if it was stopped).
    pub fn cancel(&mut self) -> Result<bool, Error> {
        if self.finished {
            return Ok(false);
        }
        self.on_queued = None; // nothing to report about a request being stopped
        let cancel_id = self.client.new_id();
        let request = serde_json::json!({"op": "cancel", "id": cancel_id, "target": self.id});
        if let Err(error) = self.client.send(&request) {
            self.finished = true;
            return Err(error);
        }
        // Replies come in request order: the rest of the target's reply, then ours.
        while !self.finished {
            match self.step(&mut |_| true) {
                // The target ended with an error line of its own: nothing left to cancel.
                Ok(_) | Err(Error::Protocol { .. }) => {}
                Err(error) => return Err(error),
            }
        }
        let conn = self.conn()?;
        let found = match conn.read_for(&cancel_id)? {
            Reply::Other { kind, line, .. } if kind == "cancelled" => line["found"].as_bool(),
            _ => None,
        };
        found.ok_or_else(|| {
            conn.broken = true;
            Error::Unexpected("no cancelled line for the cancel request".into())
        })
    }

    /// Cancel for drop and for a callback's stop: bounded by a per-line timeout, and
    /// closes the connection when it cannot drain it.
    fn stop(&mut self) -> Result<(), Error> {
        let drain_timeout = Some(
            self.client
                .timeout
                .map_or(DRAIN_TIMEOUT, |t| t.min(DRAIN_TIMEOUT)),
        );
        let previous = self.client.timeout;
        if let Some(conn) = &self.client.conn {
            let _ = conn.stream().set_read_timeout(drain_timeout);
        }
        let result = self.cancel().map(drop);
        if let Some(conn) = &self.client.conn {
            if conn.stream().set_read_timeout(previous).is_err() {
                self.client.conn = None;
            }
        }
        self.client.reap();
        match result {
            // A daemon without the cancel op answers invalid_request, after the whole
            // generation: the connection is still in step.
            Err(Error::Protocol { .. }) => Ok(()),
            other => other,
        }
    }
}

impl Iterator for Stream<'_> {
    type Item = Result<String, Error>;

    fn next(&mut self) -> Option<Self::Item> {
        let mut piece = None;
        match self.step(&mut |text| {
            piece = Some(text.to_owned());
            true
        }) {
            Ok(Step::Piece(_)) => piece.map(Ok),
            Ok(Step::Finished) => None,
            // on_queued asked to stop: cancel, drain, and end the iteration.
            Ok(Step::Stop) => self.stop().err().map(Err),
            Err(error) => Some(Err(error)),
        }
    }
}

impl Drop for Stream<'_> {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.stop();
        }
        self.client.reap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_text_borrows_the_line_unless_escaped() {
        let line = br#"{"type":"token","id":"rs-1","text":" dengan"}"#;
        match parse_reply(line).unwrap() {
            Reply::Token { id, text, .. } => {
                assert!(id.is_str("rs-1"));
                assert!(matches!(text, Cow::Borrowed(" dengan")));
            }
            other => panic!("{other:?}"),
        }
        let line = br#"{"type":"token","id":7,"text":"\u65e5\u672c \ud83d\ude00 \"q\"\n"}"#;
        match parse_reply(line).unwrap() {
            Reply::Token { id, text, .. } => {
                assert_eq!(id, Id::Num(7));
                assert_eq!(text, "日本 😀 \"q\"\n");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn raw_utf8_and_lone_surrogates() {
        let line = "{\"type\":\"token\",\"id\":\"a\",\"text\":\"café 東京\"}".as_bytes();
        assert!(
            matches!(parse_reply(line).unwrap(), Reply::Token { text, .. } if text == "café 東京")
        );
        let line = br#"{"type":"token","id":"a","text":"\ud83d"}"#;
        assert!(matches!(parse_reply(line), Err(Error::Json(_))));
        assert!(matches!(
            parse_reply(b"{\"type\":\"token\",\"id\":\"a\",\"text\":\"\xff\"}"),
            Err(Error::Json(_))
        ));
    }

    #[test]
    fn done_line() {
        let line = br#"{"type":"done","id":"sfc-1","text":"","finish_reason":"length","stop_sequence":null,"usage":{"prompt_tokens":9,"cached_tokens":0,"completion_tokens":100},"timings":{"queued_ms":1.309,"prompt_ms":75.258,"prompt_tok_s":119.59,"first_token_ms":86.017,"decode_ms":2440.319,"decode_tok_s":40.57,"total_ms":2526.526}}"#;
        let Reply::Done(done) = parse_reply(line).unwrap() else {
            panic!()
        };
        assert_eq!(done.id, Id::from("sfc-1".to_string()));
        assert_eq!(done.finish_reason, FinishReason::Length);
        assert_eq!(done.stop_sequence, None);
        assert_eq!(
            done.usage,
            Usage {
                prompt_tokens: 9,
                cached_tokens: 0,
                completion_tokens: 100,
                ..Usage::default()
            }
        );
        assert_eq!(done.timings.first_token_ms, 86.017);
        let line = br#"{"type":"done","id":"x","text":"a\tb","finish_reason":"stop_sequence","stop_sequence":"\n\n","usage":{},"timings":{},"future_field":[1,{"a":2}]}"#;
        let Reply::Done(done) = parse_reply(line).unwrap() else {
            panic!()
        };
        assert_eq!(done.text, "a\tb");
        assert_eq!(done.finish_reason, FinishReason::StopSequence);
        assert_eq!(done.stop_sequence.as_deref(), Some("\n\n"));
        let line = br#"{"type":"done","id":"x","text":"","finish_reason":"novel"}"#;
        let Reply::Done(done) = parse_reply(line).unwrap() else {
            panic!()
        };
        assert_eq!(done.finish_reason, FinishReason::Other("novel".into()));
    }

    #[test]
    fn error_and_other_lines() {
        let line = br#"{"type":"error","id":"rs-2","code":"invalid_request","message":"$.max_tokens: must be >= 1"}"#;
        assert_eq!(
            parse_reply(line).unwrap(),
            Reply::Error {
                id: Some(Id::from("rs-2")),
                code: "invalid_request".into(),
                message: "$.max_tokens: must be >= 1".into()
            }
        );
        let line = br#"{"type":"tokens","id":"rs-3","tokens":[2,9259]}"#;
        let Reply::Other { kind, line, .. } = parse_reply(line).unwrap() else {
            panic!()
        };
        assert_eq!(kind, "tokens");
        assert_eq!(line["tokens"], serde_json::json!([2, 9259]));
        let line = br#"{"type":"health","id":"rs-4","status":"ok","model":"Gemma","busy":false,"queue_depth":0,"uptime_s":1.5}"#;
        assert!(
            matches!(parse_reply(line).unwrap(), Reply::Other { kind, .. } if kind == "health")
        );
        assert!(matches!(parse_reply(b"[1]"), Err(Error::Json(_))));
        assert!(matches!(parse_reply(b"{\"id\":1}"), Err(Error::Json(_))));
    }

    #[test]
    fn reader_handles_long_lines_blank_lines_and_truncation() {
        let long = "é".repeat(200_000);
        let input = format!(
            "\n{{\"type\":\"done\",\"id\":\"a\",\"text\":\"{long}\",\"finish_reason\":\"length\"}}\n  \n{{\"type\":\"token\",\"id\":\"a\",\"text\":\"x\"}}\n{{\"type\""
        );
        let mut reader = ReplyReader::new(input.as_bytes());
        let Some(Reply::Done(done)) = reader.next_reply().unwrap() else {
            panic!()
        };
        assert_eq!(done.text, long);
        assert!(matches!(
            reader.next_reply().unwrap(),
            Some(Reply::Token { .. })
        ));
        assert!(matches!(reader.next_reply(), Err(Error::Closed)));
        let mut reader = ReplyReader::new(&b""[..]);
        assert!(reader.next_reply().unwrap().is_none());
    }

    #[test]
    fn requests_serialize_only_set_options() {
        let options = Options::new()
            .max_tokens(32)
            .temperature(0.0)
            .seed(7)
            .stop("\n");
        let request = GenerationRequest {
            op: "generate",
            id: "rs-1",
            prompt: Some("日本\"語\""),
            messages: None,
            stream: true,
            options: &options,
        };
        assert_eq!(
            serde_json::to_string(&request).unwrap(),
            r#"{"op":"generate","id":"rs-1","prompt":"日本\"語\"","stream":true,"max_tokens":32,"temperature":0.0,"seed":7,"stop":["\n"]}"#
        );
        let messages = [Message::system("Be brief."), Message::user("Hi")];
        let request = GenerationRequest {
            op: "chat",
            id: "rs-2",
            prompt: None,
            messages: Some(&messages),
            stream: false,
            options: &Options::default(),
        };
        assert_eq!(
            serde_json::to_string(&request).unwrap(),
            r#"{"op":"chat","id":"rs-2","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}],"stream":false}"#
        );
    }

    #[test]
    fn structured_output_options_and_truncated() {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"]
        });
        let options = Options::new().max_tokens(64).json_schema(schema.clone());
        let request = GenerationRequest {
            op: "generate",
            id: "rs-1",
            prompt: Some("p"),
            messages: None,
            stream: false,
            options: &options,
        };
        let sent = serde_json::to_string(&request).unwrap();
        // Properties keep the order written: the daemon writes them in that order.
        assert!(
            sent.contains(r#""properties":{"name":{"type":"string"},"age":{"type":"integer"}}"#),
            "{sent}"
        );
        let sent: Value = serde_json::from_str(&sent).unwrap();
        assert_eq!(sent["json_schema"], schema);
        // Unset ones are not sent at all: the daemon takes at most one of the three.
        assert!(
            sent.get("format").is_none() && sent.get("grammar").is_none(),
            "{sent}"
        );
        let options = Options::new().format("json");
        let request = GenerationRequest {
            op: "chat",
            id: "rs-2",
            prompt: None,
            messages: Some(&[]),
            stream: true,
            options: &options,
        };
        assert_eq!(
            serde_json::to_string(&request).unwrap(),
            r#"{"op":"chat","id":"rs-2","messages":[],"stream":true,"format":"json"}"#
        );
        let options = Options::new().grammar("root ::= \"a\"");
        assert_eq!(
            serde_json::to_string(&options).unwrap(),
            r#"{"grammar":"root ::= \"a\""}"#
        );

        let line =
            br#"{"type":"done","id":"x","text":"{}","finish_reason":"length","truncated":true}"#;
        let Reply::Done(done) = parse_reply(line).unwrap() else {
            panic!()
        };
        assert!(done.truncated);
        let line = br#"{"type":"done","id":"x","text":"{}","finish_reason":"stop"}"#;
        let Reply::Done(done) = parse_reply(line).unwrap() else {
            panic!()
        };
        assert!(!done.truncated);
    }

    #[test]
    fn errors_display() {
        let error = Error::Connect {
            path: "/nowhere.sock".into(),
            source: io::Error::from(io::ErrorKind::NotFound),
        };
        let text = error.to_string();
        assert!(
            text.contains("/nowhere.sock") && text.contains("daemon running"),
            "{text}"
        );
        let error = Error::Protocol {
            code: "queue_full".into(),
            message: "busy".into(),
        };
        assert_eq!(error.to_string(), "queue_full: busy");
        assert_eq!(error.code(), Some("queue_full"));
    }

    /// A fake daemon on a socket pair: checks the client's requests and answers them.
    fn fake_daemon(script: Vec<(&'static str, String)>) -> (Client, std::thread::JoinHandle<()>) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let handle = std::thread::spawn(move || {
            let mut reader = BufReader::new(theirs.try_clone().unwrap());
            let mut writer = theirs;
            for (expect, answer) in script {
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                assert!(line.contains(expect), "{line:?} lacks {expect:?}");
                writer.write_all(answer.as_bytes()).unwrap();
            }
        });
        (Client::from_stream(ours), handle)
    }

    #[test]
    fn stream_stops_with_cancel_and_drains() {
        let tokens: String = (0..5)
            .map(|i| format!("{{\"type\":\"token\",\"id\":\"rs-1\",\"text\":\"t{i} \"}}\n"))
            .collect();
        let script = vec![
            (r#""op":"generate","id":"rs-1""#, tokens),
            (
                r#""op":"cancel","id":"rs-2","target":"rs-1""#,
                "{\"type\":\"token\",\"id\":\"rs-1\",\"text\":\"late\"}\n\
                 {\"type\":\"done\",\"id\":\"rs-1\",\"text\":\"\",\"finish_reason\":\"cancelled\",\"stop_sequence\":null}\n\
                 {\"type\":\"cancelled\",\"id\":\"rs-2\",\"target\":\"rs-1\",\"found\":true}\n"
                    .to_string(),
            ),
            (r#""op":"health""#, "{\"type\":\"health\",\"id\":\"rs-3\",\"status\":\"ok\"}\n".to_string()),
        ];
        let (mut client, daemon) = fake_daemon(script);
        let mut seen = Vec::new();
        let done = client
            .stream_generate("p", &Options::new(), |piece: &str| {
                seen.push(piece.to_owned());
                if seen.len() == 2 {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            })
            .unwrap();
        assert_eq!(seen, ["t0 ", "t1 "]);
        assert_eq!(done.finish_reason, FinishReason::Cancelled);
        assert_eq!(done.text, "t0 t1 t2 t3 t4 late");
        assert_eq!(client.health().unwrap()["status"], "ok");
        daemon.join().unwrap();
    }

    #[test]
    fn priority_is_sent_only_when_given() {
        let options = Options::new().priority(Priority::Background);
        let request = GenerationRequest {
            op: "chat",
            id: "rs-1",
            prompt: None,
            messages: Some(&[]),
            stream: true,
            options: &options,
        };
        assert_eq!(
            serde_json::to_string(&request).unwrap(),
            r#"{"op":"chat","id":"rs-1","messages":[],"stream":true,"priority":"background"}"#
        );
        let interactive = Options::new().priority(Priority::Interactive);
        let text = serde_json::to_string(&interactive).unwrap();
        assert_eq!(text, r#"{"priority":"interactive"}"#);
        assert!(!serde_json::to_string(&Options::new())
            .unwrap()
            .contains("priority"));
    }

    #[test]
    fn queued_lines_report_the_place_and_unknown_lines_are_skipped() {
        let waits = |id: &str| {
            format!(
                "{{\"type\":\"queued\",\"id\":\"{id}\",\"position\":2,\"queue_depth\":3}}\n\
                 {{\"type\":\"queued\",\"id\":\"{id}\",\"position\":1,\"queue_depth\":2}}\n"
            )
        };
        let rest = |id: &str| {
            format!(
                "{{\"type\":\"future_kind\",\"id\":\"{id}\",\"detail\":[1,2]}}\n\
                 {{\"type\":\"token\",\"id\":\"{id}\",\"text\":\"Hi\"}}\n\
                 {{\"type\":\"token\",\"id\":\"{id}\",\"text\":\"!\"}}\n\
                 {{\"type\":\"done\",\"id\":\"{id}\",\"text\":\"\",\"finish_reason\":\"stop\"}}\n"
            )
        };
        let script = vec![
            (r#""priority":"background""#, waits("rs-1") + &rest("rs-1")),
            (r#""op":"chat","id":"rs-2""#, waits("rs-2") + &rest("rs-2")),
            (
                r#""op":"generate","id":"rs-3""#,
                "{\"type\":\"future_kind\",\"id\":\"rs-3\"}\n\
                 {\"type\":\"done\",\"id\":\"rs-3\",\"text\":\"Hi!\",\"finish_reason\":\"stop\"}\n"
                    .to_string(),
            ),
            // Still waiting when on_queued asks to stop: the cancel ends it.
            (r#""op":"generate","id":"rs-4""#, waits("rs-4")),
            (
                r#""op":"cancel","id":"rs-5","target":"rs-4""#,
                "{\"type\":\"done\",\"id\":\"rs-4\",\"text\":\"\",\"finish_reason\":\"cancelled\"}\n\
                 {\"type\":\"cancelled\",\"id\":\"rs-5\",\"target\":\"rs-4\",\"found\":true}\n"
                    .to_string(),
            ),
            (r#""op":"health""#, "{\"type\":\"health\",\"id\":\"rs-6\",\"status\":\"ok\"}\n".to_string()),
        ];
        let (mut client, daemon) = fake_daemon(script);
        let first = QueuePosition {
            position: 2,
            queue_depth: 3,
        };
        let next = QueuePosition {
            position: 1,
            queue_depth: 2,
        };

        let mut places = Vec::new();
        let options = Options::new().priority(Priority::Background);
        let mut stream = client
            .generate_iter("p", &options)
            .unwrap()
            .on_queued(|place: QueuePosition| places.push(place));
        assert_eq!(stream.queue_position(), None);
        let pieces: Vec<String> = (&mut stream).map(Result::unwrap).collect();
        assert_eq!(pieces, ["Hi", "!"]);
        assert_eq!(stream.queue_position(), Some(next));
        let done = stream.into_completion().unwrap();
        assert_eq!(
            (done.text.as_str(), done.finish_reason),
            ("Hi!", FinishReason::Stop)
        );
        assert_eq!(places, [first, next]);

        // The callback form: the same pieces.
        let mut seen = Vec::new();
        let done = client
            .stream_chat(&[Message::user("Hi")], &Options::new(), |piece: &str| {
                seen.push(piece.to_owned())
            })
            .unwrap();
        assert_eq!(
            (seen.concat(), done.text.as_str()),
            ("Hi!".to_string(), "Hi!")
        );

        // Not streamed: the unknown line before the done is skipped.
        assert_eq!(client.generate("p", &Options::new()).unwrap().text, "Hi!");

        // on_queued returning false cancels the request and ends the iteration.
        let mut stream = client
            .generate_iter("p", &Options::new())
            .unwrap()
            .on_queued(|place: QueuePosition| place.position > 1);
        assert!(stream.next().is_none());
        assert_eq!(stream.queue_position(), Some(next));
        let done = stream.completion().unwrap();
        assert_eq!(done.finish_reason, FinishReason::Cancelled);
        drop(stream);
        assert_eq!(client.health().unwrap()["status"], "ok");
        daemon.join().unwrap();

        let line = br#"{"type":"queued","id":"rs-9","position":3,"queue_depth":4}"#;
        let reply = parse_reply(line).unwrap();
        assert!(!reply.is_final());
        assert_eq!(
            reply.queue_position(),
            Some(QueuePosition {
                position: 3,
                queue_depth: 4
            })
        );
        let health = br#"{"type":"health","id":"rs-9","queue_depth":4}"#;
        assert_eq!(parse_reply(health).unwrap().queue_position(), None);
    }

    #[test]
    fn dropped_iterator_cancels_and_error_lines_are_typed() {
        let script = vec![
            (r#""op":"chat""#, "{\"type\":\"token\",\"id\":\"rs-1\",\"text\":\"Hi\"}\n".to_string()),
            (
                r#""target":"rs-1""#,
                "{\"type\":\"done\",\"id\":\"rs-1\",\"text\":\"\",\"finish_reason\":\"cancelled\"}\n\
                 {\"type\":\"cancelled\",\"id\":\"rs-2\",\"target\":\"rs-1\",\"found\":true}\n"
                    .to_string(),
            ),
            (
                r#""max_tokens":0"#,
                "{\"type\":\"error\",\"id\":\"rs-3\",\"code\":\"invalid_request\",\"message\":\"$.max_tokens\"}\n"
                    .to_string(),
            ),
            (r#""op":"tokenize""#, "{\"type\":\"tokens\",\"id\":\"rs-4\",\"tokens\":[2,3]}\n".to_string()),
        ];
        let (mut client, daemon) = fake_daemon(script);
        {
            let mut stream = client
                .chat_iter(&[Message::user("Hello")], &Options::new())
                .unwrap();
            assert_eq!(stream.next().unwrap().unwrap(), "Hi");
        }
        let mut options = Options::new();
        options.max_tokens = Some(0);
        let error = client.generate("x", &options).unwrap_err();
        assert_eq!(error.code(), Some("invalid_request"));
        assert_eq!(client.tokenize("x", true).unwrap(), [2, 3]);
        daemon.join().unwrap();
    }

    #[test]
    fn cache_lists_and_clears() {
        let state = r#"{"tokens":120,"bytes":843776,"ram":true,"disk":false,"preview":"Line 0"}"#;
        let script = vec![
            (
                r#"{"op":"cache","action":"list","id":"rs-1"}"#,
                format!(
                    "{{\"type\":\"cache\",\"id\":\"rs-1\",\"enabled\":true,\"dir\":null,\"states\":[{state}],\
                     \"removed_states\":0,\"removed_files\":0,\"removed_bytes\":0}}\n"
                ),
            ),
            (
                r#"{"op":"cache","action":"clear","id":"rs-2"}"#,
                "{\"type\":\"cache\",\"id\":\"rs-2\",\"enabled\":true,\"dir\":null,\"states\":[],\
                 \"removed_states\":1,\"removed_files\":0,\"removed_bytes\":843776}\n"
                    .to_string(),
            ),
            (
                r#""op":"cache""#,
                "{\"type\":\"stats\",\"id\":\"rs-3\"}\n".to_string(),
            ),
        ];
        let (mut client, daemon) = fake_daemon(script);
        let listed = client.cache(false).unwrap();
        assert_eq!(listed["enabled"], true);
        assert_eq!(
            listed["states"][0],
            serde_json::from_str::<Value>(state).unwrap()
        );
        assert_eq!(listed["removed_states"], 0);
        let cleared = client.cache(true).unwrap();
        assert_eq!(cleared["states"], serde_json::json!([]));
        assert_eq!(cleared["removed_states"], 1);
        assert_eq!(cleared["removed_bytes"], 843776);
        // A line of another type is not the reply: the connection is out of step.
        assert!(matches!(client.cache(false), Err(Error::Unexpected(_))));
        daemon.join().unwrap();
    }

    #[test]
    fn logprobs_entries_are_gathered_and_metrics_is_the_text() {
        let entry = |token: u32, bytes: &str, logprob: f64| {
            format!(
                "{{\"token\":{token},\"text\":\"x\",\"bytes\":{bytes},\"logprob\":{logprob},\
                 \"top_logprobs\":[{{\"token\":{token},\"text\":\"x\",\"bytes\":{bytes},\"logprob\":{logprob}}}]}}"
            )
        };
        let (first, second, third) = (
            entry(5, "[230,151]", -0.5),
            entry(6, "[165]", -0.25),
            entry(7, "[33]", 0.0),
        );
        let script = vec![
            (
                r#""frequency_penalty":0.5,"presence_penalty":-1.0,"seed":7,"logprobs":1"#,
                format!(
                    "{{\"type\":\"token\",\"id\":\"rs-1\",\"text\":\"日\",\"logprobs\":[{first},{second}]}}\n\
                     {{\"type\":\"token\",\"id\":\"rs-1\",\"text\":\"!\"}}\n\
                     {{\"type\":\"done\",\"id\":\"rs-1\",\"text\":\"\",\"finish_reason\":\"stop\",\"logprobs\":[{third}]}}\n"
                ),
            ),
            (
                r#""stream":false"#,
                format!(
                    "{{\"type\":\"done\",\"id\":\"rs-2\",\"text\":\"日!\",\"finish_reason\":\"stop\",\
                     \"logprobs\":[{first},{second},{third}]}}\n"
                ),
            ),
            (
                r#""stream":false"#,
                "{\"type\":\"done\",\"id\":\"rs-3\",\"text\":\"x\",\"finish_reason\":\"stop\"}\n"
                    .to_string(),
            ),
            (
                r#"{"op":"metrics","id":"rs-4"}"#,
                "{\"type\":\"metrics\",\"id\":\"rs-4\",\"text\":\"# TYPE a counter\\na 1\\n\"}\n"
                    .to_string(),
            ),
        ];
        let (mut client, daemon) = fake_daemon(script);
        let options = Options::new()
            .frequency_penalty(0.5)
            .presence_penalty(-1.0)
            .seed(7)
            .logprobs(1);
        let streamed = client.stream_generate("p", &options, |_: &str| ()).unwrap();
        let whole = client.generate("p", &options).unwrap();
        for done in [&streamed, &whole] {
            let entries = done.logprobs.as_ref().unwrap();
            assert_eq!(
                entries.iter().map(|e| e.token).collect::<Vec<_>>(),
                [5, 6, 7]
            );
            let joined: Vec<u8> = entries.iter().flat_map(|e| e.bytes.clone()).collect();
            assert_eq!(String::from_utf8(joined).unwrap(), "日!");
            assert_eq!(
                entries[0].top_logprobs,
                [TopLogprob {
                    token: 5,
                    text: "x".into(),
                    bytes: vec![230, 151],
                    logprob: -0.5
                }]
            );
        }
        assert_eq!(streamed.text, "日!");
        assert_eq!(
            client.generate("p", &Options::new()).unwrap().logprobs,
            None
        );
        assert_eq!(client.metrics().unwrap(), "# TYPE a counter\na 1\n");
        daemon.join().unwrap();
    }

    #[test]
    fn the_daemons_numbers_come_through_exactly() {
        // Each must come out as the f64 nearest its decimal, as std's parse rounds it; the
        // last few are halfway cases or long expansions that only a correctly rounding
        // parser gets right.
        let least_subnormal_and_a_bit = format!("0.{}24703282292062328", "0".repeat(323));
        let numbers = [
            "-0.9871219318255093",
            "0.1",
            "2.2250738585072014e-308",
            "2.2250738585072011e-308",
            "5e-324",
            "1.7976931348623157e308",
            "9007199254740993",
            "-0.30000000000000004",
            "1e23",
            "8.98846567431158e307",
            "1.00000000000000011102230246251565404236316680908203125",
            "1.00000000000000011102230246251565404236316680908203125000000000000000001",
            &least_subnormal_and_a_bit,
        ];
        for number in numbers {
            let expected: f64 = number.parse().unwrap();
            let exact = |got: f64| assert_eq!(got.to_bits(), expected.to_bits(), "{number}");
            let entry = format!(
                "{{\"token\":1,\"text\":\"x\",\"bytes\":[120],\"logprob\":{number},\
                 \"top_logprobs\":[{{\"token\":1,\"text\":\"x\",\"bytes\":[120],\"logprob\":{number}}}]}}"
            );
            let token = format!(
                "{{\"type\":\"token\",\"id\":\"a\",\"text\":\"x\",\"logprobs\":[{entry}]}}"
            );
            let Reply::Token { logprobs, .. } = parse_reply(token.as_bytes()).unwrap() else {
                panic!()
            };
            exact(logprobs[0].logprob);
            exact(logprobs[0].top_logprobs[0].logprob);
            let done = format!(
                "{{\"type\":\"done\",\"id\":\"a\",\"text\":\"\",\"finish_reason\":\"stop\",\
                 \"timings\":{{\"decode_tok_s\":{number}}},\"logprobs\":[{entry}],\
                 \"tool_calls\":[{{\"id\":\"c\",\"type\":\"function\",\
                 \"function\":{{\"name\":\"f\",\"arguments\":{{\"v\":{number}}}}}}}]}}"
            );
            let Reply::Done(done) = parse_reply(done.as_bytes()).unwrap() else {
                panic!()
            };
            exact(done.timings.decode_tok_s);
            exact(done.logprobs.unwrap()[0].logprob);
            let calls = done.tool_calls.unwrap();
            exact(calls[0].function.arguments["v"].as_f64().unwrap());
            let other = format!("{{\"type\":\"stats\",\"v\":{number}}}");
            let Reply::Other { line, .. } = parse_reply(other.as_bytes()).unwrap() else {
                panic!()
            };
            exact(line["v"].as_f64().unwrap());
        }
    }

    #[test]
    fn a_reply_for_another_request_breaks_the_connection() {
        let script = vec![(
            r#""op":"generate""#,
            "{\"type\":\"done\",\"id\":\"rs-9\",\"text\":\"\",\"finish_reason\":\"stop\"}\n"
                .to_string(),
        )];
        let (mut client, daemon) = fake_daemon(script);
        assert!(matches!(
            client.generate("x", &Options::new()),
            Err(Error::Unexpected(_))
        ));
        // No path to reconnect to: the next call says the connection is gone.
        assert!(matches!(client.health(), Err(Error::Closed)));
        daemon.join().unwrap();
    }

    fn weather() -> Tool {
        Tool::function(
            "get_weather",
            "The weather in a city now",
            serde_json::json!({"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}),
        )
    }

    #[test]
    fn a_requests_tool_fields_on_the_wire() {
        let options = Options::new()
            .tools([weather(), Tool::function("now", "", Value::Null)])
            .tool_choice(ToolChoice::Required)
            .parallel_tool_calls(false);
        let call = ToolCall {
            id: "call_1".into(),
            kind: "function".into(),
            function: FunctionCall {
                name: "get_weather".into(),
                arguments: serde_json::json!({"city": "Paris"}),
            },
        };
        let messages = [
            Message::user("Weather in Paris?"),
            Message::assistant_calls("", vec![call]),
            Message::tool("call_1", "21 C, sunny"),
        ];
        let request = GenerationRequest {
            op: "chat",
            id: "rs-1",
            prompt: None,
            messages: Some(&messages),
            stream: false,
            options: &options,
        };
        assert_eq!(
            serde_json::to_string(&request).unwrap(),
            concat!(
                r#"{"op":"chat","id":"rs-1","messages":["#,
                r#"{"role":"user","content":"Weather in Paris?"},"#,
                r#"{"role":"assistant","content":"","tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":{"city":"Paris"}}}]},"#,
                r#"{"role":"tool","content":"21 C, sunny","tool_call_id":"call_1"}],"#,
                r#""stream":false,"tools":["#,
                r#"{"type":"function","function":{"name":"get_weather","description":"The weather in a city now","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}},"#,
                r#"{"type":"function","function":{"name":"now"}}],"#,
                r#""tool_choice":"required","parallel_tool_calls":false}"#
            )
        );
        // A message read back is the one sent; a plain one carries neither field.
        let back: Vec<Message> =
            serde_json::from_str(&serde_json::to_string(&messages).unwrap()).unwrap();
        assert_eq!(back, messages);
        assert_eq!(
            serde_json::to_string(&Message::assistant("hi")).unwrap(),
            r#"{"role":"assistant","content":"hi"}"#
        );
        // No tools: none of the three fields is sent.
        assert_eq!(serde_json::to_string(&Options::new()).unwrap(), "{}");
    }

    #[test]
    fn tool_choice_takes_the_wires_four_forms() {
        let cases = [
            (ToolChoice::Auto, r#""auto""#),
            (ToolChoice::Required, r#""required""#),
            (ToolChoice::None, r#""none""#),
            (
                ToolChoice::function("add"),
                r#"{"type":"function","function":{"name":"add"}}"#,
            ),
        ];
        for (choice, wire) in cases {
            assert_eq!(serde_json::to_string(&choice).unwrap(), wire);
            assert_eq!(serde_json::from_str::<ToolChoice>(wire).unwrap(), choice);
        }
        assert!(serde_json::from_str::<ToolChoice>(r#""always""#).is_err());
        assert!(
            serde_json::from_str::<ToolChoice>(r#"{"type":"tool","function":{"name":"add"}}"#)
                .is_err()
        );
        let escaped = r#"{"type":"function","function":{"name":"a\u0062"}}"#;
        assert_eq!(
            serde_json::from_str::<ToolChoice>(escaped).unwrap(),
            ToolChoice::function("ab")
        );
    }

    #[test]
    fn a_done_line_with_tool_calls() {
        let line = br#"{"type":"done","id":"rs-3","text":"","finish_reason":"tool_calls","tool_calls":[{"id":"call_5f0c","type":"function","function":{"name":"get_weather","arguments":{"city":"Paris","unit":"c"}}},{"id":"call_77","type":"function","function":{"name":"add","arguments":{"a":2,"b":3}}}],"usage":{"prompt_tokens":90,"completion_tokens":30}}"#;
        let Reply::Done(done) = parse_reply(line).unwrap() else {
            panic!()
        };
        assert_eq!(done.finish_reason, FinishReason::ToolCalls);
        assert_eq!(done.finish_reason.as_str(), "tool_calls");
        let calls = done.tool_calls.as_deref().unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].id, "call_5f0c");
        assert_eq!(calls[0].kind, "function");
        assert_eq!(calls[0].function.name, "get_weather");
        assert_eq!(calls[0].function.arguments["city"], "Paris");
        assert_eq!(
            calls[1].function.arguments,
            serde_json::json!({"a": 2, "b": 3})
        );
        // Written back as the done line had it.
        let written = serde_json::to_value(&done).unwrap();
        let original: Value = serde_json::from_slice(line).unwrap();
        assert_eq!(written["tool_calls"], original["tool_calls"]);
        assert_eq!(written["finish_reason"], "tool_calls");
        // A done line without calls: None.
        let line = br#"{"type":"done","id":"x","text":"hi","finish_reason":"stop"}"#;
        let Reply::Done(done) = parse_reply(line).unwrap() else {
            panic!()
        };
        assert_eq!(done.tool_calls, None);
    }

    #[test]
    fn a_streamed_chat_keeps_the_calls_of_its_done_line() {
        let script = vec![(
            r#""tool_choice":{"type":"function","function":{"name":"get_weather"}}"#,
            concat!(
                "{\"type\":\"token\",\"id\":\"rs-1\",\"text\":\"Sure\"}\n",
                "{\"type\":\"done\",\"id\":\"rs-1\",\"text\":\"\",\"finish_reason\":\"tool_calls\",",
                "\"tool_calls\":[{\"id\":\"call_1\",\"type\":\"function\",",
                "\"function\":{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Oslo\"}}}]}\n"
            )
            .to_string(),
        )];
        let (mut client, daemon) = fake_daemon(script);
        let options = Options::new()
            .tools([weather()])
            .tool_choice(ToolChoice::function("get_weather"));
        let done = client
            .stream_chat(&[Message::user("Oslo?")], &options, |_: &str| ())
            .unwrap();
        assert_eq!(done.text, "Sure");
        assert_eq!(done.finish_reason, FinishReason::ToolCalls);
        let calls = done.tool_calls.unwrap();
        assert_eq!(calls[0].function.arguments["city"], "Oslo");
        daemon.join().unwrap();
    }
}
