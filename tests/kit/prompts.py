"""Prompts and schemas more than one test file sends: a long prefix and two questions
after it (the KV cache, the prompt store, containment), and prompts whose answers copy
from the prompt, with the record's schema (speculative decoding, containment)."""

from __future__ import annotations

# Over 1024 tokens: longer than Gemma 3's 512-token sliding window, so a cache that
# pruned the window layers would silently change a reused prefix's output.
PREFIX = " ".join(
    f"Record {i}: the {('red', 'green', 'blue', 'amber')[i % 4]} box holds {i * 7 % 101} "
    f"stones." for i in range(130)
)
QUESTION_1 = "\nQuestion: which box holds the most stones?\nAnswer:"
QUESTION_2 = "\nQuestion: how many records are there?\nAnswer:"

MODULE = '''import json
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int


def total_price(items):
    return sum(item.price * item.quantity for item in items)


def cheapest(items):
    return min(items, key=lambda item: item.price)
'''
RECORD = '{"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"]}'
# Prompts whose answers copy from the prompt (drafts are accepted) and one that does not.
COPY_CODE = {"op": "chat", "messages": [
    {"role": "user", "content": f"Copy this code exactly:\n```python\n{MODULE}```"}]}
COPY_JSON = {"op": "chat", "messages": [
    {"role": "user", "content": f"Repeat this JSON exactly: {RECORD}"}]}
FREE = {"prompt": "The history of the city of"}
RECORD_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                   "fields": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "born", "fields"],
}
