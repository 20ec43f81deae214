"""The one model as Ollama lists it: /api/tags, /api/show and /api/ps.

The daemon serves one model, loaded for its lifetime. Its name is the listener's
`model_id` with Ollama's `:latest` tag; its digest names the file (its path, size and
time), not a hash of its bytes, which would read the whole file on each listing.
"""

from __future__ import annotations

import hashlib
import os
import re
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Final

from sfcore_daemon.ollama.schema import Details, ModelEntry, ShowReply

if TYPE_CHECKING:
    from sfcore_daemon.engine.thread import Engine

# Ollama's "kept loaded forever" (keep_alive -1) is a far date, as is this daemon's.
FOREVER: Final = "2318-01-01T00:00:00Z"
_QUANT = re.compile(r"(?i)(?:^|[-_.])(i?q\d(?:_[a-z0-9]+)*|f16|bf16|f32)$")


def tagged(model_id: str) -> str:
    return model_id if ":" in model_id else f"{model_id}:latest"


def _parameter_size(count: int) -> str:
    if count >= 10**9:
        return f"{count / 1e9:.1f}B"
    return f"{count / 1e6:.2f}M"


def _quantization(path: str) -> str:
    """From the file's name (gemma-3-270m-q4_k_m.gguf: Q4_K_M); the GGUF's file type
    is not among what the engine reads of the model."""
    match = _QUANT.search(os.path.basename(path).removesuffix(".gguf"))
    return match[1].upper() if match else "unknown"


def details(engine: Engine) -> Details:
    info = engine.info
    return Details(parent_model="", format="gguf", family=info.architecture,
                   families=[info.architecture], parameter_size=_parameter_size(info.n_params),
                   quantization_level=_quantization(info.path))


def _modified_at(path: str) -> str:
    try:
        stamp = os.stat(path).st_mtime
    except OSError:
        stamp = 0.0
    return datetime.fromtimestamp(stamp, UTC).isoformat().replace("+00:00", "Z")


def entry(engine: Engine, model_id: str, *, running: bool) -> ModelEntry:
    info = engine.info
    name = tagged(model_id)
    identity = f"{info.path}\0{info.size_bytes}\0{_modified_at(info.path)}".encode()
    found = ModelEntry(name=name, model=name, modified_at=_modified_at(info.path),
                       size=info.size_bytes, digest=hashlib.sha256(identity).hexdigest(),
                       details=details(engine))
    if running:
        # size_vram 0: what of the model is on a GPU is not among what the engine reports.
        found.expires_at, found.size_vram = FOREVER, 0
        found.context_length = engine.n_ctx
    return found


def show(engine: Engine, template_label: str | None) -> ShowReply:
    info = engine.info
    template = info.chat_template or ""
    modelfile = (f"# Modelfile of the model sfcore-ai serves\nFROM {info.path}\n"
                 + (f'TEMPLATE """{template}"""\n' if template else "")
                 + f"PARAMETER num_ctx {engine.n_ctx}\n")
    return ShowReply(
        modelfile=modelfile, parameters=f"num_ctx {engine.n_ctx}", template=template,
        details=details(engine),
        model_info={
            "general.architecture": info.architecture,
            "general.name": info.name,
            "general.parameter_count": info.n_params,
            f"{info.architecture}.context_length": info.n_ctx_train,
            "tokenizer.ggml.vocab_size": info.n_vocab,
            "sfcore.chat_template": template_label,
        },
        # Tools always: calls are made by the daemon's grammar whatever the template.
        capabilities=["completion", "tools"],
        modified_at=_modified_at(info.path))
