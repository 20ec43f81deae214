"""What makes a stored state valid for a model and a context: the fingerprint every
state file carries in its header and is filed under (disk.folder_name). A file made
under any other fingerprint is never loaded.

The engine passes in the values (engine/storepolicy.store_fingerprint); the store
decides what goes into the hash and how, so a new field, or a new file format, is
one change here.
"""

from __future__ import annotations

import hashlib
import json

# What the file format of a stored state is; part of every state's fingerprint.
STATE_FORMAT = 1


def state_fingerprint(*, model_sha256: str, llama_cpp: str, flash_attn: bool | str,
                      n_ubatch: int, gpu_layers: int | str, system_info: str,
                      rewritten: bool = False) -> str:
    """Everything that decides a stored state's layout and numbers, hashed: the model
    file's sha256, the llama.cpp build, the context parameters, the CPU features
    (llama_print_system_info) and whether Q5_0 weights ran as Q8_0 (llama/repack.py)."""
    identity: dict[str, object] = {
        "format": STATE_FORMAT,
        "model_sha256": model_sha256,
        "llama_cpp": llama_cpp,
        # K/V types are the defaults (f16); flash attention decides whether V is transposed;
        # the ubatch size and CPU features decide how the rows were computed.
        "flash_attn": flash_attn,
        "swa_full": True,
        "kv_unified": True,
        "n_ubatch": n_ubatch,
        "gpu_layers": gpu_layers,
        "system_info": system_info,
    }
    _add_weights(identity, rewritten)
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def reply_fingerprint(*, model_sha256: str, llama_cpp: str, flash_attn: bool | str,
                      row_invariant: bool, system_info: str, rewritten: bool = False) -> str:
    """What a reply's bytes depend on besides the request, hashed for its `done` line:
    the model file, the llama.cpp build, the CPU features and the kernels' mode. Two
    replies with the same fingerprint, request and seed are the same bytes."""
    identity: dict[str, object] = {
        "model_sha256": model_sha256,
        "llama_cpp": llama_cpp,
        "flash_attn": flash_attn,
        "row_invariant": row_invariant,
        "system_info": system_info,
    }
    _add_weights(identity, rewritten)
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return "sha256:" + digest[:16]


def _add_weights(identity: dict[str, object], rewritten: bool) -> None:
    # Only when rewritten: the fingerprints of files loaded as they are stay what they were.
    if rewritten:
        identity["weights"] = "q5_0-as-q8_0"
