"""Hostile configurations: bytes that are not UTF-8, NUL characters, paths too long for the
filesystem, empty paths, tiers inside one another, secrets read from the environment, values of
a type that merely looks right. Each must be a ConfigError that names the file (and line), the
key, what is wrong and what to do; none may show a value read from the environment, in the
message or in the logs; and none may leave anything on disk."""

from __future__ import annotations

import logging
import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

import tierstore
from tierstore import ConfigError

SECRET = "s3cr3t-Value-7f3a"


@dataclass(frozen=True)
class Case:
    """One hostile config: how to make it in ``tmp_path``, the environment it reads, words the
    message must hold (``{file}`` and ``{tmp}`` are filled in) and strings it must not show."""

    id: str
    make: Callable[[Path], Any]
    words: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    hidden: tuple[str, ...] = ()


def toml(text: str) -> Callable[[Path], Path]:
    """A TOML file ``tiers.toml`` written from ``text`` (``{tmp}`` filled in)."""
    def make(tmp: Path) -> Path:
        path = tmp / "tiers.toml"
        path.write_text(textwrap.dedent(text).lstrip("\n").replace("{tmp}", str(tmp)),
                        encoding="utf-8")
        return path
    return make


def raw_file(data: bytes) -> Callable[[Path], Path]:
    """A file ``tiers.toml`` holding exactly ``data`` (``{tmp}`` filled in)."""
    def make(tmp: Path) -> Path:
        path = tmp / "tiers.toml"
        path.write_bytes(data.replace(b"{tmp}", os.fsencode(tmp)))
        return path
    return make


def tiers(*tables: dict[str, Any], store: dict[str, Any] | None = None) -> Callable[[Path], dict]:
    """A dict config of ``tables`` (string values with ``{tmp}`` filled in)."""
    def fill(value: Any, tmp: Path) -> Any:
        if isinstance(value, str):
            return value.replace("{tmp}", str(tmp))
        if isinstance(value, dict):
            return {k: fill(v, tmp) for k, v in value.items()}
        if isinstance(value, list):
            return [fill(v, tmp) for v in value]
        return value

    def make(tmp: Path) -> dict:
        config = {"tier": [fill(t, tmp) for t in tables]}
        if store is not None:
            config["store"] = fill(store, tmp)
        return config
    return make


def local(**keys: Any) -> dict[str, Any]:
    return {"name": "nvme", "backend": "local", "path": "{tmp}/nvme", **keys}


def fsspec(**keys: Any) -> dict[str, Any]:
    return {"name": "s3", "backend": "fsspec", "url": "memory://bucket/run", **keys}


def make_symlink(tmp: Path) -> dict:
    """Tier 'b' reaches tier 'a''s directory through a symlink."""
    (tmp / "data").mkdir()
    (tmp / "link").symlink_to(tmp / "data")
    return tiers({"name": "a", "backend": "memory", "path": "{tmp}/data"},
                 {"name": "b", "backend": "local", "path": "{tmp}/link/b"})(tmp)


def make_secret_symlink(tmp: Path) -> dict:
    """Tier 'ram' reads its path from the environment: a symlink (named like a secret) to the
    directory that holds tier 'nvme'."""
    (tmp / "data").mkdir()
    (tmp / SECRET).symlink_to(tmp / "data")
    return tiers({"name": "ram", "backend": "memory", "path": {"env": "TS_HOSTILE_SECRET"}},
                 {"name": "nvme", "backend": "local", "path": "{tmp}/data/nvme"})(tmp)


CASES = [
    # -- the file itself --------------------------------------------------------------------
    Case("not-utf8", raw_file(b'[[tier]]\nname = "caf\xe9"\nbackend = "local"\n'),
         ("{file}:2:", "not UTF-8", "byte 0xe9", "line 2, column 12", "save the file as UTF-8")),
    Case("toml-syntax", toml('''
            [[tier]]
            name = "a
            '''),
         ("{file}: not valid TOML", "line 2", "the line reads 'name = \"a'", "fix the syntax")),
    Case("raw-nul-byte", raw_file(b'[[tier]]\nname = "a\x00"\nbackend = "local"\n'),
         ("{file}: not valid TOML", "line 2", "the line reads 'name = \"a\\x00\"'",
          "fix the syntax")),
    # U+2028 is a line break to str.splitlines(), not to TOML: line numbers must not shift.
    Case("line-separator-in-a-string", toml('''
            [[tier]]
            name = "nvme"
            backend = "local"
            path = "{tmp}/a\u2028b"
            evry = 5
            '''),
         ("{file}:5:", "unknown key 'evry'", "Did you mean 'every'?")),
    # -- NUL characters ---------------------------------------------------------------------
    Case("nul-escape-in-path", toml('''
            [[tier]]
            name = "nvme"
            backend = "local"
            path = "{tmp}/nv\\u0000me"
            '''),
         ("{file}:4:", "tier 'nvme'", "key 'path'", "NUL character",
          "give 'path' the tier's own location")),
    Case("nul-in-url", tiers(fsspec(url="file://{tmp}/s3\x00x")),
         ("<dict>", "tier 's3'", "key 'url'", "NUL character", "give 'url'")),
    # -- lengths the filesystem refuses ------------------------------------------------------
    Case("component-too-long", tiers(local(path="{tmp}/" + "a" * 5000)),
         ("<dict>", "tier 'nvme'", "key 'path'", "5000 bytes", "at most 255 bytes (NAME_MAX)",
          "use shorter directory names")),
    Case("component-too-long-in-file-url", tiers(fsspec(url="file://{tmp}/" + "é" * 128)),
         ("<dict>", "tier 's3'", "key 'url'", "256 bytes", "NAME_MAX")),
    Case("path-too-long", tiers(local(path="{tmp}/" + "/".join(["b" * 200] * 25))),
         ("<dict>", "tier 'nvme'", "key 'path'", "PATH_MAX", "choose a much shorter directory")),
    # -- empty locations ----------------------------------------------------------------------
    Case("empty-path", toml('''
            [[tier]]
            name = "nvme"
            backend = "local"
            path = ""
            '''),
         ("{file}:4:", "tier 'nvme'", "key 'path'", "is empty", "current directory",
          "give 'path' the tier's own location")),
    Case("blank-path", tiers(local(path="   ")),
         ("<dict>", "key 'path'", "only whitespace", "give 'path'")),
    Case("empty-memory-path", tiers({"name": "ram", "backend": "memory", "path": ""}),
         ("<dict>", "tier 'ram'", "key 'path'", "is empty")),
    Case("empty-url", tiers(fsspec(url="")),
         ("<dict>", "tier 's3'", "key 'url'", "is empty", "give 'url'")),
    # -- tiers in one place -------------------------------------------------------------------
    Case("same-directory-through-dotdot", toml('''
            [[tier]]
            name = "ram"
            backend = "memory"
            path = "{tmp}/ckpt"

            [[tier]]
            name = "nvme"
            backend = "local"
            path = "{tmp}/other/../ckpt/"
            '''),
         ("{file}:9:", "tiers 'ram' and 'nvme' overlap", "is the same place as",
          "give each tier a directory of its own")),
    Case("nested-through-placeholder", tiers(
            {"name": "ram", "backend": "memory", "path": "{tmp}/ckpt/{node}/{rank}"},
            {"name": "nvme", "backend": "local", "path": "{tmp}/ckpt/0"}),
         ("<dict>", "tiers 'ram' and 'nvme' overlap", "contains", "/ckpt/0/0)",
          "neither inside the other")),
    Case("nested-through-symlink", make_symlink,
         ("<dict>", "tiers 'a' and 'b' overlap", "is inside", "/data/b)")),
    Case("local-tier-inside-file-url", tiers(
            {"name": "ram", "backend": "memory", "path": "{tmp}/ckpt"},
            fsspec(url="file://{tmp}/ckpt/s3")),
         ("<dict>", "tiers 'ram' and 's3' overlap", "is inside")),
    Case("nested-object-store-prefixes", tiers(
            fsspec(name="s3", url="memory://bucket/run"),
            fsspec(name="s3b", url="memory://bucket//run/x/../y")),
         ("<dict>", "tiers 's3' and 's3b' overlap", "is inside", "memory://bucket/run/y")),
    # -- values read from the environment ----------------------------------------------------
    Case("env-string-as-table", toml('''
            [[tier]]
            name = "s3"
            backend = "fsspec"
            url = "memory://bucket/run"
            options = { env = "TS_HOSTILE_SECRET" }
            '''),
         ("{file}:5:", "tier 's3'", "key 'options' must be a table",
          "*** (the value of $TS_HOSTILE_SECRET, not shown)", "read single entries"),
         env={"TS_HOSTILE_SECRET": SECRET}, hidden=(SECRET,)),
    Case("env-string-as-integer", tiers(fsspec(max_attempts={"env": "TS_HOSTILE_SECRET"})),
         ("<dict>", "key 'max_attempts' must be an integer", "$TS_HOSTILE_SECRET", "***",
          "write max_attempts = <integer> in the config"),
         env={"TS_HOSTILE_SECRET": SECRET}, hidden=(SECRET,)),
    Case("env-short-number-as-integer", tiers(local(keep={"env": "TS_HOSTILE_SECRET"})),
         ("key 'keep' must be an integer", "got str *** (the value of $TS_HOSTILE_SECRET"),
         env={"TS_HOSTILE_SECRET": "7"}, hidden=("'7'",)),
    Case("env-unknown-codec", tiers(local(codecs=[{"env": "TS_HOSTILE_SECRET"}])),
         ("<dict>", "unknown codec ***", "$TS_HOSTILE_SECRET", "valid codecs: "),
         env={"TS_HOSTILE_SECRET": SECRET}, hidden=(SECRET,)),
    Case("env-unknown-staging", tiers(local(), store={"staging": {"env": "TS_HOSTILE_SECRET"}}),
         ("<dict>", "unknown staging ***", "$TS_HOSTILE_SECRET", "valid stagings: "),
         env={"TS_HOSTILE_SECRET": SECRET}, hidden=(SECRET,)),
    Case("env-unknown-backend", tiers(local(backend={"env": "TS_HOSTILE_SECRET"})),
         ("<dict>", "unknown backend ***", "$TS_HOSTILE_SECRET", "valid backends: "),
         env={"TS_HOSTILE_SECRET": SECRET}, hidden=(SECRET,)),
    Case("env-bad-tier-name", tiers(local(name={"env": "TS_HOSTILE_SECRET"})),
         ("<dict>", "tier[0]", "name ***", "must be one path segment"),
         env={"TS_HOSTILE_SECRET": SECRET + "/x"}, hidden=(SECRET,)),
    Case("env-plugins-not-a-list", tiers(local(), store={"plugins": {"env": "TS_HOSTILE_SECRET"}}),
         ("<dict>", "[store]", "key 'plugins' must be an array", "$TS_HOSTILE_SECRET"),
         env={"TS_HOSTILE_SECRET": SECRET}, hidden=(SECRET,)),
    Case("env-path-with-unknown-placeholder", tiers(local(path={"env": "TS_HOSTILE_SECRET"})),
         ("<dict>", "key 'path' uses unknown placeholder", "$TS_HOSTILE_SECRET",
          "valid placeholders"),
         env={"TS_HOSTILE_SECRET": f"/{SECRET}/{{host}}"}, hidden=(SECRET, "{host}")),
    Case("env-path-empty", tiers(local(path={"env": "TS_HOSTILE_SECRET"})),
         ("<dict>", "key 'path' = *** (the value of $TS_HOSTILE_SECRET", "is empty"),
         env={"TS_HOSTILE_SECRET": ""}, hidden=("''",)),
    Case("env-path-too-long", tiers(local(path={"env": "TS_HOSTILE_SECRET"})),
         ("<dict>", "key 'path'", "NAME_MAX"),
         env={"TS_HOSTILE_SECRET": f"{{tmp}}/{SECRET}" + "z" * 300},
         hidden=(SECRET, "z" * 20)),
    Case("env-tiers-overlap", make_secret_symlink,
         ("<dict>", "tiers 'ram' and 'nvme' overlap", "is inside path *** (the value of "
          "$TS_HOSTILE_SECRET, not shown) of tier 'ram'"),
         env={"TS_HOSTILE_SECRET": "{tmp}/" + SECRET}, hidden=(SECRET,)),
    Case("env-as-whole-tier-list", lambda tmp: {"tier": {"env": "TS_HOSTILE_SECRET"}},
         ("<dict>", "key 'tier' must be an array"),
         env={"TS_HOSTILE_SECRET": SECRET}, hidden=(SECRET,)),
    Case("env-name-not-a-string", tiers(local(path={"env": 5})),
         ("<dict>", "key 'path'", "takes the name of an environment variable as a string",
          "{ env = \"NAME\" }")),
    # -- values of a type that only looks right ----------------------------------------------
    Case("quoted-number", toml('''
            [[tier]]
            name = "nvme"
            backend = "local"
            path = "{tmp}/nvme"
            keep = "3"
            '''),
         ("{file}:5:", "tier 'nvme'", "key 'keep' must be an integer, got str '3'",
          "Write the number without quotes: keep = 3")),
    Case("bool-as-integer", toml('''
            [[tier]]
            name = "nvme"
            backend = "local"
            path = "{tmp}/nvme"
            every = true
            '''),
         ("{file}:5:", "key 'every' must be a whole number of steps or \"auto\", got bool True",
          "true and false are booleans, not numbers: write every = <whole number of steps or "
          "\"auto\">")),
    Case("quoted-bool", tiers(local(fsync="false")),
         ("key 'fsync' must be a boolean, got str 'false'",
          "Write it without quotes: fsync = false")),
    Case("nan-timeout", toml('''
            [store]
            collective_timeout = nan

            [[tier]]
            name = "nvme"
            backend = "local"
            path = "{tmp}/nvme"
            '''),
         ("{file}:2:", "[store]", "key 'collective_timeout' is nan, which is no number")),
    Case("negative-exit-timeout", tiers(local(), store={"exit_timeout": -1}),
         ("<dict>", "[store]", "key 'exit_timeout'", "must be 0 (do not wait) or a number")),
]


def snapshot(root: Path) -> set[str]:
    """Every file, directory and link under ``root``."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            found.add(os.path.relpath(os.path.join(dirpath, name), root))
    return found


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_config_is_a_config_error_that_says_what_to_do(case, tmp_path, monkeypatch,
                                                               caplog, capfd):
    work = tmp_path / "cwd"  # an empty path would land here
    work.mkdir()
    monkeypatch.chdir(work)
    env = {k: v.replace("{tmp}", str(tmp_path)) for k, v in case.env.items()}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = case.make(tmp_path)
    before = snapshot(tmp_path)
    caplog.set_level(logging.DEBUG)

    with pytest.raises(ConfigError) as info:
        with tierstore.open(config):
            pass

    msg = str(info.value)
    file = "<dict>" if isinstance(config, dict) else str(config)
    for word in case.words:
        word = word.replace("{file}", file).replace("{tmp}", str(tmp_path))
        assert word in msg, f"{word!r} missing from: {msg}"
    out, err = capfd.readouterr()
    for secret in case.hidden:
        assert secret not in msg, f"a value from the environment shows in: {msg}"
        assert secret not in caplog.text, "a value from the environment shows in the logs"
        assert secret not in out + err, "a value from the environment shows on stdout/stderr"
    assert snapshot(tmp_path) == before, "a rejected config must leave nothing on disk"


def test_a_byte_order_mark_is_not_a_mistake(tmp_path):
    path = tmp_path / "tiers.toml"
    path.write_bytes(b"\xef\xbb\xbf[[tier]]\nname = \"nvme\"\nbackend = \"local\"\n"
                     + f'path = "{tmp_path}/nvme"\n'.encode())
    with tierstore.open(path) as store:
        assert [t.name for t in store._ctx.tiers] == ["nvme"]


def test_overlap_is_decided_by_directories_not_characters(tmp_path):
    # "ckpt" and "ckpt-nvme" share a prefix of characters, not of directories: side by side.
    side_by_side = [{"name": "ram", "backend": "memory", "path": f"{tmp_path}/ckpt"},
                    {"name": "nvme", "backend": "local", "path": f"{tmp_path}/ckpt-nvme"},
                    {"name": "s3", "backend": "fsspec", "url": f"file://{tmp_path}/ckpt-s3"}]
    with tierstore.open({"tier": side_by_side}) as store:
        assert [t.name for t in store._ctx.tiers] == ["ram", "nvme", "s3"]
    inside = [dict(side_by_side[0]), dict(side_by_side[1], path=f"{tmp_path}/ckpt/nvme")]
    with pytest.raises(ConfigError, match="tiers 'ram' and 'nvme' overlap"):
        tierstore.open({"tier": inside})


def test_a_config_never_shows_credentials_in_its_repr(tmp_path, monkeypatch):
    """A validated config may be logged by a user (``repr``): what came from the environment
    stays out of it."""
    from tierstore.config.validate import load_config

    monkeypatch.setenv("TS_REPR_SECRET", "s3cr3t-value-in-env")
    config = {"tier": [{"name": "s3", "backend": "fsspec", "url": "memory://repr-test",
                        "options": {"secret": {"env": "TS_REPR_SECRET"}}}]}
    validated, _ = load_config(config)
    assert "s3cr3t-value-in-env" not in repr(validated)


def test_a_replication_strategy_read_from_the_environment_is_not_shown(tmp_path, monkeypatch):
    monkeypatch.setenv("TS_STRATEGY_SECRET", "top-secret-strategy")
    config = {"tier": [{"name": "p", "backend": "peer", "path": str(tmp_path / "peer"),
                        "replication": {"strategy": {"env": "TS_STRATEGY_SECRET"}}}]}
    with pytest.raises(tierstore.ConfigError) as info:
        tierstore.open(config)
    assert "top-secret-strategy" not in str(info.value)
    assert "$TS_STRATEGY_SECRET" in str(info.value)
