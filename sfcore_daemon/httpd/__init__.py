"""The HTTP listener the HTTP APIs share (aiohttp on the daemon's loop): its socket, limits,
access gate, error shapes, streamed replies, and `api.HttpApi`, the one way an API joins."""
