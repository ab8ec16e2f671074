"""Config keys that plugins declare, and the checks the core runs on them.

A plugin class lists its keys in ``options``; the core validates a TOML table against that list so
that every plugin gets the same error messages (key, line, valid choices) for free::

    class MyBackend(Backend):
        options = (
            Option("path", str, required=True, description="directory of the tier"),
            Option("fsync", bool, default=True, description="fsync files on commit"),
        )
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from tierstore.errors import ConfigError

__all__ = ["Option", "ConfigSource", "resolve_env"]

_MISSING = object()


@dataclass(frozen=True)
class Option:
    """One config key: its name, accepted type(s), default and a description for error messages.

    ``type`` is a type or a tuple of types (``int`` does not accept ``bool``). ``choices`` restricts
    the value to a fixed set; ``check`` is a callable returning an error text or None.
    """

    name: str
    type: type | tuple[type, ...]
    default: Any = None
    description: str = ""
    required: bool = False
    choices: tuple[Any, ...] | None = None
    check: Callable[[Any], str | None] | None = field(default=None, compare=False)
    #: a path or URL in which {rank}, {local_rank} and {node} are replaced per process
    expand: bool = False

    def type_name(self) -> str:
        types = self.type if isinstance(self.type, tuple) else (self.type,)
        names = {str: "string", int: "integer", float: "number", bool: "boolean",
                 list: "array", dict: "table"}
        return " or ".join(names.get(t, t.__name__) for t in types)


@dataclass
class ConfigSource:
    """Where a config came from, so errors can point at a file and line.

    ``text`` is the TOML source when the config was a file; ``line_of`` finds the line of a key.
    """

    name: str = "<dict>"
    text: str | None = None

    def line_of(self, table: str | None, index: int | None, key: str | None) -> int | None:
        """Line (1-based) of ``key`` inside ``[table]`` or the ``index``-th ``[[table]]``."""
        if self.text is None:
            return None
        lines = self.text.splitlines()
        start = 0
        if table is not None:
            header = f"[[{table}]]" if index is not None else f"[{table}]"
            seen = -1
            start = None
            for i, line in enumerate(lines):
                if line.strip().startswith(header):
                    seen += 1
                    if index is None or seen == index:
                        start = i
                        break
            if start is None:
                return None
            if key is None:
                return start + 1
        for i in range(start + (1 if table is not None else 0), len(lines)):
            stripped = lines[i].strip()
            if stripped.startswith("[") and table is not None:
                break
            if stripped.split("=", 1)[0].strip().strip('"') == key and "=" in stripped:
                return i + 1
        return start + 1 if table is not None else None

    def where(self, table: str | None, index: int | None, key: str | None) -> str:
        """``file:line`` (or just the source name) for an error message."""
        line = self.line_of(table, index, key)
        return f"{self.name}:{line}" if line else self.name


def resolve_env(value: Any, where: str, key: str) -> Any:
    """Replace ``{env = "NAME"}`` tables (at any depth) with the environment variable's value."""
    if isinstance(value, dict):
        if set(value) == {"env"}:
            name = value["env"]
            if not isinstance(name, str) or name not in os.environ:
                raise ConfigError(
                    f"{where}: key '{key}' reads environment variable {name!r}, which is not set; "
                    f"export {name}=... before starting the job, or write the value in the config"
                )
            return os.environ[name]
        return {k: resolve_env(v, where, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_env(v, where, key) for v in value]
    return value


def _type_ok(value: Any, expected: type | tuple[type, ...]) -> bool:
    types = expected if isinstance(expected, tuple) else (expected,)
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def validate_table(
    table: dict[str, Any],
    options: tuple[Option, ...],
    *,
    owner: str,
    source: ConfigSource,
    table_name: str | None,
    index: int | None,
) -> dict[str, Any]:
    """Check ``table`` against ``options``; return it with defaults filled in.

    ``owner`` names the thing being configured in messages (``tier 'nvme' (backend local)``).
    Unknown keys, missing required keys, wrong types and bad choices are ``ConfigError``s.
    """
    by_name = {o.name: o for o in options}
    for key in table:
        if key not in by_name:
            hint = difflib.get_close_matches(key, list(by_name), n=1)
            did_you_mean = f" Did you mean '{hint[0]}'?" if hint else ""
            raise ConfigError(
                f"{source.where(table_name, index, key)}: {owner}: unknown key '{key}'.{did_you_mean} "
                f"Valid keys: {', '.join(sorted(by_name))}."
            )
    out: dict[str, Any] = {}
    for opt in options:
        where = source.where(table_name, index, opt.name)
        if opt.name not in table:
            if opt.required:
                desc = f" ({opt.description})" if opt.description else ""
                raise ConfigError(
                    f"{source.where(table_name, index, None)}: {owner}: missing required key "
                    f"'{opt.name}'{desc}; add {opt.name} = <{opt.type_name()}>."
                )
            out[opt.name] = opt.default
            continue
        value = resolve_env(table[opt.name], where, opt.name)
        if not _type_ok(value, opt.type):
            raise ConfigError(
                f"{where}: {owner}: key '{opt.name}' must be a {opt.type_name()}, "
                f"got {type(value).__name__} {value!r}."
            )
        if opt.choices is not None and value not in opt.choices:
            raise ConfigError(
                f"{where}: {owner}: key '{opt.name}' is {value!r}; valid values: "
                f"{', '.join(map(repr, opt.choices))}."
            )
        if opt.check is not None:
            problem = opt.check(value)
            if problem:
                raise ConfigError(f"{where}: {owner}: key '{opt.name}': {problem}.")
        out[opt.name] = value
    return out
