"""Messages between ranks: plain data in a typed encoding that never names a class.

The store's own exchanges (replication headers, drains' part lists, what one rank listed for
the others) travel as these messages, never as pickles: a rank that decodes another's message
builds lists, tuples, dicts, strings, numbers and bytes, nothing that could run code.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from tierstore.errors import TierstoreError

__all__ = ["MESSAGE_VERSION", "MessageError", "decode_message", "encode_message"]

# A message is one version byte, then JSON. JSON arrays are lists, numbers, strings, true, false
# and null are themselves; every JSON object is one tagged value: {"t": [...]} a tuple,
# {"d": {...}} a dict with str keys, {"m": [[key, value], ...]} any other dict, {"b": "base64"}
# bytes. Decoding builds nothing else: a message never names a class (senders of records turn
# them into their fields, as replication does with manifest entries).

#: the encoding's version, the first byte of every message; ranks of one job run one version
MESSAGE_VERSION = 1


class MessageError(TierstoreError, ValueError):
    """A message from another rank could not be read: another encoding version (ranks running
    different tierstore versions), malformed bytes, or a value that may not travel."""


def encode_message(obj: Any) -> bytes:
    """``obj`` as a message: None, bools, ints, floats, str, bytes, lists, tuples and dicts,
    nested. Raises TypeError for anything else (it would not decode)."""
    return bytes([MESSAGE_VERSION]) + json.dumps(_plain(obj), separators=(",", ":")).encode()


def decode_message(raw: bytes, sender: str = "another rank") -> Any:
    """The object :func:`encode_message` made ``raw`` from. Raises :class:`MessageError`
    naming ``sender`` when ``raw`` is of another version or not such a message."""
    if raw[:1] != bytes([MESSAGE_VERSION]):
        got = f"a message of encoding version {raw[0]}" if raw else "an empty message"
        raise MessageError(f"{sender} sent {got}; this process reads version {MESSAGE_VERSION} "
                           f"only: every rank of a job must run the same tierstore")
    try:
        return _value(json.loads(raw[1:].decode()))
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise MessageError(f"{sender} sent a malformed message ({type(exc).__name__}: "
                           f"{str(exc)[:200]}); every rank of a job must run the same "
                           f"tierstore") from None


def _plain(obj: Any) -> Any:
    """``obj`` as JSON values, tagged as the encoding says."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return {"t": [_plain(v) for v in obj]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {"d": {k: _plain(v) for k, v in obj.items()}}
        return {"m": [[_plain(k), _plain(v)] for k, v in obj.items()]}
    if isinstance(obj, (bytes, bytearray)):
        return {"b": base64.b64encode(obj).decode()}
    name = f"{type(obj).__module__}.{type(obj).__qualname__}"
    raise TypeError(f"{name} cannot travel between ranks (plain data only: send a record's "
                    f"fields)")


def _value(node: Any) -> Any:
    """The object a JSON value of a message stands for; ValueError when it is not one."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_value(v) for v in node]
    if not isinstance(node, dict) or len(node) != 1:
        raise ValueError(f"not a tagged value: {str(node)[:80]}")
    tag, body = next(iter(node.items()))
    if tag == "t" and isinstance(body, list):
        return tuple(_value(v) for v in body)
    if tag == "d" and isinstance(body, dict):
        return {k: _value(v) for k, v in body.items()}
    if tag == "m" and isinstance(body, list) and all(
            isinstance(p, list) and len(p) == 2 for p in body):
        return {_value(k): _value(v) for k, v in body}
    if tag == "b" and isinstance(body, str):
        return base64.b64decode(body, validate=True)
    raise ValueError(f"unknown or malformed tag {str(tag)[:40]!r}")
