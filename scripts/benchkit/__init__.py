"""The benches of scripts/bench.py as one package.

    common.py    the repository, the hang bound, filler text, one generation's figures
    daemon.py    the daemon of the kit's one launcher (tests/kit/daemon.py) with the
                 benches' configuration, and the kit's NDJSON client
    peers.py     the one peer launcher: llama-server, llama-batched-bench, llama-bench,
                 llama-cpp-python's Llama, all on the daemon's model file
    ceiling.py   llama.cpp's C API in a process of its own, the figures section's ceiling
    table.py     the one table writer: medians (min-max), paired ratios, targets
    context.py   `Bench`: what a section is given (options, params, header, runner)
    cli.py       `scripts/bench.py SECTION... [--model PATH]`
    sections/    one module a section, and `SECTIONS`, the registry (sections/__init__.py)
    corpus/      the prompt corpus: prompts.jsonl in tuning and held-out halves, its builder
"""
