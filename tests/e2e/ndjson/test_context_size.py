"""The context a daemon creates when `[model] n_ctx` is 0 (the default): the model's
trained context, cut to the KV budget (sfcore_daemon/llama/ctxsize.py), said in `info`,
in the start-up log and in `/v1/models`; a prompt past it is refused with the limit."""

from __future__ import annotations

import json

import pytest

from tests.kit import running_daemon
from tests.kit.http import endpoint
from tests.kit.models import smollm2_path

pytestmark = pytest.mark.asyncio

# Gemma 3 270M: 18 layers, one KV head of 256 + 256 values, F16.
GEMMA_TOKEN_BYTES = 18 * 512 * 2


async def test_the_default_context_is_the_trained_one() -> None:
    async with running_daemon({"model": {"n_ctx": 0}}) as daemon, daemon.client() as client:
        info = await client.final({"op": "info"})
        trained = info["model"]["n_ctx_train"]
        assert trained == 32768 and info["config"]["n_ctx"] == trained, info
        assert info["config"]["kv_bytes"] == trained * GEMMA_TOKEN_BYTES, info
        assert f"context {trained} tokens (trained for {trained}" in daemon.log
    async with running_daemon({"model": {"n_ctx": 0, "path": str(smollm2_path())}}) as daemon, \
            daemon.client() as client:
        info = await client.final({"op": "info"})
        assert info["config"]["n_ctx"] == info["model"]["n_ctx_train"] == 8192, info


async def test_a_small_budget_cuts_the_context_and_a_longer_prompt_is_refused() -> None:
    config = {"model": {"n_ctx": 0, "kv_budget_mb": 64},
              "openai": {"listen": "127.0.0.1:0"}}
    async with endpoint(config) as found:
        async with found.daemon.client() as client:
            info = await client.final({"op": "info"})
            # 64 MiB hold 3640 tokens of this KV: 3584 in whole steps of 256.
            assert info["config"]["n_ctx"] == 3584, info
            refused = await client.final({"prompt": "word " * 4000, "max_tokens": 4})
            assert refused["type"] == "error" and refused["code"] == "context_overflow"
            assert "3584" in refused["message"] and "model.n_ctx" in refused["message"]
            assert (await client.final({"prompt": "word " * 3000, "max_tokens": 2}))[
                "type"] == "done"
        async with found.http() as http:
            response = await http.get("/v1/models")
            card = json.loads(response.text)["data"][0]
        assert card["context_length"] == 3584
        assert card["kv_bytes"] == 3584 * GEMMA_TOKEN_BYTES
