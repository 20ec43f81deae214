#!/usr/bin/env python3
"""Drive llama_decode directly with the daemon's context and step shapes (no daemon),
to find which step shapes make a GPU backend fault (docs/gpu.md, "The crash").

  probe_shapes.py --model M --seconds S [--draft-rows D] [--prefill] [--seed N]
                  [--fixed SEQS:ROWS | --rows R1,R2,...] [--last-only] [--log F]

Random mode (default): each step has 1-8 generating sequences, each its pending token
and a draft sharing at most D rows with the others (as the daemon's step planner
shares them), every row asking for logits, and with --prefill sometimes a prompt chunk
of another sequence; a random part of each draft is "accepted" and the rest removed
with seq_rm. Fixed mode repeats one shape, which is what lets llama.cpp's CUDA backend
capture and replay a graph for it. Before each decode the step is written (flushed) to
--log, so after an abort the log's last line is the step that faulted.

The daemon's library defaults (sfcore_daemon.cli.set_library_defaults) are applied
first, as the daemon applies them; a variable already set in the environment wins.
Prints one line `probe: ok ...` and exits 0 when the time runs out without a fault.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

from sfcore_daemon.cli import set_library_defaults

set_library_defaults(os.environ)

from sfcore_daemon.config import ModelConfig  # noqa: E402  (after the defaults)
from sfcore_daemon.llama.capi import C  # noqa: E402
from sfcore_daemon.llama.model import Model  # noqa: E402

SLOTS = 8
PREFILL_MAX = 64
RESET_AT = 900  # positions per sequence before it starts over (8 x 900 < n_ctx)


def random_drafts(rng: random.Random, draft_rows: int, align: int) -> list[int]:
    """Drafts of 1-8 sequences sharing `draft_rows`, the step's rows made a multiple of
    `align` where the first draft can give up the remainder (as the planner does)."""
    k = rng.randint(1, SLOTS)
    spare = draft_rows
    drafts = []
    for i in range(k):
        length = rng.randint(0, spare // (k - i)) if rng.random() < 0.8 else 0
        drafts.append(length)
        spare -= length
    over = (k + sum(drafts)) % align
    if align > 1 and over and drafts[0] >= over:
        drafts[0] -= over
    return drafts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--draft-rows", type=int, default=64)
    parser.add_argument("--prefill", action="store_true")
    parser.add_argument("--align", type=int, default=4)
    parser.add_argument("--log", default=os.devnull)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ngl", type=int, default=-1)
    parser.add_argument("--fixed", default="", help="SEQS:ROWS, e.g. 3:20")
    parser.add_argument("--rows", default="", help="rows per sequence, e.g. 9,1,1")
    parser.add_argument("--last-only", action="store_true",
                        help="only each sequence's last row asks for logits")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    fixed: list[int] | None = None
    if args.rows:
        fixed = [int(x) - 1 for x in args.rows.split(",")]
    elif args.fixed:
        seqs, rows = (int(x) for x in args.fixed.split(":"))
        fixed = [rows - 1] * seqs
    config = ModelConfig(path=args.model, n_gpu_layers=args.ngl)
    model = Model.load(args.model, config, 8, 8, slots=SLOTS, draft_rows=args.draft_rows)
    ctx, memory = model.ctx, model.memory
    batch = C.llama_batch_init(SLOTS + max(args.draft_rows, 64 * SLOTS) + PREFILL_MAX, 0, 1)
    pos = [0] * SLOTS
    steps = 0
    shapes: set[tuple[int, int]] = set()
    deadline = time.monotonic() + args.seconds
    with open(args.log, "w", buffering=1) as log:
        while time.monotonic() < deadline:
            drafts = fixed if fixed is not None else random_drafts(
                rng, args.draft_rows, args.align)
            seqs = list(range(len(drafts))) if fixed is not None else rng.sample(
                range(SLOTS), len(drafts))
            n = outputs = 0
            for seq, draft in zip(seqs, drafts, strict=True):
                for j in range(1 + draft):
                    batch.token[n] = rng.randrange(1000, 200000)
                    batch.pos[n] = pos[seq] + j
                    batch.n_seq_id[n] = 1
                    batch.seq_id[n][0] = seq
                    batch.logits[n] = 0 if args.last_only and j < draft else 1
                    outputs += batch.logits[n]
                    n += 1
            chunk, prefill_seq = 0, -1
            free = [s for s in range(SLOTS) if s not in seqs]
            if args.prefill and fixed is None and free and rng.random() < 0.3:
                prefill_seq, chunk = rng.choice(free), rng.randint(1, PREFILL_MAX)
                for j in range(chunk):
                    batch.token[n] = rng.randrange(1000, 200000)
                    batch.pos[n] = pos[prefill_seq] + j
                    batch.n_seq_id[n] = 1
                    batch.seq_id[n][0] = prefill_seq
                    batch.logits[n] = int(j == chunk - 1)
                    n += 1
                outputs += 1
            batch.n_tokens = n
            log.write(f"step {steps} tokens {n} outputs {outputs} seqs {len(drafts)} "
                      f"drafts {drafts} prefill {prefill_seq}:{chunk}\n")
            rc = C.llama_decode(ctx, batch)
            if rc != 0:
                print(f"probe: llama_decode returned {rc} at step {steps} ({n} tokens)",
                      flush=True)
                return 2
            for i in range(n):  # every row is read, as the daemon's sampler reads them
                if batch.logits[i]:
                    C.llama_get_logits_ith(ctx, i)
            shapes.add((n, outputs))
            for seq, draft in zip(seqs, drafts, strict=True):
                pos[seq] += 1 + (draft if args.last_only else rng.randint(0, draft))
                C.llama_memory_seq_rm(memory, seq, pos[seq], -1)
            if prefill_seq >= 0:
                pos[prefill_seq] += chunk
            for seq in range(SLOTS):
                if pos[seq] > RESET_AT:
                    C.llama_memory_seq_rm(memory, seq, -1, -1)
                    pos[seq] = 0
            steps += 1
    compute = os.environ.get("GGML_CUDA_CUBLAS_COMPUTE_TYPE", "")
    print(f"probe: ok {steps} steps, {len(shapes)} shapes, most tokens "
          f"{max(t for t, _ in shapes)}, most outputs {max(o for _, o in shapes)}, "
          f"cublas compute type {compute or 'auto'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
