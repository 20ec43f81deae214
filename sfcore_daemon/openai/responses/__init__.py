"""OpenAI's Responses API (docs/responses.md): its bodies, their mapping, its replies and
streamed events, the responses kept, its routes."""
