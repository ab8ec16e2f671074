"""Every configuration mistake is a ConfigError a user can act on: it names the file, line and
key, says what was wrong and lists what would have been valid. Nothing is written first."""

from __future__ import annotations

import os
import textwrap

import pytest

import tierstore
from tierstore import ConfigError


def write_toml(tmp_path, text):
    path = tmp_path / "tiers.toml"
    path.write_text(textwrap.dedent(text))
    return path


def open_error(config) -> str:
    with pytest.raises(ConfigError) as info:
        tierstore.open(config)
    return str(info.value)


def test_a_valid_toml_file_with_placeholders_and_env_values(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_ROOT", str(tmp_path / "root"))
    path = write_toml(tmp_path, f"""
        [store]
        staging = "cpu"
        io_threads = 2

        [[tier]]
        name = "ram"
        backend = "memory"
        path = "{tmp_path}/shm/{{node}}/{{rank}}"
        keep = 2

        [[tier]]
        name = "nvme"
        backend = "local"
        path = {{ env = "CKPT_ROOT" }}
        every = 5
        """)
    with tierstore.open(path) as store:
        assert [t.name for t in store._ctx.tiers] == ["ram", "nvme"]
        assert store._ctx.tiers[0].backend.root == f"{tmp_path}/shm/0/0"
        assert store._ctx.tiers[1].backend.root == str(tmp_path / "root")
        assert store._ctx.config.io_threads == 2
    assert not (tmp_path / "root").exists(), "opening a store must not write anything"


def test_unknown_tier_key_names_line_and_suggests(tmp_path):
    path = write_toml(tmp_path, f"""
        [[tier]]
        name = "nvme"
        backend = "local"
        path = "{tmp_path}/x"
        evry = 5
        """)
    msg = open_error(path)
    assert f"{path}:6" in msg
    assert "tier 'nvme'" in msg and "unknown key 'evry'" in msg
    assert "Did you mean 'every'?" in msg
    assert "Valid keys: backend, codecs, dedup, every, fsync, keep, name, path, shared" in msg


def test_wrong_type_names_key_and_expected_type(tmp_path):
    path = write_toml(tmp_path, f"""
        [[tier]]
        name = "nvme"
        backend = "local"
        path = "{tmp_path}/x"
        keep = "three"
        """)
    msg = open_error(path)
    assert f"{path}:6" in msg and "key 'keep' must be an integer, got str 'three'" in msg


def test_bool_is_not_an_integer(tmp_path):
    msg = open_error({"tier": [{"name": "a", "backend": "local", "path": str(tmp_path), "every": True}]})
    assert "key 'every' must be a whole number of steps or \"auto\", got bool True" in msg


def test_keep_and_every_must_be_positive(tmp_path):
    msg = open_error({"tier": [{"name": "a", "backend": "local", "path": str(tmp_path), "keep": 0}]})
    assert "key 'keep': must be at least 1, got 0" in msg


def test_unknown_backend_lists_valid_ones(tmp_path):
    path = write_toml(tmp_path, """
        [[tier]]
        name = "nvme"
        backend = "nvme-fast"
        path = "/tmp/x"
        """)
    msg = open_error(path)
    assert f"{path}:4" in msg
    assert "unknown backend 'nvme-fast'" in msg
    valid = msg.split("valid backends: ")[1].split(".")[0].split(", ")
    assert {"fsspec", "local", "memory", "peer"} <= set(valid)  # beside installed plugins'
    assert "[store] plugins" in msg


def test_unknown_codec_and_staging_list_valid_ones(tmp_path):
    msg = open_error({"tier": [{"name": "a", "backend": "local", "path": str(tmp_path),
                                "codecs": ["lz5"]}]})
    assert "unknown codec 'lz5' in key 'codecs'" in msg
    msg = open_error({"store": {"staging": "gpu-direct"},
                      "tier": [{"name": "a", "backend": "local", "path": str(tmp_path)}]})
    assert "unknown staging 'gpu-direct'" in msg and "valid stagings: cpu" in msg


def test_duplicate_tier_names(tmp_path):
    path = write_toml(tmp_path, f"""
        [[tier]]
        name = "fast"
        backend = "memory"
        path = "{tmp_path}/a"

        [[tier]]
        name = "fast"
        backend = "local"
        path = "{tmp_path}/b"
        """)
    msg = open_error(path)
    assert "duplicate tier name 'fast' (tier[0] and tier[1])" in msg and f"{path}:8" in msg


def test_missing_required_keys(tmp_path):
    msg = open_error({"tier": [{"name": "a", "backend": "local"}]})
    assert "missing required key 'path'" in msg and "add path = <string>" in msg
    msg = open_error({"tier": [{"backend": "local", "path": str(tmp_path)}]})
    assert "missing required key 'name'" in msg
    msg = open_error({"store": {}})
    assert "missing required key 'tier'" in msg


def test_no_tiers_and_no_every_one(tmp_path):
    assert "no tiers; add at least one [[tier]]" in open_error({"tier": []})
    msg = open_error({"tier": [{"name": "a", "backend": "local", "path": str(tmp_path), "every": 2}]})
    assert "no tier has every = 1" in msg and "set every = 1 on the fastest tier ('a')" in msg


def test_unknown_store_key_and_top_level_key(tmp_path):
    msg = open_error({"store": {"overwrite": False, "threads": 3},
                      "tier": [{"name": "a", "backend": "local", "path": str(tmp_path)}]})
    assert "[store]: unknown key 'threads'" in msg and "io_threads" in msg
    msg = open_error({"tiers": [], "tier": [{"name": "a", "backend": "local", "path": str(tmp_path)}]})
    assert "top level: unknown key 'tiers'. Did you mean 'tier'?" in msg


def test_unreachable_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    msg = open_error({"tier": [{"name": "nvme", "backend": "local", "path": str(blocker / "ckpt")}]})
    assert "tier 'nvme': path" in msg and "exists and is not a directory" in msg
    assert "point 'path' at a writable location" in msg


def test_unknown_placeholder(tmp_path):
    msg = open_error({"tier": [{"name": "a", "backend": "local", "path": str(tmp_path) + "/{host}"}]})
    assert "unknown placeholder '{host}'" in msg and "{rank}, {local_rank}, {node}" in msg


def test_missing_environment_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("NO_SUCH_VAR_X", raising=False)
    msg = open_error({"tier": [{"name": "a", "backend": "local", "path": {"env": "NO_SUCH_VAR_X"}}]})
    assert "environment variable 'NO_SUCH_VAR_X', which is not set" in msg
    assert "export NO_SUCH_VAR_X=" in msg


def test_bad_toml_syntax_and_missing_file(tmp_path):
    path = write_toml(tmp_path, """
        [[tier]]
        name = "a
        """)
    msg = open_error(path)
    assert f"{path}: not valid TOML" in msg and "line 3" in msg
    msg = open_error(tmp_path / "nope.toml")
    assert "does not exist" in msg and "nope.toml" in msg


def test_bad_tier_name(tmp_path):
    msg = open_error({"tier": [{"name": "a/b", "backend": "local", "path": str(tmp_path)}]})
    assert "name 'a/b' must be one path segment" in msg


def test_staging_table_with_options_is_validated(tmp_path):
    msg = open_error({"store": {"staging": {"name": "cpu", "pinned": True}},
                      "tier": [{"name": "a", "backend": "local", "path": str(tmp_path)}]})
    assert "[store.staging] (staging 'cpu'): unknown key 'pinned'" in msg
    msg = open_error({"store": {"staging": {"pinned": True}},
                      "tier": [{"name": "a", "backend": "local", "path": str(tmp_path)}]})
    assert "needs a 'name' key" in msg


def test_memory_backend_has_a_default_path():
    with tierstore.open({"tier": [{"name": "ram", "backend": "memory"}]}) as store:
        assert store._ctx.tiers[0].backend.root == f"/dev/shm/tierstore-{os.geteuid()}/0"


def test_config_error_is_a_value_error_and_a_tierstore_error():
    with pytest.raises(ValueError):
        tierstore.open({"tier": []})
    with pytest.raises(tierstore.TierstoreError):
        tierstore.open({"tier": []})
    with pytest.raises(ConfigError, match="takes a path to a TOML file or a dict"):
        tierstore.open(42)
