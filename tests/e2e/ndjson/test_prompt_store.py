"""The prompt store: states of long prefixes kept in RAM and on disk, restored after an
eviction or a restart instead of being evaluated again. Real daemon, real model."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.kit import done_of, running_daemon
from tests.kit.prompt_store import (
    LONG,
    OTHER,
    QUESTION_1,
    QUESTION_2,
    SHORT_PREFIXES,
    assert_restored_at_the_question,
    cache_dir,
    cache_stats,
    generate,
    state_files,
    store_config,
    warm_answer,
)

pytestmark = pytest.mark.asyncio
__all__ = ["cache_dir"]  # the fixture


async def test_a_restart_restores_the_prefix_from_disk_with_the_bytes_of_a_cold_run(
        cache_dir: Path) -> None:
    async with running_daemon(store_config(cache_dir)) as daemon:
        cold, _, cold_2 = await warm_answer(daemon)
    # Written while running and at the drain: whole files only, no temporary left.
    assert state_files(cache_dir)
    assert not list(cache_dir.glob("*/.*"))
    async with running_daemon(store_config(cache_dir)) as daemon, daemon.client() as client:
        restored = await generate(client, LONG + QUESTION_2)
        assert restored["timings"]["cache_source"] == "disk"
        assert_restored_at_the_question(restored, cold_2)
        assert restored["timings"]["first_token_ms"] < cold["timings"]["first_token_ms"]
        cache = await cache_stats(client)
        assert cache["hits"]["disk"] == 1
        assert cache["restored_tokens"] == restored["usage"]["cached_tokens"]
        assert cache["errors"] == 0
        # The same request cold in this process gives the same bytes too.
        assert (await generate(client, LONG + QUESTION_2, cache_prompt=False))["text"] == \
            restored["text"]


async def test_an_evicted_prefix_comes_back_from_ram(cache_dir: Path) -> None:
    async with running_daemon(store_config(cache_dir)) as daemon:
        _, _, cold_2 = await warm_answer(daemon)
        async with daemon.client() as client:
            # One slot: another prompt takes its cells.
            other = await generate(client, OTHER)
            assert other["usage"]["cached_tokens"] <= 1
            again = await generate(client, LONG + QUESTION_2)
            assert again["timings"]["cache_source"] == "ram"
            assert_restored_at_the_question(again, cold_2)
            # The whole prompt again: its state was kept as it ended, so all but the
            # last token (evaluated for its logits) comes back.
            repeat = await generate(client, OTHER)
            assert repeat["timings"]["cache_source"] == "ram"
            assert repeat["usage"]["cached_tokens"] == other["usage"]["prompt_tokens"] - 1
            cache = await cache_stats(client)
            assert cache["hits"]["ram"] >= 1 and cache["errors"] == 0
            assert cache["ram_states"] >= 2 and cache["ram_bytes"] > 0


async def test_states_of_another_build_or_layout_are_never_loaded(cache_dir: Path) -> None:
    async with running_daemon(store_config(cache_dir)) as daemon:
        _, _, cold_2 = await warm_answer(daemon)
        async with daemon.client() as client:
            await generate(client, OTHER)  # a state of another prompt: the one forged
    # The one writer thread writes the states in the order they were kept: the newest
    # file is OTHER's (its prompt's, or its slot's, kept as the daemon stopped).
    files = sorted(state_files(cache_dir), key=lambda path: path.stat().st_mtime_ns)
    assert len(files) >= 2, files
    # A file that claims another fingerprint (another model, llama.cpp build or context
    # layout), placed where this daemon looks.
    forged = files[-1].read_bytes().replace(files[-1].parent.name.encode(), b"f" * 32, 1)
    assert forged != files[-1].read_bytes()
    files[-1].write_bytes(forged)
    # Another layout (flash attention off stores V transposed) uses its own folder.
    layout = store_config(cache_dir)
    layout["model"]["flash_attn"] = False
    async with running_daemon(layout) as daemon, daemon.client() as client:
        other_layout = await generate(client, LONG + QUESTION_2)
        assert other_layout["timings"]["cache_source"] == "none"
        assert other_layout["usage"]["cached_tokens"] == 0
    async with running_daemon(store_config(cache_dir)) as daemon, daemon.client() as client:
        # READY=1 comes after the store has read its folder.
        cache = await cache_stats(client)
        assert cache["errors"] == 1
        assert not files[-1].exists() and all(path.exists() for path in files[:-1])
        restored = await generate(client, LONG + QUESTION_2)
        assert restored["timings"]["cache_source"] == "disk"
        assert_restored_at_the_question(restored, cold_2)
        await client.close()
        # The log after the daemon's exit: every line has been written by then.
        assert await daemon.stop() == 0
        assert daemon.log.count("made by another model") == 1, daemon.log


async def test_damaged_and_truncated_files_are_skipped_with_one_warning_each(
        cache_dir: Path) -> None:
    async with running_daemon(store_config(cache_dir)) as daemon:
        cold, _, _ = await warm_answer(daemon)
        async with daemon.client() as client:
            await generate(client, OTHER)  # a state of another prompt: the one truncated
    # The one writer thread writes the states in the order they were kept: the newest
    # file is OTHER's (its prompt's, or its slot's, kept as the daemon stopped); the
    # damaged ones include LONG's, read (and found damaged) when LONG + QUESTION_1 comes.
    files = sorted(state_files(cache_dir), key=lambda path: path.stat().st_mtime_ns)
    assert len(files) >= 2, files
    truncated, damaged = files[-1], files[:-1]
    truncated.write_bytes(truncated.read_bytes()[:-1000])
    for path in damaged:  # one byte of the K/V rows flipped in every other file
        data = bytearray(path.read_bytes())
        data[-100] ^= 0xFF
        path.write_bytes(bytes(data))
    async with running_daemon(store_config(cache_dir)) as daemon, daemon.client() as client:
        # The scan before READY=1 found the short file (the request below may write
        # a state of the same name again).
        assert not truncated.exists()
        served = await generate(client, LONG + QUESTION_1)
        assert served["timings"]["cache_source"] == "none"
        assert served["usage"]["cached_tokens"] == 0
        # Evaluated, so the cold run's bytes.
        assert served["text"] == cold["text"]
        cache = await cache_stats(client)
        assert cache["errors"] == 2
        await client.close()
        assert await daemon.stop() == 0
        log = daemon.log
        assert log.count("(truncated)") == 1, log
        assert log.count("does not match its checksum") == 1, log
        assert "Traceback" not in log


async def test_the_disk_budget_holds_least_recently_used_out_first(cache_dir: Path) -> None:
    # About 9 MB a state of ~480 tokens: two fit in 20 MB, three do not.
    config = store_config(cache_dir, disk_mb=20)
    async with running_daemon(config) as daemon, daemon.client() as client:
        for prefix in SHORT_PREFIXES[:3]:
            done = await generate(client, prefix + QUESTION_1)
            assert done["usage"]["prompt_tokens"] > 200
    files = state_files(cache_dir)
    sizes = [path.stat().st_size for path in files]
    assert sum(sizes) <= 20 << 20, sizes
    assert len(files) == 2, sizes
    async with running_daemon(config) as daemon, daemon.client() as client:
        # The newest is there, the oldest went first.
        newest = await generate(client, SHORT_PREFIXES[2] + QUESTION_1)
        assert newest["timings"]["cache_source"] == "disk"
        oldest = await generate(client, SHORT_PREFIXES[0] + QUESTION_1)
        assert oldest["timings"]["cache_source"] != "disk"
        # Only the first words all these prompts share, from the slot.
        assert oldest["usage"]["cached_tokens"] < 16
        cache = await cache_stats(client)
        assert cache["disk_bytes"] <= 20 << 20


async def test_four_slots_restore_and_save_at_once(cache_dir: Path) -> None:
    config = store_config(cache_dir)
    config["server"]["slots"] = 4
    async with running_daemon(config) as daemon:
        clients = [await daemon.connect() for _ in range(4)]
        try:
            async def round_of(question: str, prefixes: list[str]) -> list[dict[str, Any]]:
                return list(await asyncio.gather(*(
                    generate(client, prefix + question)
                    for client, prefix in zip(clients, prefixes, strict=True))))

            first = await round_of(QUESTION_1, SHORT_PREFIXES)
            # Nothing stored yet: at most the first words the prefixes share.
            assert all(done["usage"]["cached_tokens"] < 8 for done in first), first
            await round_of(QUESTION_2, SHORT_PREFIXES)
            # Four other prompts take every slot's cells; then each prefix comes back.
            await round_of("", [f"{OTHER} {k}" for k in range(4)])
            back = await round_of(QUESTION_2, SHORT_PREFIXES)
            sources = [done["timings"]["cache_source"] for done in back]
            assert set(sources) <= {"ram", "slot"}, sources
            assert "ram" in sources, sources
            for done, before in zip(back, first, strict=True):
                assert done["usage"]["cached_tokens"] >= before["usage"]["prompt_tokens"] - 24
            cache = await cache_stats(clients[0])
            assert cache["errors"] == 0
            assert cache["hits"]["ram"] == sources.count("ram")
        finally:
            for client in clients:
                await client.close()


async def test_the_store_is_off_by_config(cache_dir: Path) -> None:
    for extra in ({"cache": {"enabled": False}},):
        config = store_config(cache_dir)
        for section, values in extra.items():
            config[section].update(values)
        async with running_daemon(config) as daemon, daemon.client() as client:
            info = await client.final({"op": "info"})
            assert info["config"]["cache"]["enabled"] is False
            cleared = await client.final({"op": "cache", "action": "clear"})
            assert cleared["enabled"] is False and cleared["states"] == [], cleared
            await generate(client, SHORT_PREFIXES[0] + QUESTION_1)
            await generate(client, OTHER)
            again = await generate(client, SHORT_PREFIXES[0] + QUESTION_2)
            assert again["usage"]["cached_tokens"] <= 1  # BOS, from the slot
            cache = await cache_stats(client)
            assert cache["enabled"] is False and cache["saved"] == 0
        assert not state_files(cache_dir)


async def test_info_shows_the_effective_store(cache_dir: Path) -> None:
    async with running_daemon(store_config(cache_dir, ram_mb=64, disk_mb=100)) as daemon, \
            daemon.client() as client:
        info = await client.final({"op": "info"})
        assert info["config"]["cache"] == {
            "enabled": True, "dir": str(cache_dir), "ram_mb": 64, "disk_mb": 100,
            "min_tokens": 64}


async def test_a_long_prompt_is_read_after_idle_slots_move_into_the_store(
        cache_dir: Path) -> None:
    """An idle slot's cells would stay in the pool beside a new prompt, and attention
    would pass over them in every batch of it: before a prompt longer than one batch
    (n_ubatch 512) they go to the store, and come back from there. A short one leaves
    them where they are."""
    config = store_config(cache_dir)
    config["server"]["slots"] = 2
    long_other = SHORT_PREFIXES[2] + SHORT_PREFIXES[3]  # 899 tokens
    async with running_daemon(config) as daemon, daemon.client() as client:
        first = await generate(client, LONG + QUESTION_1)
        await generate(client, SHORT_PREFIXES[0])  # 450 tokens: the other slot
        slots = (await client.final({"op": "stats"}))["slots"]
        held = [slot["cached_tokens"] for slot in slots]
        assert min(held) > 400, slots  # the short prompt left the long one's cells
        again = await generate(client, LONG + QUESTION_2)
        assert again["timings"]["cache_source"] == "slot", again
        await generate(client, long_other)  # to the short prompt's slot, the LRU one
        slots = (await client.final({"op": "stats"}))["slots"]
        assert sorted(slot["cached_tokens"] for slot in slots)[0] == 0, slots
        back = await generate(client, LONG + QUESTION_1)
        assert back["timings"]["cache_source"] == "ram", back
        assert back["usage"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 16, back
        assert back["text"] == first["text"]


async def test_an_idle_slot_the_store_lacks_leaves_with_its_state_before_a_long_prompt(
        cache_dir: Path) -> None:
    """An idle slot whose answer ran past its prompt's stored states by more than
    min_tokens (64 here) leaves the pool before a prompt longer than one batch all the
    same, its whole text's state taken on the way out: it comes back from RAM."""
    config = store_config(cache_dir)
    config["server"]["slots"] = 2
    async with running_daemon(config) as daemon, daemon.client() as client:
        first = await generate(client, LONG + QUESTION_1, max_tokens=112)
        assert first["usage"]["completion_tokens"] > 96, first
        await generate(client, SHORT_PREFIXES[0])  # 450 tokens: the other slot
        # On the short prompt's slot (it shares those 450 tokens), 899 tokens to read.
        await generate(client, SHORT_PREFIXES[0] + SHORT_PREFIXES[2] + SHORT_PREFIXES[3])
        slots = (await client.final({"op": "stats"}))["slots"]
        assert sorted(slot["cached_tokens"] for slot in slots)[0] == 0, slots
        back = await generate(client, LONG + QUESTION_1 + first["text"])
        assert back["timings"]["cache_source"] == "ram", back
        assert back["usage"]["cached_tokens"] > first["usage"]["prompt_tokens"] + 90, back


async def test_a_long_prompt_is_read_after_a_cache_prompt_false_slot_lets_go(
        cache_dir: Path) -> None:
    """A cache_prompt: false request keeps no state, so its slot's cells are in no
    store: before a prompt longer than one batch they leave the pool all the same (they
    slowed such a prompt by 7-9%), and its prompt sent again is read cold."""
    config = store_config(cache_dir)
    config["server"]["slots"] = 2
    async with running_daemon(config) as daemon, daemon.client() as client:
        await generate(client, LONG + QUESTION_1, cache_prompt=False)
        await generate(client, SHORT_PREFIXES[0])  # 450 tokens, the other slot: they stay
        slots = (await client.final({"op": "stats"}))["slots"]
        assert min(slot["cached_tokens"] for slot in slots) > 400, slots
        # On the short prompt's slot (it shares those 450 tokens), 899 tokens to read.
        await generate(client, SHORT_PREFIXES[0] + SHORT_PREFIXES[2] + SHORT_PREFIXES[3])
        slots = (await client.final({"op": "stats"}))["slots"]
        held = sorted(slot["cached_tokens"] for slot in slots)
        assert held[0] == 0 and held[1] > 1300, slots
        again = await generate(client, LONG + QUESTION_1)
        assert again["usage"]["cached_tokens"] <= 1, again  # BOS at most


async def test_a_conversation_finds_its_earlier_turn_after_an_eviction(cache_dir: Path) -> None:
    system = "You answer from these records only. " + SHORT_PREFIXES[1]
    turn_1 = [{"role": "system", "content": system},
              {"role": "user", "content": "Which animal sleeps longest?"}]
    async with running_daemon(store_config(cache_dir)) as daemon, daemon.client() as client:
        first = done_of(await client.request(
            {"op": "chat", "messages": turn_1, "max_tokens": 24, "temperature": 0,
             "stream": False}, timeout=180))
        await generate(client, OTHER)  # the one slot goes to another prompt
        turn_2 = [*turn_1, {"role": "assistant", "content": first["text"]},
                  {"role": "user", "content": "And which sleeps least?"}]
        second = done_of(await client.request(
            {"op": "chat", "messages": turn_2, "max_tokens": 8, "temperature": 0,
             "stream": False}, timeout=180))
        # The first turn's prompt came back (kept once it was read, at its last turn
        # start: the few tokens past it are not worth a copy of their own); the slot's
        # cells were let go without a copy, as its answer added fewer than min_tokens
        # to it: the answer, the markup closing it and the new question are evaluated.
        assert second["timings"]["cache_source"] == "ram"
        cached = second["usage"]["cached_tokens"]
        assert first["usage"]["prompt_tokens"] - 32 < cached < first["usage"]["prompt_tokens"] + 2


async def test_a_turn_that_goes_on_from_its_slot_takes_no_state_until_the_slot_goes(
        cache_dir: Path) -> None:
    """A conversation's next turn reuses its slot's whole text, whose cells stay: no
    state of that text is taken while they do (the copy held the turn's decode between
    its first two tokens). It is taken when the cells go, and the turn after comes back
    from it."""
    system = "You answer from these records only. " + SHORT_PREFIXES[1]
    turn_1 = [{"role": "system", "content": system},
              {"role": "user", "content": "Describe the animal that sleeps longest."}]

    async def chat(client: Any, messages: list[dict[str, str]], max_tokens: int
                   ) -> dict[str, Any]:
        return done_of(await client.request(
            {"op": "chat", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
             "stream": False}, timeout=180))

    async with running_daemon(store_config(cache_dir)) as daemon, daemon.client() as client:
        first = await chat(client, turn_1, 48)
        # Past _RESTORE_GAIN: a state of the text so far would be worth taking.
        assert first["usage"]["completion_tokens"] > 24, first
        saved = (await cache_stats(client))["saved"]
        turn_2 = [*turn_1, {"role": "assistant", "content": first["text"]},
                  {"role": "user", "content": "And which sleeps least?"}]
        second = await chat(client, turn_2, 8)
        assert second["timings"]["cache_source"] == "slot"
        assert second["usage"]["cached_tokens"] > first["usage"]["prompt_tokens"] + 24
        assert (await cache_stats(client))["saved"] == saved
        await generate(client, OTHER)  # the one slot goes to another prompt
        turn_3 = [*turn_2, {"role": "assistant", "content": second["text"]},
                  {"role": "user", "content": "Why?"}]
        third = await chat(client, turn_3, 8)
        assert third["timings"]["cache_source"] == "ram", third
        assert third["usage"]["cached_tokens"] >= second["usage"]["prompt_tokens"], third


async def test_a_prefix_seen_once_comes_back_for_another_question_after_a_restart(
        cache_dir: Path) -> None:
    async with running_daemon(store_config(cache_dir)) as daemon, daemon.client() as client:
        first = await generate(client, SHORT_PREFIXES[3] + QUESTION_1)
    async with running_daemon(store_config(cache_dir)) as daemon, daemon.client() as client:
        # Kept at the line start before "Question": the next question starts there.
        other = await generate(client, SHORT_PREFIXES[3] + QUESTION_2)
        assert other["timings"]["cache_source"] == "disk"
        question = first["usage"]["prompt_tokens"] - other["usage"]["cached_tokens"]
        assert 0 < question < 16


async def test_a_shared_prefix_gets_a_state_only_well_past_a_stored_one(cache_dir: Path) -> None:
    # The first prompt keeps its states, one at the line start before its question.
    # The next shares a few tokens more with it ("Question: how"): a state there would
    # save those few tokens over the stored one, and is not taken (each copy held the
    # step loop ~30 ms under churn). The third shares the second's whole question, 40+
    # tokens: that prefix is worth a state of its own, and a later prompt with that
    # question restores it (rather than the line start's: more than _EXACT_SLACK past it).
    question = ("\nQuestion: how many records are there, counting every red, green, blue "
                "and amber box in the list above, and leaving out the boxes that hold no "
                "stones at all, if there are any such boxes?")
    async with running_daemon(store_config(cache_dir)) as daemon, daemon.client() as client:
        await generate(client, LONG + QUESTION_1)
        saved = (await cache_stats(client))["saved"]
        # The line start before its question; its end and the "Answer:" line start are
        # too close past it to be worth a copy of their own.
        assert saved == 1
        # Short answers: a slot's cells let go 64+ tokens past a stored state are kept too.
        second = await generate(client, LONG + question + "\nAnswer:", max_tokens=2)
        assert second["timings"]["cache_source"] == "slot"
        assert (await cache_stats(client))["saved"] == saved
        third = await generate(client, LONG + question + " Answer in words.\nAnswer:",
                               max_tokens=2)
        assert (await cache_stats(client))["saved"] == saved + 1
        await generate(client, OTHER)  # the one slot goes to another prompt
        fourth = await generate(client, LONG + question + " Answer in digits.\nAnswer:")
        assert fourth["timings"]["cache_source"] == "ram", fourth
        assert fourth["usage"]["cached_tokens"] >= third["usage"]["cached_tokens"] - 1


async def test_the_cache_op_lists_the_states_and_clears_ram_and_disk(cache_dir: Path) -> None:
    async with running_daemon(store_config(cache_dir)) as daemon:
        await warm_answer(daemon)
        async with daemon.client() as client:
            listed = await client.final({"op": "cache"})
            assert listed["type"] == "cache" and listed["enabled"] is True, listed
            states = listed["states"]
            assert states, listed
            assert listed["removed_states"] == listed["removed_files"] == 0
            folder = Path(listed["dir"])
            assert folder.parent == cache_dir
            for state in states:
                # Every stored prefix is one of the long prompt's, kept in both tiers.
                assert state["tokens"] >= 64 and state["bytes"] > 0, state
                assert state["ram"] and state["disk"], state
                assert LONG.startswith(state["preview"]), state
            cache = await cache_stats(client)
            assert cache["ram_states"] == len(states)
            # A wrong action is the client's mistake: an error line, the daemon serves on.
            wrong = await client.final({"op": "cache", "action": "purge"})
            assert wrong["code"] == "invalid_request" and "$.action" in wrong["message"], wrong
            cleared = await client.final({"op": "cache", "action": "clear"})
            assert cleared["type"] == "cache", cleared
            assert cleared["removed_states"] == len(states), cleared
            assert cleared["removed_files"] >= 1 and cleared["removed_bytes"] > 0, cleared
            assert cleared["states"] == []
            assert not list(folder.iterdir())
            if hasattr(os, "SCHED_IDLE"):
                # The clear ran on the store's writer thread, after it left the normal
                # priority: it is the daemon's one thread that waits for idle cores
                # (system/background.py); the decode and the loop keep theirs.
                policies = [os.sched_getscheduler(int(tid)) for tid in
                            os.listdir(f"/proc/{daemon.process.pid}/task")]
                assert policies.count(os.SCHED_IDLE) == 1, policies
            cache = await cache_stats(client)
            assert cache["ram_states"] == cache["disk_files"] == 0, cache
            assert cache["ram_bytes"] == cache["disk_bytes"] == 0, cache
            # What the slot holds is not a stored state, and is still there.
            warm = await generate(client, LONG + QUESTION_1)
            assert warm["timings"]["cache_source"] == "slot", warm


async def test_sfcore_cache_lists_and_clears(cache_dir: Path) -> None:
    async with running_daemon(store_config(cache_dir)) as daemon:
        await warm_answer(daemon)

        def sfcore_cache(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "sfcore_client", "cache", "--socket", daemon.socket_path,
                 *args], capture_output=True, text=True, timeout=120, check=False,
                stdin=subprocess.DEVNULL)

        listed = await asyncio.to_thread(sfcore_cache)
        assert listed.returncode == 0, listed.stderr
        lines = listed.stdout.splitlines()
        n_states = int(lines[0].split()[0])
        assert n_states >= 1 and str(cache_dir) in lines[0], listed.stdout
        assert lines[1].split() == ["tokens", "MB", "kept", "in", "text"], listed.stdout
        assert len(lines) == 2 + n_states and "ram+disk" in lines[2], listed.stdout
        cleared = await asyncio.to_thread(sfcore_cache, "--clear")
        assert cleared.returncode == 0, cleared.stderr
        assert cleared.stdout.startswith(f"cleared: {n_states} states, "), cleared.stdout
        assert cleared.stdout.splitlines()[1].startswith("0 states"), cleared.stdout
        raw = await asyncio.to_thread(sfcore_cache, "--json")
        assert json.loads(raw.stdout)["states"] == [], raw.stdout
        assert not state_files(cache_dir)
