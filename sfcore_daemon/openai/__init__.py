"""OpenAI's Chat Completions and Completions on the HTTP listener: bodies, their translation
into the core's request, chunks and bodies back (docs/openai.md)."""
