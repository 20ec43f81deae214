"""Anthropic's Messages API on the HTTP listener (docs/messages.md): its bodies, their
translation into the core's chat, its events and its error shape."""
