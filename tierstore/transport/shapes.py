"""Reading a message from another rank back into what its exchange expects.

A message (:mod:`tierstore.transport.messages`) holds plain data only, but plain data of any
shape: a rank that sends a dict where the exchange expects a list must meet an error that says
so, not an ``AttributeError`` three calls later. Each exchange reads what every rank sent with a
function built of these checks (passed as ``read`` to the collectives); a check that fails raises
``TypeError`` with what was expected and what came, and the collective turns it into a
:class:`~tierstore.transport.messages.MessageError` naming the rank that sent it.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

__all__ = ["as_bool", "as_dict", "as_int", "as_list", "as_str", "as_tuple", "optional"]

T = TypeVar("T")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _wrong(what: str, value: Any) -> TypeError:
    return TypeError(f"expected {what}, got {type(value).__name__} {_short(value)}")


def as_int(value: Any, low: int | None = None) -> int:
    """``value`` when it is an integer (not a bool) of at least ``low``."""
    if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
        raise _wrong("an integer" + (f" >= {low}" if low is not None else ""), value)
    return value


def as_str(value: Any) -> str:
    """``value`` when it is a string."""
    if not isinstance(value, str):
        raise _wrong("a string", value)
    return value


def as_bool(value: Any) -> bool:
    """``value`` when it is a bool."""
    if not isinstance(value, bool):
        raise _wrong("true or false", value)
    return value


def optional(read: Callable[[Any], T]) -> Callable[[Any], T | None]:
    """``read``, letting None through."""
    return lambda value: None if value is None else read(value)


def as_list(value: Any, item: Callable[[Any], T]) -> list[T]:
    """``value`` when it is a list (or tuple), each element read with ``item``."""
    if not isinstance(value, (list, tuple)):
        raise _wrong("a list", value)
    return [item(v) for v in value]


def as_tuple(value: Any, *items: Callable[[Any], Any]) -> tuple:
    """``value`` when it is a sequence of ``len(items)`` elements, each read with its own."""
    if not isinstance(value, (list, tuple)) or len(value) != len(items):
        raise _wrong(f"a sequence of {len(items)}", value)
    return tuple(read(v) for read, v in zip(items, value))


def as_dict(value: Any, key: Callable[[Any], Any], val: Callable[[Any], T]) -> dict[Any, T]:
    """``value`` when it is a dict, keys read with ``key`` and values with ``val``."""
    if not isinstance(value, dict):
        raise _wrong("a mapping", value)
    return {key(k): val(v) for k, v in value.items()}
