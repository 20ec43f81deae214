"""sfcore-ai: a local LLM inference daemon (one GGUF model, NDJSON over a Unix socket)."""

__version__ = "0.1.0"
