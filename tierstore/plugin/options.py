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
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from tierstore.errors import ConfigError

__all__ = ["Option", "ConfigSource", "resolve_env", "with_article", "shown_variable"]

_MISSING = object()

#: what stands in a message for a value read from the environment
_MASK = "***"
#: what an environment variable's name looks like (POSIX: upper-case letters, digits, '_')
_VARIABLE = re.compile(r"[A-Z_][A-Z0-9_]{0,127}")
#: ...unless it is a long run of upper-case hex digits: more likely a key than a name
_HEXISH = re.compile(r"(?=.*[0-9])[0-9A-F]{16,}")
_TYPE_WORDS = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
               dict: "table"}


def with_article(words: str) -> str:
    """``words`` after "a" or "an", as English says it ("an array", "a table")."""
    return ("an " if words[:1].lower() in "aeiou" and words[:1] else "a ") + words


def shown_variable(name: str, secret: bool) -> str:
    """How a message names the environment variable ``name``: ``'NAME'``, except for a
    ``secret`` key where ``name`` does not read like a variable's name (the secret itself,
    pasted where the name belongs), which is not shown."""
    if not secret or (_VARIABLE.fullmatch(name) and not _HEXISH.fullmatch(name)):
        return repr(name)
    return (f"(its name, {len(name)} characters, not shown: it does not read like a "
            f"variable's NAME and may be the secret itself)")


@dataclass(frozen=True)
class Option:
    """One config key: its name, accepted type(s), default and a description for error messages.

    ``type`` is a type or a tuple of types (``int`` does not accept ``bool``). ``choices`` restricts
    the value to a fixed set; ``check`` is a callable returning an error text or None. A value
    read from the environment is replaced by ``***`` wherever it appears whole in that text, so a
    check should describe the problem without quoting parts of the value.

    ``expand`` marks a location (a path or URL): besides the placeholders, the core refuses an
    empty or blank location and a NUL character in it before ``check`` runs.

    ``secret`` marks a key whose value is or may hold a secret (a signing key, credentials):
    no message about it quotes its value, nor the name of a variable it reads that does not
    read like one (a secret pasted where the name belongs); they say what is wrong and what
    the key takes instead.
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
    #: whether {env = "NAME"} tables in the value are read from the environment (off for the
    #: top-level 'store' and 'tier', whose own keys read theirs, each at its own line)
    read_env: bool = True
    #: how messages name the accepted values, where the types alone would mislead (a tier's
    #: ``every`` takes a number of steps or the one string "auto")
    type_label: str | None = None
    #: the value is, or holds, a secret: never quoted in a message
    secret: bool = False

    def type_name(self) -> str:
        """How messages name the values this key takes ("integer", "string or table")."""
        if self.type_label:
            return self.type_label
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
    #: every value read from the environment ({env = "NAME"}) -> the variable's name, so that
    #: messages can mask it; kept out of repr so that printing a config shows none of them
    env_values: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def line_of(self, table: str | None, index: int | None, key: str | None) -> int | None:
        """Line (1-based) of ``key`` inside ``[table]`` or the ``index``-th ``[[table]]``."""
        if self.text is None:
            return None
        lines = self.text.split("\n")  # as TOML counts lines: "\u2028" in a string is no break
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

    def env_name(self, value: Any) -> str | None:
        """The environment variable ``value`` was read from, or None."""
        return self.env_values.get(value) if isinstance(value, str) else None

    def from_env(self, value: Any) -> bool:
        """Whether ``value`` is, or holds at any depth, a value read from the environment."""
        if isinstance(value, str):
            return value in self.env_values
        if isinstance(value, dict):
            return any(self.from_env(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return any(self.from_env(v) for v in value)
        return False

    def quote(self, value: Any) -> str:
        """``repr(value)`` for a message, every value read from the environment masked as
        ``***`` and named by its variable. Every message that shows a config value goes
        through here (or :meth:`redact` for text a plugin wrote), never through ``repr``."""
        name = self.env_name(value)
        if name is not None:
            return f"{_MASK} (the value of ${name}, not shown)"
        names: list[str] = []
        text = repr(_masked(value, self.env_values, names))
        if names:
            variables = ", ".join("$" + n for n in dict.fromkeys(names))
            text += f" ({_MASK}: the value of {variables}, not shown)"
        return text

    def redact(self, text: str) -> str:
        """``text`` with every value read from the environment replaced by ``***``."""
        # Longest first, so that a value containing another one is replaced whole.
        for value in sorted(self.env_values, key=len, reverse=True):
            if value:
                text = text.replace(repr(value), _MASK).replace(value, _MASK)
        return text


class _Masked:
    """Stands in for a value read from the environment inside a quoted container."""

    def __repr__(self) -> str:
        return _MASK


def _masked(value: Any, env_values: dict[str, str], names: list[str]) -> Any:
    if isinstance(value, str) and value in env_values:
        names.append(env_values[value])
        return _Masked()
    if isinstance(value, dict):
        return {k: _masked(v, env_values, names) for k, v in value.items()}
    if isinstance(value, list):
        return [_masked(v, env_values, names) for v in value]
    if isinstance(value, tuple):
        return tuple(_masked(v, env_values, names) for v in value)
    return value


def resolve_env(value: Any, where: str, key: str, source: ConfigSource | None = None,
                secret: bool = False) -> Any:
    """Replace ``{env = "NAME"}`` tables (at any depth) with the environment variable's value.

    With ``source``, each value read is recorded there, so that messages mask it. ``secret``:
    the key holds secrets (see :class:`Option`), so its messages quote no value."""
    if isinstance(value, dict):
        if set(value) == {"env"}:
            name = value["env"]
            if not isinstance(name, str) or not name:
                shown = "" if secret else f" {name!r}"
                raise ConfigError(
                    f"{where}: key '{key}': {{ env = ... }} takes the name of an environment "
                    f"variable as a string, got {type(name).__name__}{shown}; write "
                    f"{{ env = \"NAME\" }}"
                )
            if name not in os.environ:
                shown = shown_variable(name, secret)
                export = f"export {name}=..." if shown == repr(name) else "export it"
                raise ConfigError(
                    f"{where}: key '{key}' reads environment variable {shown}, which is not set; "
                    f"{export} before starting the job, or write the value in the config"
                )
            if source is not None:
                source.env_values[os.environ[name]] = name
            return os.environ[name]
        return {k: resolve_env(v, where, f"{key}.{k}", source, secret)
                for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_env(v, where, key, source, secret) for v in value]
    return value


def _without_values(text: str, value: Any) -> str:
    """``text`` with every string held in ``value`` (at any depth, 8 characters or more: a
    shorter one is no secret and would garble the text) replaced by ``***``: a check's text
    about a secret key must not quote what was written."""
    leaves: list[str] = []

    def collect(v: Any) -> None:
        if isinstance(v, str):
            leaves.append(v)
        elif isinstance(v, dict):
            for item in v.values():
                collect(item)
        elif isinstance(v, (list, tuple)):
            for item in v:
                collect(item)

    collect(value)
    for leaf in sorted(leaves, key=len, reverse=True):
        if len(leaf) >= 8:
            text = text.replace(repr(leaf), _MASK).replace(leaf, _MASK)
    return text


def _location_problem(value: str) -> str | None:
    """What makes ``value`` unusable as any tier's path or URL (empty, blank, a NUL
    character), or None. Said without quoting the value."""
    if not value:
        return "is empty, which would put checkpoints in the current directory"
    if not value.strip():
        return "is only whitespace, which would name a directory of blanks nobody meant"
    if "\0" in value:
        return (f"contains a NUL character (at position {value.index(chr(0))}), which no path "
                f"or URL may hold (a \\u0000 escape in TOML, or a stray byte in the variable)")
    return None


def _type_ok(value: Any, expected: type | tuple[type, ...]) -> bool:
    types = expected if isinstance(expected, tuple) else (expected,)
    if isinstance(value, bool):
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    return isinstance(value, types)


def _type_hint(opt: Option, value: Any, source: ConfigSource) -> str:
    """What to write instead of a value of the wrong type."""
    types = opt.type if isinstance(opt.type, tuple) else (opt.type,)
    example = f"<{opt.type_name()}>"
    env = source.env_name(value)
    if env is not None:
        if dict in types:
            return (f"An environment variable holds a string, not a table: read single "
                    f"entries from the environment instead, e.g. "
                    f"{opt.name} = {{ some_key = {{ env = \"{env}\" }} }}.")
        return (f"An environment variable holds a string: write {opt.name} = {example} in the "
                f"config instead of reading ${env}.")
    if isinstance(value, bool) and (int in types or float in types):
        return f"true and false are booleans, not numbers: write {opt.name} = {example}."
    if isinstance(value, str) and str not in types:
        unquoted = value.strip()
        if unquoted in ("true", "false") and bool in types:
            return f"Write it without quotes: {opt.name} = {unquoted}."
        for t in (int, float):
            if t in types or (t is int and float in types):
                try:
                    t(unquoted)
                except ValueError:
                    continue
                if unquoted and unquoted.lower().lstrip("+-") not in ("nan", "inf", "infinity"):
                    return f"Write the number without quotes: {opt.name} = {unquoted}."
    return f"Write {opt.name} = {example}."


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
        value = (resolve_env(table[opt.name], where, opt.name, source, opt.secret)
                 if opt.read_env else table[opt.name])
        # (a value read from the environment is quoted as "***" below: the general message,
        # with its hint on reading single entries, shows nothing of it)
        if not _type_ok(value, opt.type) and opt.secret and source.env_name(value) is None:
            got = with_article(_TYPE_WORDS.get(type(value), type(value).__name__))
            desc = f" ({opt.description})" if opt.description else ""
            raise ConfigError(
                f"{where}: {owner}: key '{opt.name}' must be {with_article(opt.type_name())}, "
                f"got {got} (not shown: '{opt.name}' holds secrets). "
                f"Write {opt.name} = <{opt.type_name()}>{desc}."
            )
        if not _type_ok(value, opt.type):
            raise ConfigError(
                f"{where}: {owner}: key '{opt.name}' must be {with_article(opt.type_name())}, "
                f"got {type(value).__name__} {source.quote(value)}. "
                f"{_type_hint(opt, value, source)}"
            )
        if isinstance(value, float) and math.isnan(value):
            raise ConfigError(
                f"{where}: {owner}: key '{opt.name}' is nan, which is no number; write a "
                f"{opt.type_name()} ({opt.description or 'see docs/configuration.md'})."
            )
        if opt.choices is not None and value not in opt.choices:
            shown = "not one of its values" if opt.secret else source.quote(value)
            raise ConfigError(
                f"{where}: {owner}: key '{opt.name}' is {shown}; valid values: "
                f"{', '.join(map(repr, opt.choices))}."
            )
        if opt.expand and isinstance(value, str):
            problem = _location_problem(value)
            if problem:
                desc = f": {opt.description}" if opt.description else ""
                shown = "" if opt.secret else f" = {source.quote(value)}"
                raise ConfigError(
                    f"{where}: {owner}: key '{opt.name}'{shown} {problem}; "
                    f"give '{opt.name}' the tier's own location{desc}."
                )
        if opt.check is not None:
            problem = opt.check(value)
            if problem:
                if source.from_env(value):
                    problem = source.redact(problem)
                if opt.secret:
                    problem = _without_values(problem, value)
                raise ConfigError(f"{where}: {owner}: key '{opt.name}': {problem}.")
        out[opt.name] = value
    return out
