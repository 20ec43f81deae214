"""Structured output: a JSON Schema checked and compiled to GBNF and a closing shape
(event loop), and the grammar sampler that closes a document within budget (decode thread)."""
