"""The corpus builder's fixed word lists: names it never renames, words for new names,
synonyms, JSON fields, chat topics and the parts of story openings."""

from __future__ import annotations

import keyword
import random
from collections.abc import Callable
from typing import Any

# Keywords, builtins and stock names of the corpus's languages: a rename of one of these
# would change what the code means, not what it calls a thing.
OTHER_RESERVED = """
self cls None True False print len str int float bool list dict set tuple bytes object type
range enumerate zip map filter sorted reversed min max sum any all abs isinstance super
open iter next repr hash id getattr setattr hasattr Exception ValueError TypeError KeyError
OSError RuntimeError StopIteration NotImplementedError IndexError AttributeError
func package import return var const type struct interface map chan go defer select case
default switch break continue fallthrough goto range nil err error string byte rune uint
int64 int32 uint64 uint32 float64 float32 make new append copy delete panic recover cap
close ctx context time fmt
fn let mut pub impl trait enum match loop move ref where use mod crate Self Some Ok Err
Box Vec String Option Result usize isize u8 u16 u32 u64 i32 i64 f32 f64 async await dyn
unsafe extern static as in
function var let const this class extends constructor undefined null true false typeof
instanceof new delete void yield await async export default throw try catch finally
Promise Error Object Array JSON Math Number Symbol Map Set console require module exports
then echo fi do done esac elif local read exit shift test set unset export source
"""
RESERVED = frozenset((*keyword.kwlist, *keyword.softkwlist, *OTHER_RESERVED.split()))
# Words prepended to a renamed identifier (in its own style: snake, camel, Pascal).
NAME_WORDS = ("current", "local", "given", "next", "inner", "main", "working", "pending",
              "chosen", "active", "target", "base", "raw", "parsed", "cached", "total")
# New parameters: (snake_case name, Python default, JavaScript default).
PARAMETERS = (("timeout", "30.0", "30000"), ("verbose", "False", "false"),
              ("retries", "3", "3"), ("encoding", '"utf-8"', '"utf-8"'),
              ("strict", "True", "true"), ("limit", "None", "null"),
              ("label", '""', '""'), ("dry_run", "False", "false"),
              ("max_items", "100", "100"), ("prefix", '"> "', '"> "'))
# Words of the docs and a replacement each, for "replace X with Y throughout".
SYNONYMS = {"request": "query", "requests": "queries", "daemon": "server",
            "model": "network", "prompt": "input", "prompts": "inputs", "token": "piece",
            "tokens": "pieces", "cache": "store", "slot": "lane", "slots": "lanes",
            "step": "pass", "steps": "passes", "thread": "worker", "threads": "workers",
            "client": "caller", "clients": "callers", "answer": "reply",
            "answers": "replies", "draft": "guess", "drafts": "guesses", "file": "document",
            "machine": "computer", "memory": "RAM", "bench": "benchmark",
            "measured": "timed", "config": "settings", "process": "program",
            "output": "result", "text": "content", "server": "service",
            "default": "standard", "length": "size", "error": "failure"}
KEY_RENAMES = {"id": ("identifier", "uid"), "name": ("title", "label"),
               "email": ("email_address",), "price": ("unit_price", "cost"),
               "status": ("state",), "created_at": ("created", "creation_time"),
               "description": ("summary", "details"), "version": ("release",),
               "timeout": ("timeout_s",), "enabled": ("active", "is_enabled"),
               "locale": ("language_tag",), "timezone": ("time_zone", "tz"),
               "username": ("login", "handle"), "roles": ("groups", "permissions"),
               "last_login": ("last_seen",), "currency": ("currency_code",),
               "items": ("line_items",), "stock": ("in_stock", "quantity"),
               "tags": ("labels", "keywords"), "message": ("text", "msg"),
               "level": ("severity",), "path": ("route", "url_path"),
               "method": ("http_method",), "title": ("name", "heading"),
               "author": ("writer", "authors"), "pages": ("page_count",),
               "port": ("listen_port",), "replicas": ("instances",), "env": ("environment",),
               "origin": ("from",), "destination": ("to",), "gate": ("boarding_gate",),
               "conditions": ("sky",), "service": ("component",)}
NEW_FIELDS = (("updated_at", "2024-06-01T12:00:00Z"), ("notes", "checked by hand"),
              ("priority", 2), ("archived", False), ("owner", "ops-team"),
              ("tags", ["reviewed"]), ("revision", 7), ("region", "eu-west-1"),
              ("comment", None), ("checksum", "sha256:9f2c1e"))

CHAT_TOPICS = (
    "how a hash table works", "recursion with a simple example", "the CAP theorem",
    "how public-key cryptography works", "what a race condition is",
    "how garbage collection works in managed languages", "what an index does in a database",
    "how DNS resolves a name", "the difference between latency and throughput",
    "how a CPU cache works", "what a mutex is", "how HTTP keep-alive works",
    "what big-O notation means", "how photosynthesis works", "why the sky is blue",
    "how vaccines train the immune system", "what inflation is", "how tides work",
    "what a black hole is", "how a bill becomes a law in a parliament",
    "how compound interest works", "what an API is", "how a compiler turns code into "
    "machine code", "what unit tests are for", "how TCP makes delivery reliable",
    "what virtual memory is", "how a bloom filter works", "what a monad is, simply",
    "how version control with git works", "how a neural network learns",
    "what tokenization means for language models", "how speculative execution in CPUs "
    "works", "what an event loop is", "how a binary search works",
    "why floating-point numbers are inexact", "how plate tectonics shapes continents",
    "how the heart pumps blood", "what a load balancer does", "how a rainbow forms",
    "what the greenhouse effect is", "how an electric motor works",
    "how a refrigerator keeps food cold", "what a content delivery network does",
    "how a search engine ranks pages", "what a Unix socket is", "how memory-mapped files "
    "work", "what quantization does to a neural network", "how a JSON parser works",
    "what backpressure is in a streaming system", "how a B-tree keeps itself balanced")
HOW_TO = ("read a file line by line", "parse a JSON string", "sort a list of records by a "
          "field", "make an HTTP GET request", "run a shell command and read its output",
          "write a unit test", "format a date as ISO 8601", "read an environment variable",
          "handle errors from a function that can fail", "split a string on whitespace",
          "measure how long a piece of code takes", "start a background thread",
          "remove duplicates from a list", "read command-line arguments",
          "connect to a Unix domain socket", "compute a SHA-256 hash of a file")
LANGUAGES = ("Python", "Go", "Rust", "JavaScript", "TypeScript", "Bash")
DIFFERENCES = (("a process", "a thread"), ("TCP", "UDP"), ("a list", "a tuple in Python"),
               ("concurrency", "parallelism"), ("a stack", "a queue"),
               ("SQL", "NoSQL databases"), ("HTTP", "HTTPS"), ("RAM", "disk storage"),
               ("a compiler", "an interpreter"), ("weather", "climate"),
               ("a virus", "a bacterium"), ("git merge", "git rebase"),
               ("authentication", "authorization"), ("an array", "a linked list"),
               ("static typing", "dynamic typing"), ("a library", "a framework"),
               ("a mutex", "a semaphore"), ("greedy decoding", "sampling"),
               ("a container", "a virtual machine"), ("encoding", "encryption"),
               ("speed", "velocity"), ("mitosis", "meiosis"), ("a loan", "a lease"),
               ("JSON", "YAML"), ("unit tests", "integration tests"),
               ("a pointer", "a reference"), ("precision", "recall"),
               ("blocking", "non-blocking I/O"), ("a fork", "a clone of a repository"),
               ("an LLM's context window", "its training data"))
TIPS = ("writing clear commit messages", "reviewing a pull request", "learning a new "
        "programming language", "keeping a small garden", "saving money on groceries",
        "running a productive meeting", "writing a good bug report", "sleeping better",
        "debugging a flaky test", "giving a short talk", "keeping a codebase readable",
        "training for a first 10 km run", "reducing the memory use of a program",
        "naming variables", "working from home", "writing documentation people read",
        "profiling a slow program", "cooking rice", "studying for an exam",
        "designing a command-line tool", "keeping secrets out of a git repository",
        "onboarding a new team member", "taking notes in lectures",
        "planning a long bike ride", "benchmarking code fairly", "writing an email to a "
        "busy person", "caring for a houseplant", "packing for a week-long trip",
        "making a service restart safely", "choosing a password manager")


def pick(*values: Any) -> Callable[[random.Random], Any]:
    return lambda rng: rng.choice(values)


def number(low: int, high: int) -> Callable[[random.Random], int]:
    return lambda rng: rng.randint(low, high)


def decimal(low: float, high: float) -> Callable[[random.Random], float]:
    return lambda rng: round(rng.uniform(low, high), 2)


def stamp(rng: random.Random) -> str:
    return (f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T"
            f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:00Z")


Field = tuple[str, Callable[[random.Random], Any]]
RECORD_FIELDS: dict[str, list[Field]] = {
    "user": [("id", number(1000, 99999)),
             ("username", pick("mlopez", "akumar", "jchen", "sobrien", "tnguyen", "ewalsh")),
             ("email", pick("maria@example.com", "dev@example.org", "ops@example.net")),
             ("full_name", pick("Maria Lopez", "Arjun Kumar", "Jia Chen", "Sean O'Brien")),
             ("created_at", stamp), ("is_active", pick(True, False)),
             ("roles", pick(["admin"], ["editor", "viewer"], ["viewer"])),
             ("locale", pick("en-GB", "de-DE", "fr-FR", "es-ES")),
             ("timezone", pick("Europe/Berlin", "America/New_York", "Asia/Tokyo")),
             ("last_login", stamp)],
    "order": [("order_id", lambda rng: f"ORD-{rng.randint(10000, 99999)}"),
              ("customer_id", number(100, 9999)),
              ("items", lambda rng: [{"sku": f"SKU-{rng.randint(100, 999)}",
                                      "quantity": rng.randint(1, 5),
                                      "unit_price": round(rng.uniform(2, 80), 2)}
                                     for _ in range(rng.randint(1, 3))]),
              ("currency", pick("EUR", "USD", "GBP")), ("status", pick("paid", "shipped",
                                                                        "pending")),
              ("shipping_address", lambda rng: {
                  "street": rng.choice(("12 Harbour Road", "5 Elm Street", "88 Mill Lane")),
                  "city": rng.choice(("Leeds", "Lyon", "Porto", "Utrecht")),
                  "postal_code": str(rng.randint(10000, 99999)),
                  "country": rng.choice(("GB", "FR", "PT", "NL"))}),
              ("created_at", stamp), ("gift_wrap", pick(True, False))],
    "product": [("sku", lambda rng: f"SKU-{rng.randint(1000, 9999)}"),
                ("name", pick("Trail Backpack", "Ceramic Mug", "Desk Lamp", "Wool Scarf")),
                ("description", pick("Water-resistant, 28 litres.", "Hand-glazed stoneware.",
                                     "Warm white LED with a dimmer.")),
                ("price", decimal(3, 250)), ("currency", pick("EUR", "USD")),
                ("stock", number(0, 500)), ("tags", pick(["outdoor"], ["home", "kitchen"],
                                                         ["gift", "winter"])),
                ("dimensions", lambda rng: {"width_cm": rng.randint(5, 60),
                                            "height_cm": rng.randint(5, 60),
                                            "depth_cm": rng.randint(2, 40)}),
                ("weight_kg", decimal(0.1, 12))],
    "log event": [("timestamp", stamp), ("level", pick("INFO", "WARN", "ERROR", "DEBUG")),
                  ("service", pick("billing", "auth", "search", "gateway")),
                  ("message", pick("request completed", "upstream timed out",
                                   "cache miss", "token refreshed")),
                  ("request_id", lambda rng: f"{rng.getrandbits(48):012x}"),
                  ("duration_ms", number(1, 5000)), ("status_code", pick(200, 201, 404, 500,
                                                                         503)),
                  ("path", pick("/v1/orders", "/login", "/search", "/health")),
                  ("method", pick("GET", "POST", "PUT"))],
    "weather reading": [("station_id", lambda rng: f"WS-{rng.randint(100, 999)}"),
                        ("observed_at", stamp), ("temperature_c", decimal(-15, 38)),
                        ("humidity_pct", number(10, 100)),
                        ("wind_speed_kmh", decimal(0, 90)),
                        ("wind_direction", pick("N", "NE", "E", "SE", "S", "SW", "W", "NW")),
                        ("pressure_hpa", decimal(960, 1040)),
                        ("conditions", pick("clear", "overcast", "light rain", "snow"))],
    "book": [("isbn", lambda rng: f"978-{rng.randint(0, 9)}-{rng.randint(1000, 9999)}-"
                                  f"{rng.randint(1000, 9999)}-{rng.randint(0, 9)}"),
             ("title", pick("The Quiet Harbour", "Notes on Rivers", "A Year of Bread")),
             ("author", pick("Ines Duarte", "Tom Becker", "Hana Sato", "Olu Adeyemi")),
             ("published_year", number(1950, 2024)), ("publisher", pick("Northwind Press",
                                                                        "Blue Door Books")),
             ("pages", number(90, 900)), ("language", pick("en", "de", "pt", "ja")),
             ("genres", pick(["fiction"], ["history", "travel"], ["cooking"])),
             ("in_print", pick(True, False))],
    "service config": [("name", pick("api-gateway", "worker", "scheduler", "indexer")),
                       ("version", pick("1.4.2", "2.0.0", "0.9.13")),
                       ("replicas", number(1, 12)), ("port", pick(8080, 8443, 9000, 5432)),
                       ("timeout", decimal(1, 60)), ("enabled", pick(True, False)),
                       ("log_level", pick("info", "debug", "warning")),
                       ("env", lambda rng: {"REGION": rng.choice(("eu-west-1", "us-east-2")),
                                            "WORKERS": str(rng.randint(1, 16))}),
                       ("health_check", lambda rng: {"path": "/health",
                                                     "interval_s": rng.randint(5, 60)})],
    "flight": [("flight_number", lambda rng: f"{rng.choice(('LH', 'BA', 'TP', 'KL'))}"
                                             f"{rng.randint(100, 9999)}"),
               ("origin", pick("LIS", "FRA", "LHR", "AMS", "NRT")),
               ("destination", pick("JFK", "MAD", "CDG", "OSL", "SIN")),
               ("departure", stamp), ("arrival", stamp),
               ("aircraft", pick("A320neo", "B787-9", "E190", "A350-900")),
               ("seats_free", number(0, 180)), ("status", pick("scheduled", "boarding",
                                                               "delayed", "landed")),
               ("gate", pick("A12", "B4", "C33", "D7"))],
}

STORY_TEMPLATES = (
    "The history of {place} begins in {year}, when",
    "In {year}, {person} arrived in {place} with nothing but",
    "Nobody in {place} had ever seen {thing} before the winter of {year}.",
    "{person} kept {thing} in a drawer for forty years, and",
    "The first thing you notice about {place} is",
    "It was the summer of {year}, and {person} had just",
    "Long before {place} became famous for {trade}, it was",
    "The story of {thing} is also the story of {place}.",
    "When {person} opened the letter, the first line read:",
    "For most of its history, {place} lived from {trade}. Then, in {year},",
)
STORY_PARTS = {
    "place": ("the harbour town of Vila Nova", "a mountain village in the Alps",
              "the old mill district", "the island of Saltholm", "a small desert oasis",
              "the river port of Kestrel", "the valley below the glacier",
              "a fishing village on the northern coast", "the market town of Ashby",
              "a railway junction on the plains"),
    "year": tuple(str(year) for year in range(1790, 1990, 13)),
    "person": ("the lighthouse keeper", "a young clockmaker", "the village teacher",
               "an old sailor", "a travelling botanist", "the baker's daughter",
               "a retired engineer", "the mayor's brother"),
    "thing": ("a brass telescope", "a map with no names on it", "a violin", "a locked "
              "wooden box", "a photograph of the harbour", "a seed from a distant country",
              "a clock that ran backwards"),
    "trade": ("salt", "wool", "timber", "glass-making", "herring", "wine", "silver"),
}
