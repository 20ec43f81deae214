"""Thin wrappers over llama.cpp: the C API, the model and its context, KV cells and
sequence states, GPU placement, the model file. Used from both threads; no policy."""
