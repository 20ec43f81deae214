"""Serving, on the event loop: the NDJSON protocol, connections, admission of requests
into jobs, the output pipeline (text, stop strings, replies), the ops and stats."""
