"""Loading and validating a store's configuration (TOML file or dict of the same shape).

Validation is complete before anything is written: every key of every table is checked against
the core's keys and the keys the chosen plugins declare; the first mistake is a ConfigError that
names the file, line, table and key, and lists what would have been valid.
"""

from __future__ import annotations

import os
import posixpath
import re
import tomllib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierstore.transport.collectives import RankContext
from tierstore.config.keys import check_key_reference, keyring_from
from tierstore.errors import ConfigError
from tierstore.format.signing import UNSIGNED, Keyring
from tierstore.format.values import check_trusted_names
from tierstore.plugin.options import ConfigSource, Option, resolve_env, validate_table
from tierstore.plugin.host import PluginHost, build_plugin_host

#: ``every = "auto"``: the tier's interval is chosen as the job runs (tierstore.tiers.schedule)
AUTO = "auto"

__all__ = ["StoreConfig", "TierConfig", "PluginChoice", "load_source", "validate_config",
           "expand_placeholders", "load_config", "check_tier_locations"]

_SEGMENT = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9._\-]*$")
_PLACEHOLDER = re.compile(r"\{([^{}]*)\}")


def _positive(value: Any) -> str | None:
    return None if value >= 1 else f"must be at least 1, got {value}"


def _positive_seconds(value: Any) -> str | None:
    return None if value > 0 else f"must be a positive number of seconds, got {value}"


def _every(value: Any) -> str | None:
    if value == AUTO:
        return None
    if isinstance(value, str):
        return f'must be a whole number of steps or "auto", got "{value}"'
    return _positive(value)


def _not_negative(value: Any) -> str | None:
    return None if value >= 0 else f"must be 0 (off) or a number of seconds, got {value}"


def _wait_seconds(value: Any) -> str | None:
    return None if value >= 0 else f"must be 0 (do not wait) or a number of seconds, got {value}"


def _codec_list(value: Any) -> str | None:
    for v in value:
        if not (isinstance(v, str) or (isinstance(v, dict) and isinstance(v.get("name"), str))):
            return (f"each codec is a name or a table with a 'name' (e.g. "
                    f"{{ name = \"zstd\", level = 9 }}), got {v!r}")
    return None


def _str_list(value: Any) -> str | None:
    if not all(isinstance(v, str) for v in value):
        return f"must be a list of strings, got {value!r}"
    return None


def _non_empty(value: Any) -> str | None:
    return "must not be empty" if isinstance(value, str) and not value.strip() else None


def _trusted_names(value: Any) -> str | None:
    try:
        check_trusted_names(value)
    except ValueError as exc:
        return str(exc).removeprefix("trusted_pickles: ")
    return None


STORE_OPTIONS: tuple[Option, ...] = (
    Option("plugins", list, default=[], check=_str_list,
           description="extra plugin modules to import, beside entry points"),
    Option("staging", (str, dict), default="cpu",
           description="staging plugin name, or a table with 'name' and its options"),
    Option("commit", (str, dict), default=None,
           description="commit protocol (default: each backend's own)"),
    Option("overwrite", bool, default=False,
           description="allow saving an id that already exists on a tier (replaces it)"),
    Option("io_threads", int, default=4, check=_positive,
           description="files written and read in parallel per rank and tier"),
    Option("verify_on_load", bool, default=True,
           description="check each file's checksum while dcp.load reads it (always on with a "
                       "signing key: false is then refused)"),
    Option("drain_threads", int, default=4, check=_positive,
           description="files copied in parallel when draining to slower tiers"),
    Option("copy_chunk_mib", int, default=8, check=_positive,
           description="piece size of every background copy: the buffer per drain thread "
                       "(memory = drain_threads x this), and the pieces of peer replication "
                       "and of peer fetches on load"),
    Option("exit_timeout", (int, float), default=600, check=_wait_seconds,
           description="seconds a process exiting without close() waits for pending drains"),
    Option("part_timeout", (int, float), default=600, check=_wait_seconds,
           description="seconds rank 0 waits for other nodes' files when draining a node-local "
                       "checkpoint to a shared tier"),
    Option("collective_timeout", (int, float), default=600, check=_positive_seconds,
           description="seconds a collective of the store's process groups (latest(), a save's "
                       "or load's agreement, DCP's own on store.process_group, replication) "
                       "waits for every rank before failing with the ranks that did not answer"),
    Option("watchdog", (int, float), default=0, check=_not_negative,
           description="log every thread's stack when a save or load made no progress for this "
                       "many seconds (0: off)"),
    Option("scrub_every_s", (int, float), default=0, check=_not_negative,
           description="re-read one stored copy every this many seconds in the background, "
                       "round robin over every tier, and repair a bad one from a good copy "
                       "on another tier (0: off; rank 0 only)"),
    Option("trusted_pickles", list, default=[], check=_trusted_names,
           description="extra globals ('module.Name') that pickled non-tensor values read from "
                       "a tier may build, beside the weights_only allow-list"),
    # secret: a key pasted here by mistake must not be echoed by the message refusing it
    Option("signing_key", (dict, str), default=None, check=check_key_reference, read_env=False,
           secret=True, type_label="table",
           description="the key that signs and verifies checkpoints: { env = \"NAME\" } or "
                       "{ file = \"path\" }"),
    Option("signing_keys", list, default=[], read_env=False, secret=True,
           check=lambda keys: next(filter(None, map(check_key_reference, keys)), None),
           description="several keys for rotation, the first signs, every one verifies: "
                       "[{ env = \"NEW\" }, { env = \"OLD\" }]"),
    Option("accept_unsigned", bool, default=False,
           description="with a signing key, still read checkpoints that are not signed "
                       "(migrating those written before signing)"),
    Option("events_log", str, default=None, check=_non_empty,
           description="append every event of every rank to this file, one JSON object a line, "
                       "across restarts (`tierstore goodput` reads it)"),
    Option("mtbf_hours", (int, float), default=None, check=_positive_seconds,
           description="the job's mean time between failures, for tiers with every = \"auto\" "
                       "(default: from the restarts in events_log)"),
)

TIER_OPTIONS: tuple[Option, ...] = (
    Option("name", str, required=True, description="unique name of the tier"),
    Option("backend", str, required=True, description="persistence plugin"),
    Option("every", (int, str), default=1, check=_every,
           type_label='whole number of steps or "auto"',
           description="this tier takes saves whose step is a multiple of it; \"auto\": the "
                       "interval is chosen from the tier's measured cost and the failure rate "
                       "(Young/Daly)"),
    Option("keep", int, default=None, check=_positive,
           description="keep the newest N complete checkpoints (default: all)"),
    Option("codecs", list, default=[], check=_codec_list,
           description="byte transforms, in order: names, or tables with 'name' and options"),
    Option("shared", bool, default=None,
           description="true: every rank sees one directory (a shared filesystem); default: "
                       "decided at open from each rank's host and path"),
    Option("dedup", bool, default=False,
           description="store data files as chunks addressed by their digest: a save, drain "
                       "or repair writes only the chunks this tier does not hold yet"),
)

TOP_LEVEL_OPTIONS: tuple[Option, ...] = (
    Option("store", dict, default={}, description="store-wide settings", read_env=False),
    Option("tier", list, required=True, description="the tiers, fastest first", read_env=False),
)


@dataclass(frozen=True)
class PluginChoice:
    """A chosen plugin of a store-wide kind (staging, commit) with its validated options."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TierConfig:
    """One validated ``[[tier]]`` table. ``backend_options`` still holds placeholders."""

    index: int
    name: str
    backend: str
    #: a whole number of steps, or "auto" (tierstore.tiers.schedule)
    every: int | str
    keep: int | None
    codecs: tuple[PluginChoice, ...]
    #: kept out of repr: it holds credentials read from the environment
    backend_options: dict[str, Any] = field(repr=False)
    shared: bool | None = None
    #: data files are stored as content-addressed chunks (tierstore.tiers.chunked)
    dedup: bool = False

    def expanded_options(self, ctx: RankContext, options: tuple[Option, ...]) -> dict[str, Any]:
        """Backend options with ``{rank}``, ``{local_rank}``, ``{node}`` replaced for ``ctx``."""
        out = dict(self.backend_options)
        for opt in options:
            if opt.expand and isinstance(out.get(opt.name), str):
                out[opt.name] = expand_placeholders(out[opt.name], ctx)
        return out


@dataclass(frozen=True)
class StoreConfig:
    """A whole validated configuration."""

    plugins: tuple[str, ...]
    staging: PluginChoice
    commit: PluginChoice | None
    overwrite: bool
    io_threads: int
    verify_on_load: bool
    drain_threads: int
    copy_chunk_mib: int
    exit_timeout: float
    part_timeout: float
    tiers: tuple[TierConfig, ...]
    source: ConfigSource
    collective_timeout: float = 600
    watchdog: float = 0
    scrub_every_s: float = 0
    #: globals ("module.Name") non-tensor values from a tier may build beyond weights_only's
    trusted_pickles: tuple[str, ...] = ()
    #: where every event is appended as a JSON line (tierstore.engine.events_log), or None
    events_log: str | None = None
    #: the job's mean time between failures in hours, for every = "auto" (None: from the
    #: restarts the events log records)
    mtbf_hours: float | None = None
    #: the signing keys (tierstore.format.signing); kept out of repr like every secret
    keyring: Keyring = field(default=UNSIGNED, repr=False)


_TOML_POSITION = re.compile(r"\(at line (\d+), column (\d+)\)")
#: keys whose line a TOML syntax error does not quote: the core's secret keys, and any key a
#: plugin may take credentials under (its options are not known before the TOML is parsed)
_SECRET_STORE_KEYS = frozenset(o.name for o in STORE_OPTIONS if o.secret)
_SECRET_WORDS = re.compile(r"key|secret|token|passw|credential", re.IGNORECASE)


def load_source(config: Any) -> tuple[dict[str, Any], ConfigSource]:
    """Read ``config`` (a path to a TOML file or a dict) into a dict and its source."""
    if isinstance(config, dict):
        return config, ConfigSource("<dict>")
    if isinstance(config, (str, os.PathLike)):
        if not str(config).strip() or "\0" in str(config):
            raise ConfigError(
                f"config file name {str(config)!r} is empty or holds a NUL character; pass the "
                f"path of a TOML file (see docs/configuration.md) or a dict of the same shape"
            )
        path = Path(config)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise ConfigError(
                f"config file {str(path)!r} does not exist; pass the path of a TOML file "
                f"(see docs/configuration.md) or a dict of the same shape"
            ) from None
        except OSError as exc:
            raise ConfigError(f"config file {str(path)!r} cannot be read: {exc}") from None
        try:
            # utf-8-sig: a byte order mark (some Windows editors write one) is not a mistake.
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            line = raw.count(b"\n", 0, exc.start) + 1
            column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
            raise ConfigError(
                f"{path}:{line}: not UTF-8 text: byte 0x{raw[exc.start]:02x} at line {line}, "
                f"column {column} is not valid UTF-8, and TOML files must be UTF-8; save the "
                f"file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
            ) from None
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}{_offending_line(text, exc)}; "
                              f"fix the syntax there") from None
        return data, ConfigSource(str(path), text)
    raise ConfigError(
        f"tierstore.open() takes a path to a TOML file or a dict, got {type(config).__name__}"
    )


def _offending_line(text: str, exc: tomllib.TOMLDecodeError) -> str:
    """``; the line reads '...'`` for the line a TOML error points at (shortened, with control
    characters escaped), or ``""``."""
    match = _TOML_POSITION.search(str(exc))
    lines = text.split("\n")  # TOML counts lines by "\n" only; splitlines() knows more breaks
    if match is None or not 1 <= int(match.group(1)) <= len(lines):
        return ""
    line = lines[int(match.group(1)) - 1]
    name = line.split("=", 1)[0].strip().strip('"').rsplit(".", 1)[-1]
    if "=" in line and (name in _SECRET_STORE_KEYS or _SECRET_WORDS.search(name)):
        # A secret written bare (no quotes) is no TOML value: the line holds the secret.
        return f"; the line sets '{name}', which holds secrets (the line is not shown)"
    shown = repr(line if len(line) <= 120 else line[:120] + "...")
    return f"; the line reads {shown}"


def expand_placeholders(value: str, ctx: RankContext) -> str:
    """Replace ``{rank}``, ``{local_rank}`` and ``{node}`` in ``value``."""
    values = ctx.placeholders()
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), value)


def _check_placeholders(value: str, where: str, owner: str, key: str,
                        source: ConfigSource) -> None:
    for name in _PLACEHOLDER.findall(value):
        if name not in RankContext().placeholders():
            # A part of a value read from the environment is as secret as the whole.
            which = (f"'{{{name}}}'" if not source.from_env(value)
                     else f"(in {source.quote(value)})")
            raise ConfigError(
                f"{where}: {owner}: key '{key}' uses unknown placeholder {which}; valid "
                f"placeholders: {{rank}}, {{local_rank}}, {{node}}"
            )


def _unknown_name(kind: str, name: Any, host: PluginHost, where: str, owner: str,
                  key: str, source: ConfigSource) -> ConfigError:
    valid = ", ".join(host.names(kind)) or "(none registered)"
    return ConfigError(
        f"{where}: {owner}: unknown {kind} {source.quote(name)} in key '{key}'; valid {kind}s: "
        f"{valid}. "
        f"A plugin providing it can be added with [store] plugins = [\"module\"] or an entry point "
        f"in the 'tierstore' group"
    )


def _plugin_choice(kind: str, value: Any, host: PluginHost, source: ConfigSource,
                   key: str) -> PluginChoice:
    where = source.where("store", None, key)
    if isinstance(value, dict):
        if "name" not in value:
            raise ConfigError(
                f"{where}: [store.{key}] needs a 'name' key naming the {kind} plugin; valid: "
                f"{', '.join(host.names(kind))}"
            )
        name, opts = value["name"], {k: v for k, v in value.items() if k != "name"}
    else:
        name, opts = value, {}
    reg = host.lookup(kind, name) if isinstance(name, str) else None
    if reg is None:
        raise _unknown_name(kind, name, host, where, "[store]", key, source)
    checked = validate_table(opts, reg.options, owner=f"[store.{key}] ({kind} '{name}')",
                             source=source, table_name=f"store.{key}", index=None)
    return PluginChoice(name, checked)


#: old [store] key -> the key that replaced it (still accepted, with a DeprecationWarning)
RENAMED_STORE_KEYS = {"drain_chunk_mib": "copy_chunk_mib"}


def validate_store_table(raw: dict[str, Any], source: ConfigSource) -> dict[str, Any]:
    """The ``[store]`` table checked against the core's keys (plugins not resolved yet)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source.name}: 'store' must be a table ([store]), got "
                          f"{source.quote(raw)}; write [store] and its keys below it")
    raw = dict(raw)
    for old, new in RENAMED_STORE_KEYS.items():
        if old not in raw:
            continue
        where = source.where("store", None, old)
        if new in raw:
            raise ConfigError(f"{where}: [store] sets both '{old}' and '{new}', which replaced "
                              f"it; keep '{new}' only")
        warnings.warn(f"{where}: [store] key '{old}' is deprecated (it also sizes replication "
                      f"and peer fetches); rename it to '{new}'", DeprecationWarning,
                      stacklevel=4)
        raw[new] = raw.pop(old)
    return validate_table(raw, STORE_OPTIONS, owner="[store]", source=source,
                          table_name="store", index=None)


def validate_config(data: dict[str, Any], source: ConfigSource, host: PluginHost,
                    store_table: dict[str, Any]) -> StoreConfig:
    """Validate everything in ``data`` against the core's keys and the plugins' declared keys."""
    validate_table(data, TOP_LEVEL_OPTIONS, owner="top level", source=source, table_name=None,
                   index=None)
    tiers_raw = data["tier"]
    if not tiers_raw:
        raise ConfigError(f"{source.name}: no tiers; add at least one [[tier]] table")
    tiers: list[TierConfig] = []
    seen: dict[str, int] = {}
    for index, raw in enumerate(tiers_raw):
        if not isinstance(raw, dict):
            raise ConfigError(f"{source.name}: tier[{index}] must be a table ([[tier]]), got "
                              f"{source.quote(raw)}; write each tier as a [[tier]] table")
        raw_name = raw.get("name")
        label = (f"tier '{raw_name}' (tier[{index}])" if isinstance(raw_name, str)
                 else f"tier[{index}]")
        backend_where = source.where("tier", index, "backend")
        backend_name = resolve_env(raw.get("backend"), backend_where, "backend", source)
        reg = host.lookup("backend", backend_name) if isinstance(backend_name, str) else None
        if reg is None and "backend" in raw:
            raise _unknown_name("backend", backend_name, host, backend_where, label, "backend",
                                source)
        backend_opts = reg.options if reg else ()
        core_names = {o.name for o in TIER_OPTIONS}
        clash = [o.name for o in backend_opts if o.name in core_names]
        if clash:
            raise ConfigError(f"backend '{backend_name}' ({reg.origin}) declares core tier keys {clash}")
        checked = validate_table(raw, TIER_OPTIONS + backend_opts, owner=label, source=source,
                                 table_name="tier", index=index)
        name = checked["name"]
        if not _SEGMENT.match(name):
            raise ConfigError(
                f"{source.where('tier', index, 'name')}: {label}: name {source.quote(name)} must "
                f"be one path segment of letters, digits, '.', '_', '-'"
            )
        if name in seen:
            raise ConfigError(
                f"{source.where('tier', index, 'name')}: duplicate tier name {source.quote(name)} "
                f"(tier[{seen[name]}] and tier[{index}]); tier names must be unique"
            )
        seen[name] = index
        codecs = []
        for codec in checked["codecs"]:
            codec_name = codec if isinstance(codec, str) else codec["name"]
            reg = host.lookup("codec", codec_name)
            if reg is None:
                raise _unknown_name("codec", codec_name, host,
                                    source.where("tier", index, "codecs"), label, "codecs",
                                    source)
            opts = {} if isinstance(codec, str) else {k: v for k, v in codec.items() if k != "name"}
            codecs.append(PluginChoice(codec_name, validate_table(
                opts, reg.options, owner=f"{label}: codec '{codec_name}'", source=source,
                table_name="tier", index=index)))
        for opt in backend_opts:
            if opt.expand and isinstance(checked.get(opt.name), str):
                _check_placeholders(checked[opt.name], source.where("tier", index, opt.name),
                                    label, opt.name, source)
        tiers.append(TierConfig(
            index=index, name=name, backend=checked["backend"], every=checked["every"],
            keep=checked["keep"], codecs=tuple(codecs),
            backend_options={o.name: checked[o.name] for o in backend_opts},
            shared=checked["shared"], dedup=checked["dedup"],
        ))
    if not any(t.every in (1, AUTO) for t in tiers):
        raise ConfigError(
            f"{source.name}: no tier has every = 1 (or \"auto\"), so some saves would go "
            f"nowhere; set every = 1 on the fastest tier ({tiers[0].name!r})"
        )
    if any(t.every == AUTO for t in tiers) and store_table.get("mtbf_hours") is None \
            and store_table.get("events_log") is None:
        raise ConfigError(
            f"{source.name}: tier {next(t.name for t in tiers if t.every == AUTO)!r} has "
            f"every = \"auto\", which needs the job's failure rate: set [store] mtbf_hours "
            f"(the mean time between failures), or [store] events_log (the restarts it records "
            f"give it)")
    staging = _plugin_choice("staging", store_table["staging"], host, source, "staging")
    commit = (None if store_table["commit"] is None
              else _plugin_choice("commit", store_table["commit"], host, source, "commit"))
    keyring = keyring_from(store_table, source)
    if keyring.signs and not store_table["verify_on_load"]:
        # A signed manifest vouches for digests; bytes read without checking them against
        # those digests are whatever someone without the key wrote to the tier.
        raise ConfigError(
            f"{source.where('store', None, 'verify_on_load')}: [store] sets verify_on_load = "
            f"false and a signing key: a key protects only the bytes that are checked, so "
            f"when a key is set, every byte a load hands to the model must be checked against "
            f"its signed digest; remove verify_on_load (it defaults to true), or remove the "
            f"signing key if the tiers' bytes need no protection")
    return StoreConfig(
        plugins=tuple(store_table["plugins"]), staging=staging, commit=commit,
        overwrite=store_table["overwrite"], io_threads=store_table["io_threads"],
        verify_on_load=store_table["verify_on_load"], drain_threads=store_table["drain_threads"],
        copy_chunk_mib=store_table["copy_chunk_mib"], exit_timeout=store_table["exit_timeout"],
        part_timeout=store_table["part_timeout"],
        collective_timeout=store_table["collective_timeout"], watchdog=store_table["watchdog"],
        scrub_every_s=store_table["scrub_every_s"], tiers=tuple(tiers), source=source,
        trusted_pickles=tuple(store_table["trusted_pickles"]),
        events_log=(None if store_table["events_log"] is None
                    else os.path.expanduser(store_table["events_log"])),
        mtbf_hours=store_table["mtbf_hours"],
        keyring=keyring,
    )


def load_config(config: Any, plugins: tuple[object, ...] = (),
                store_builtins: dict[str, object] | None = None) -> tuple[StoreConfig, PluginHost]:
    """Read ``config`` (a TOML path or a dict), build its plugin host (built-ins,
    ``store_builtins``, entry points, ``[store] plugins``, then ``plugins``) and validate the
    whole config against it. Writes nothing; raises ConfigError / PluginError."""
    data, source = load_source(config)
    store_table = validate_store_table(data.get("store", {}), source)
    host = build_plugin_host(store_table["plugins"], f"[store] plugins in {source.name}",
                             tuple(plugins), store_builtins)
    return validate_config(data, source, host, store_table), host


# A location is a URL when it starts with a protocol (possibly chained, ``simplecache::s3://``);
# anything else is a local path.
_URL = re.compile(r"^((?:[A-Za-z][A-Za-z0-9+.\-]*::)*[A-Za-z][A-Za-z0-9+.\-]*)://(.*)$", re.S)
_LOCAL_PROTOCOLS = ("file", "local")
_PROTOCOL_ALIASES = {"s3a": "s3", "gcs": "gs"}


def _place(location: str) -> tuple[str, tuple[str, ...]]:
    """The place ``location`` names, as (protocol, path components): a local path (or a
    ``file://`` URL) as the OS resolves it (``~``, ``..``, symlinks), a URL by its protocol and
    normalized path."""
    match = _URL.match(location)
    protocol = match.group(1).split("::")[-1].lower() if match else "file"
    if protocol in _LOCAL_PROTOCOLS:
        path = match.group(2) if match else location
        real = os.path.realpath(os.path.expanduser(path))
        return "file", tuple(p for p in real.split(os.sep) if p)
    protocol = _PROTOCOL_ALIASES.get(protocol, protocol)
    path = posixpath.normpath("/" + match.group(2))
    return protocol, tuple(p for p in path.split("/") if p)


def _shown(place: tuple[str, tuple[str, ...]]) -> str:
    protocol, parts = place
    return "/" + "/".join(parts) if protocol == "file" else f"{protocol}://{'/'.join(parts)}"


def _relation(a: tuple[str, tuple[str, ...]], b: tuple[str, tuple[str, ...]]) -> str | None:
    """How place ``a`` lies to place ``b``: the same, inside, containing, or None (apart)."""
    if a[0] != b[0]:
        return None
    n = min(len(a[1]), len(b[1]))
    if a[1][:n] != b[1][:n]:
        return None
    if len(a[1]) == len(b[1]):
        return "is the same place as"
    return "is inside" if len(a[1]) > len(b[1]) else "contains"


def check_tier_locations(config: StoreConfig, host: PluginHost, ctx: RankContext) -> None:
    """Refuse two tiers whose locations, as this process expands them, are the same place or one
    inside the other. Each tier lists, keeps and deletes the checkpoints under its own root, so
    two such tiers would count and delete each other's checkpoints. Writes nothing."""
    source = config.source

    def described(tc: TierConfig, key: str, place: tuple[str, tuple[str, ...]]) -> str:
        value = tc.backend_options[key]
        # The resolved form is left out where it could show a value read from the environment.
        resolved = "" if source.from_env(value) else f" (here {_shown(place)})"
        return f"{key} {source.quote(value)}{resolved} of tier '{tc.name}' (tier[{tc.index}])"

    seen: list[tuple[TierConfig, str, tuple[str, tuple[str, ...]]]] = []
    for tc in config.tiers:
        reg = host.lookup("backend", tc.backend)
        key = next((o.name for o in (reg.options if reg else ())
                    if o.expand and isinstance(tc.backend_options.get(o.name), str)), None)
        if key is None:
            continue
        place = _place(expand_placeholders(tc.backend_options[key], ctx))
        for other, other_key, other_place in seen:
            relation = _relation(place, other_place)
            if relation is None:
                continue
            raise ConfigError(
                f"{source.where('tier', tc.index, key)}: tiers '{other.name}' and '{tc.name}' "
                f"overlap: {described(tc, key, place)} {relation} "
                f"{described(other, other_key, other_place)}. Each tier keeps and deletes the "
                f"checkpoints under its own directory, so they would count and delete each "
                f"other's; give each tier a directory of its own, side by side (e.g. .../ram "
                f"and .../nvme), neither inside the other"
            )
        seen.append((tc, key, place))
