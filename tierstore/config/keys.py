"""Reading a store's signing keys from its config: ``[store] signing_key`` / ``signing_keys``.

A key is given by where to find it, never by its value: ``{ env = "NAME" }`` (an environment
variable) or ``{ file = "/path" }`` (a file read whole; one trailing newline is dropped, as
``echo`` and editors add one). A value in the TOML itself would put the secret in every copy
of the config, so it is refused. Messages name the variable or file, never the secret.
"""

from __future__ import annotations

import os
from typing import Any

from tierstore.errors import ConfigError
from tierstore.format.signing import MIN_SECRET_BYTES, Keyring, SigningKey
from tierstore.plugin.options import ConfigSource

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
            raise ConfigError(f"{where}: the environment variable ${name} named for the signing "
                              f"key is not set; export it in the job's environment (every "
                              f"rank, and DCP's checkpoint process, read it)")
        data = secret.encode()
        origin = f"${name}"
    else:
        path = ref["file"]
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise ConfigError(f"{where}: the signing key file {path!r} cannot be read "
                              f"({exc.strerror or exc}); point 'file' at a readable key "
                              f"file") from None
        data = data[:-1] if data.endswith(b"\n") else data
        origin = f"the file {path!r}"
    if len(data) < MIN_SECRET_BYTES:
        raise ConfigError(f"{where}: the signing key in {origin} is {len(data)} bytes long; a "
                          f"key needs at least {MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)")
    return data


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
