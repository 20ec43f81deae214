"""Ollama's native API (/api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version)
on the HTTP listener: its bodies, their translation into the core's request, NDJSON replies."""
