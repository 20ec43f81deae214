"""OpenAI's Responses API on the HTTP listener (docs/responses.md): its bodies, their
translation, its events and `response` objects, the responses kept for chaining."""
