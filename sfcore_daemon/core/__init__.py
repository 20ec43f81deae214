"""The core every front end uses, on the event loop: its request, events and result types,
admission, scheduling, the generation's stream, templates, tools, stats and lifetime."""
