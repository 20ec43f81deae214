"""The OpenAI-compatible HTTP endpoint: aiohttp routes that feed the same admission.
Event loop only; off unless [openai] listen is set (the top level wires it in)."""
