"""What the fingerprints of replies and stored states hold about the model: the file's
sha256 (hashed on a thread of its own beside the load, on a model's first start) and
whether llama.cpp read the copy with Q5_0 as Q8_0 (llama/repack.py), known once loaded."""

from __future__ import annotations

import concurrent.futures
import threading

from sfcore_daemon.config import ModelConfig
from sfcore_daemon.engine.storepolicy import store_fingerprint
from sfcore_daemon.llama.invariant import row_invariant
from sfcore_daemon.llama.model import llama_cpp_version
from sfcore_daemon.llama.modelfile import model_sha256
from sfcore_daemon.store.fingerprint import reply_fingerprint


class ModelIdentity:
    def __init__(self, model_path: str, config: ModelConfig) -> None:
        self.model_path = model_path
        self.config = config
        self.sha256: concurrent.futures.Future[str] = concurrent.futures.Future()
        self.rewritten: concurrent.futures.Future[bool] = concurrent.futures.Future()
        # store/fingerprint.reply_fingerprint; empty until the sha256 is known.
        self.reply_fingerprint = ""

    def start_hashing(self) -> None:
        threading.Thread(target=self._hash, name="sfcore-model-sha256", daemon=True).start()

    def _hash(self) -> None:
        try:
            self.sha256.set_result(model_sha256(self.model_path))
        except BaseException as exc:  # an unreadable model file: the load fails too
            self.sha256.set_exception(exc)

    def loaded(self, rewritten: bool, system_info: str) -> None:
        """The load is done: the fingerprints may be made (the replies' once hashed)."""
        self.rewritten.set_result(rewritten)

        def fingerprint_replies(sha256: concurrent.futures.Future[str]) -> None:
            if sha256.exception() is None:
                self.reply_fingerprint = reply_fingerprint(
                    model_sha256=sha256.result(), llama_cpp=llama_cpp_version(),
                    flash_attn=self.config.flash_attn, row_invariant=row_invariant(),
                    system_info=system_info, rewritten=rewritten)

        self.sha256.add_done_callback(fingerprint_replies)

    def load_failed(self) -> None:
        # Nothing is served, so no fingerprint is used; the store's opening must not wait.
        if not self.rewritten.done():
            self.rewritten.set_result(False)

    def store_fingerprint(self) -> str:
        """The stored states' fingerprint; on the store's thread, which waits for both."""
        return store_fingerprint(self.sha256, self.rewritten, self.config)
