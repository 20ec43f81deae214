"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) on the
HTTP listener: its bodies, their mapping onto the daemon's chat, its events and errors."""
