"""Config decoding and CLI overrides (unit), and config errors at startup (real CLI).

This file holds the tests that need no daemon and no model; those of the daemon's
process (start-up, exit) in tests/lifecycle/test_config.py.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from sfcore_daemon.cli import build_parser, resolve_config
from sfcore_daemon.config import Config, ConfigError, apply_overrides, load_config
from tests.kit import REPO


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_shipped_config_documents_exactly_the_defaults() -> None:
    assert load_config(REPO / "server_config.toml") == Config()


def test_every_default_is_written_in_the_shipped_config() -> None:
    text = (REPO / "server_config.toml").read_text()
    for section, values in msgspec.structs.asdict(Config()).items():
        assert f"[{section}]" in text
        for key in msgspec.structs.asdict(values):
            assert f"\n{key} = " in text, f"{section}.{key} is not documented"


def test_unknown_key_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key `server\.soket_path`"):
        load_config(write(tmp_path, '[server]\nsoket_path = "/tmp/x"\n'))


def test_unknown_section_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown key `modle`"):
        load_config(write(tmp_path, "[modle]\nn_ctx = 10\n"))


def test_wrong_type_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"`model\.n_ctx`: Expected `int`, got `str`"):
        load_config(write(tmp_path, '[model]\nn_ctx = "big"\n'))


def test_out_of_range_and_cross_field_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"`server\.socket_mode`"):
        load_config(write(tmp_path, '[server]\nsocket_mode = "999"\n'))
    with pytest.raises(ConfigError, match="n_ubatch"):
        load_config(write(tmp_path, "[model]\nn_batch = 256\nn_ubatch = 512\n"))


def test_speculative_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"`speculative\.mode`"):
        load_config(write(tmp_path, '[speculative]\nmode = "eagle"\n'))
    with pytest.raises(ConfigError, match=r"`speculative\.draft_max`"):
        load_config(write(tmp_path, "[speculative]\ndraft_max = 1\n"))
    with pytest.raises(ConfigError, match="draft_start"):
        load_config(write(tmp_path, "[speculative]\ndraft_max = 8\ndraft_start = 16\n"))
    with pytest.raises(ConfigError, match="ngram_min"):
        load_config(write(tmp_path, "[speculative]\nngram_max = 2\nngram_min = 3\n"))
    with pytest.raises(ConfigError, match=r"`speculative\.row_multiple`"):
        load_config(write(tmp_path, "[speculative]\nrow_multiple = 0\n"))


def test_not_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[server\n"))


def test_partial_file_keeps_other_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "[generation]\ntemperature = 0.0\n"))
    assert config.generation.temperature == 0.0
    assert config.generation.top_k == Config().generation.top_k
    assert config.server == Config().server


def test_cli_overrides_only_the_flags_given(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nsocket_path = "/tmp/a.sock"\nmax_queue = 3\n'
                          "[runtime]\nn_threads = 2\n")
    given = resolve_config(build_parser().parse_args(["--config", str(path), "--model", "/m.gguf"]))
    assert given.model.path == "/m.gguf"
    assert given.server.socket_path == "/tmp/a.sock"  # not given: the file wins
    assert given.server.max_queue == 3
    assert given.runtime.n_threads == 2
    overridden = resolve_config(build_parser().parse_args(
        ["--config", str(path), "--socket", "/tmp/b.sock", "--threads", "1"]))
    assert overridden.server.socket_path == "/tmp/b.sock"
    assert overridden.runtime.n_threads == 1


def test_the_openai_flag_sets_the_listener_and_is_held_to_loopback(tmp_path: Path) -> None:
    path = write(tmp_path, '[openai]\napi_key = "k"\n')
    config = resolve_config(build_parser().parse_args(
        ["--config", str(path), "--openai", "[::1]:8080"]))
    assert config.openai.listen == "[::1]:8080" and config.openai.api_key == "k"
    assert config.openai.address is not None and config.openai.address.port == 8080
    assert resolve_config(build_parser().parse_args(["--config", str(path)])).openai.listen == ""
    for address, message in (("0.0.0.0:8080", "allow_remote"), ("8080", "HOST:PORT"),
                             ("unix:relative.sock", "absolute"), ("127.0.0.1:70000", "port")):
        with pytest.raises(ConfigError, match=message):
            resolve_config(build_parser().parse_args(
                ["--config", str(path), "--openai", address]))
    remote = write(tmp_path, '[openai]\nallow_remote = true\napi_key = "k"\n')
    config = resolve_config(build_parser().parse_args(
        ["--config", str(remote), "--openai", "0.0.0.0:8080"]))
    assert config.openai.address is not None and not config.openai.address.is_loopback
    # Remote and no key: only with the second, explicit opt-in.
    keyless = write(tmp_path, '[openai]\nallow_remote = true\n')
    with pytest.raises(ConfigError, match="allow_remote_without_key"):
        resolve_config(build_parser().parse_args(
            ["--config", str(keyless), "--openai", "0.0.0.0:8080"]))
    opted_in = write(tmp_path, '[openai]\nallow_remote = true\nallow_remote_without_key = true\n')
    config = resolve_config(build_parser().parse_args(
        ["--config", str(opted_in), "--openai", "0.0.0.0:8080"]))
    assert config.openai.api_key == "" and config.openai.allow_remote_without_key
    # Origins and hosts are checked for their shape.
    for key, value in (("allowed_origins", '["app.example"]'), ("allowed_hosts", '["a b"]')):
        with pytest.raises(ConfigError, match=key):
            load_config(write(tmp_path, f"[openai]\n{key} = {value}\n"))


def test_override_values_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"`n_threads`"):
        apply_overrides(Config(), runtime__n_threads=-4)


def test_config_is_frozen() -> None:
    with pytest.raises(AttributeError):
        Config().server.max_queue = 1  # type: ignore[misc]
