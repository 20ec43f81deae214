"""The prompt store: saved KV states in RAM and on disk, their file format and index.
Called from the decode thread (through engine.storepolicy) and the event loop; no Jobs."""
