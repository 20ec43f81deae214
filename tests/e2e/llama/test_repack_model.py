"""The default model's Q5_0 tensors (its K-quant mix's fallbacks) loaded from a copy that
holds them as Q8_0 (llama/repack.py): every value the same in the copy, the daemon
serving from it by default, and `rewrite_q5_0 = "off"` loading the file as it is."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from sfcore_daemon.config import ModelConfig
from sfcore_daemon.llama import repack
from sfcore_daemon.llama.modelfile import default_model_path
from tests.kit import REPLY_TIMEOUT_S, done_of, running_daemon


def _q5_0_as_integers(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scales (as raw half-float bits) and values of Q5_0 blocks, the fifth bits taken
    from qh one by one with unpackbits (not repack's shifts)."""
    scales = raw[:, 0:2].copy().view("<u2")
    fifth = np.unpackbits(raw[:, 2:6], axis=1, bitorder="little").astype(np.int16)
    low = (raw[:, 6:22] & 0x0F).astype(np.int16)
    high = (raw[:, 6:22] >> 4).astype(np.int16)
    values = np.concatenate([low + 16 * fifth[:, :16], high + 16 * fifth[:, 16:]], axis=1)
    return scales, values - 16


def test_every_q5_0_value_of_the_default_model_is_the_same_in_its_copy() -> None:
    source = str(default_model_path())
    weights = repack.weights_for(source, ModelConfig())
    assert weights.rewritten, "the default model's Q4_K_M mix has Q5_0 fallback tensors"
    with open(source, "rb") as a, open(weights.path, "rb") as b, \
            mmap.mmap(a.fileno(), 0, access=mmap.ACCESS_READ) as old, \
            mmap.mmap(b.fileno(), 0, access=mmap.ACCESS_READ) as new:
        before, after = repack.read_layout(old), repack.read_layout(new)
        assert before.kv == after.kv
        spans = repack.tensor_spans(before)
        rewritten = 0
        for a_info, b_info in zip(before.tensors, after.tensors, strict=True):
            assert (a_info.name, a_info.dims) == (b_info.name, b_info.dims)
            a_at, b_at = before.data_start + a_info.offset, after.data_start + b_info.offset
            blocks = int(np.prod(a_info.dims)) // 32
            if a_info.ggml_type != repack.GGML_Q5_0:
                assert b_info.ggml_type == a_info.ggml_type
                span = spans[a_info.offset]
                assert old[a_at:a_at + span] == new[b_at:b_at + span]
                continue
            rewritten += 1
            assert b_info.ggml_type == repack.GGML_Q8_0
            scales, values = _q5_0_as_integers(
                np.frombuffer(old[a_at:a_at + blocks * 22], np.uint8).reshape(blocks, 22))
            q8 = np.frombuffer(new[b_at:b_at + blocks * 34], np.uint8).reshape(blocks, 34)
            assert np.array_equal(q8[:, 0:2].copy().view("<u2"), scales)
            assert np.array_equal(q8[:, 2:].view(np.int8).astype(np.int16), values)
    assert rewritten == 81


@pytest.mark.asyncio
async def test_the_daemon_serves_from_the_copy_by_default_and_from_the_file_when_off() -> None:
    request = {"prompt": "The three primary colours are", "max_tokens": 12, "temperature": 0,
               "stream": False}
    fingerprints = {}
    for mode, line in (("auto", "weights: Q5_0 tensors as Q8_0"),
                       ("off", "weights: as the model file holds them")):
        async with running_daemon({"model": {"rewrite_q5_0": mode}}) as daemon:
            assert line in daemon.log
            async with daemon.client() as client:
                done = done_of(await client.request(request, timeout=REPLY_TIMEOUT_S * 4))
            assert done["usage"]["completion_tokens"] > 0 and done["text"].strip()
            fingerprints[mode] = done["model_fingerprint"]
    # A reply's fingerprint names what its bytes depend on; the weights' type is part of it.
    assert fingerprints["auto"] != fingerprints["off"]
    assert Path(repack.weights_for(str(default_model_path()), ModelConfig()).path).is_file()
