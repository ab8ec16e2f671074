"""Reading a store's signing keys from its config: ``[store] signing_key`` / ``signing_keys``.

A key is given by where to find it, never by its value: ``{ env = "NAME" }`` (an environment
variable) or ``{ file = "/path" }`` (a file read whole; one trailing newline is dropped, as
``echo`` and editors add one). A value in the TOML itself would put the secret in every copy
of the config, so it is refused. A key file must be private to its owner (the user, or root),
as ssh requires of a private key. Messages name the variable or file, never the secret, nor
a name or path that reads like a key pasted in its place.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from tierstore.errors import ConfigError
from tierstore.format.signing import MIN_SECRET_BYTES, Keyring, SigningKey
from tierstore.plugin.options import ConfigSource, shown_variable

__all__ = ["keyring_from", "check_key_reference"]

_HOW = ('write signing_key = { env = "TIERSTORE_KEY" } (an environment variable) or '
        'signing_key = { file = "/path/to/key" }, holding at least 16 random bytes, e.g. '
        '`openssl rand -hex 32`')


def check_key_reference(value: Any) -> str | None:
    """What is wrong with one key reference (a table with exactly ``env`` or ``file``)."""
    if isinstance(value, str):
        return ("the key itself must not be written in the config (every copy of the file "
                "would hold it); " + _HOW)
    if not isinstance(value, dict) or len(value) != 1 or not (
            isinstance(value.get("env"), str) or isinstance(value.get("file"), str)):
        return "must be a table with one key, 'env' or 'file'; " + _HOW
    return None


def _read_secret(ref: dict[str, str], where: str) -> bytes:
    if "env" in ref:
        name = ref["env"]
        secret = os.environ.get(name)
        if secret is None:
            if shown_variable(name, secret=True) == repr(name):
                which = f"${name} named for the signing key"
            else:
                which = (f"named in 'env' for the signing key ({len(name)} characters, not "
                         f"shown: they do not read like a variable's NAME and may be the key "
                         f"itself)")
            raise ConfigError(f"{where}: the environment variable {which} is not set; 'env' "
                              f"takes the name of a variable that holds the key, never the "
                              f"key itself: export it in the job's environment (every rank, "
                              f"and DCP's checkpoint process, read it)")
        data = secret.encode()
        origin = f"${name}"
    else:
        path = ref["file"]
        try:
            with open(path, "rb") as f:
                _check_private(os.fstat(f.fileno()), path, where)
                data = f.read()
        except OSError as exc:
            raise ConfigError(f"{where}: the signing key file {_shown_file(path)} cannot be "
                              f"read ({exc.strerror or exc}); point 'file' at a readable key "
                              f"file") from None
        data = data[:-1] if data.endswith(b"\n") else data
        origin = f"the file {path!r}"
    if len(data) < MIN_SECRET_BYTES:
        raise ConfigError(f"{where}: the signing key in {origin} is {len(data)} bytes long; a "
                          f"key needs at least {MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)")
    return data


def _shown_file(path: str) -> str:
    """``'path'`` for a message when it reads like a path; a key pasted where the path belongs
    (no directory, no dot, long) is not shown."""
    if "/" in path or "." in path or len(path) < MIN_SECRET_BYTES:
        return repr(path)
    return (f"named in 'file' (its {len(path)} characters are not shown: they do not read like "
            f"a path and may be the key itself)")


def _check_private(st: os.stat_result, path: str, where: str) -> None:
    """Refuse a key file others could read or replace, as ssh refuses such a private key: a
    key anyone on the machine can read signs nothing only the job could have written."""
    mode = stat.S_IMODE(st.st_mode)
    owners = {os.getuid(), 0}  # root's own files are as safe as the user's
    if mode & 0o077:
        raise ConfigError(
            f"{where}: the signing key file {path!r} has mode {mode:04o}, so users other than "
            f"its owner can read or change it; make it private with `chmod 600 {path}`")
    if st.st_uid not in owners:
        raise ConfigError(
            f"{where}: the signing key file {path!r} is owned by user id {st.st_uid}, not by "
            f"this user ({os.getuid()}) or root, and its owner can read or replace the key; "
            f"copy the key into a file of your own and `chmod 600` it")


def keyring_from(store_table: dict[str, Any], source: ConfigSource) -> Keyring:
    """The keyring of a validated ``[store]`` table: ``signing_key`` (one key) or
    ``signing_keys`` (the first signs, every one verifies), and ``accept_unsigned``."""
    one, many = store_table["signing_key"], store_table["signing_keys"]
    if one is not None and many:
        raise ConfigError(f"{source.where('store', None, 'signing_keys')}: [store] sets both "
                          f"'signing_key' and 'signing_keys'; keep one (signing_keys lists "
                          f"several keys for rotation, the first one signing)")
    refs = [one] if one is not None else list(many)
    keys: list[SigningKey] = []
    for n, ref in enumerate(refs):
        key_name = "signing_key" if one is not None else f"signing_keys[{n}]"
        where = f"{source.where('store', None, key_name.split('[')[0])}: [store] {key_name}"
        key = SigningKey.from_secret(_read_secret(ref, where))
        if key.key_id not in (k.key_id for k in keys):
            keys.append(key)
    return Keyring(tuple(keys), accept_unsigned=store_table["accept_unsigned"])
