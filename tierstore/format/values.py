"""Checking a non-tensor value read from a tier before anything unpickles it.

DCP stores each non-tensor value of a state dict (a step counter, a data loader's state, RNG
states, an ``io.BytesIO``) as a BYTE_IO item: the bytes of ``torch.save(value)``. Its load
planner turns them back into the value with ``torch.load(..., weights_only=False)``, which runs
whatever the pickle asks for. Anyone who can write a tier could thus make a load run code.

:func:`check_value` reads those bytes first, the way ``torch.load`` would (torch's own zip reader,
the same ``data.pkl``), with an unpickler that builds nothing: every global the pickle names is
looked up in an allow-list and replaced by an inert stand-in, so the pickle is walked to its
end without calling anything. It passes only when every global is allowed and the pickle uses
them only as ``weights_only=True`` loads allow: a global is called or instantiated, never
changed itself (BUILD); dict items go only into ``OrderedDict``/``Counter``; persistent ids
are torch storages. Only then are the bytes handed to the planner, whose unpickler then meets
nothing but allowed globals. torch offers no thread-safe way to add globals to its own
``weights_only`` unpickler (``add_safe_globals`` changes the whole process), hence this module.

Allowed by default (:data:`DEFAULT_GLOBALS`): what ``torch.load(weights_only=True)`` allows
(tensors, parameters, storages, dtypes, ``torch.Size``, ``torch.device``, ``OrderedDict``,
``Counter``, ``set``, ``bytearray``, ``complex``, plain containers and numbers need no global),
``io.BytesIO`` (DCP pickles a BytesIO value like any other), ``bytes()`` (how protocol 2
writes ``b""``), and numpy arrays, dtypes and scalars (``np.random.get_state()``). Python's
``random.getstate()`` is plain tuples and ints.
``[store] trusted_pickles = ["module.Name"]`` adds globals; modules that run programs or
change the interpreter (:data:`BLOCKED_MODULES`) can never be added.

numpy's globals are checked by what they are given, not only by name: a dtype's pickled state
decides how numpy reads an array's memory (state that gives an object field flags claiming it
holds no objects turns eight bytes of the file into a pointer), so a value may build only plain
dtypes (kinds ``b i u f c S U M m`` and ``V`` without fields), each from exactly the state numpy
itself writes for it; arrays and scalars only of such dtypes, with as many bytes as they need.

Bytes that are not a ``torch.save`` archive (a planner may write a BytesIO's raw bytes) pass
unchanged when ``torch.load`` would give up on them before calling anything: their leading
pickle, if any, names no global and is not the legacy ``torch.save`` header.
"""

from __future__ import annotations

import _compat_pickle
import functools
import io
import pickle
import re
import tarfile
from typing import Any, Iterable

from tierstore.errors import IntegrityError

__all__ = ["UntrustedValue", "check_value", "check_trusted_names", "DEFAULT_GLOBALS",
           "BLOCKED_MODULES"]

#: modules whose globals are never allowed, even when trusted (torch's weights_only list)
BLOCKED_MODULES = frozenset({"sys", "os", "posix", "nt"})

_NUMPY_ARRAYS = ("numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct")
_NUMPY_SCALARS = ("numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar")


@functools.cache
def _defaults() -> dict[str, bool]:
    """Allowed global -> whether what calling it returns may be BUILT (given state): classes'
    instances and rebuilt tensors and arrays may, the results of plain functions
    (``_codecs.encode``, ``_get_layout``) and dtypes may not, as with weights_only. Made on
    first use from torch's own list: validating a config (``check_trusted_names``) imports
    this module, and a process that only reads manifests (``tierstore ls``) needs no torch,
    whose import takes seconds."""
    from torch._weights_only_unpickler import _get_allowed_globals, _tensor_rebuild_functions

    rebuilds = {f"torch._utils.{f.__name__}" for f in _tensor_rebuild_functions()}
    rebuilds.add("torch._tensor._rebuild_from_type_v2")
    out = {name: isinstance(value, type) or name in rebuilds
           for name, value in _get_allowed_globals().items()}
    out.update({"_io.BytesIO": True, "numpy.ndarray": True, "numpy.dtype": True,
                "builtins.bytes": False})
    out.update({name: True for name in _NUMPY_ARRAYS})
    out.update({name: False for name in _NUMPY_SCALARS})
    return out


#: the globals a value from a tier may name without ``trusted_pickles`` ("module.Name"): made
#: from torch's list when first asked for (see _defaults), by the module's ``__getattr__``
DEFAULT_GLOBALS: frozenset[str]


def __getattr__(name: str) -> Any:
    if name == "DEFAULT_GLOBALS":
        return frozenset(_defaults())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: dict-like defaults a pickle may add items to (SETITEM), as weights_only allows
_DICTS = frozenset({"collections.OrderedDict", "collections.Counter"})
#: Python 2 modules that pickle's fix_imports maps and Python 3 does not have
_PY2_ONLY = frozenset({"__builtin__"})
_ZIP = b"PK\x03\x04"  # torch.load's own test for its zip format (serialization._is_zipfile)


class UntrustedValue(IntegrityError):
    """A non-tensor value read from a tier would build a global that is not allowed (or is not a
    pickle tierstore loads); nothing of it was unpickled. ``key`` is its state-dict key,
    ``global_name`` the refused global ("module.Name"), when one was."""

    def __init__(self, message: str, key: str, global_name: str | None = None):
        super().__init__(message)
        self.key = key
        self.global_name = global_name


def check_trusted_names(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` (``[store] trusted_pickles``) as a tuple, or ValueError naming the first that
    is not ``module.Name`` or is in a module that can never be trusted."""
    out = []
    for name in names:
        parts = name.split(".") if isinstance(name, str) else []
        if len(parts) < 2 or not all(p.isidentifier() for p in parts):
            raise ValueError(f"trusted_pickles: {name!r} is not a global's full name "
                             f"(\"module.Name\", e.g. \"mypackage.state.LoaderState\")")
        if parts[0] in BLOCKED_MODULES:
            raise ValueError(f"trusted_pickles: {name!r} cannot be trusted: globals of "
                             f"{', '.join(sorted(BLOCKED_MODULES))} run programs or change the "
                             f"interpreter")
        out.append(name)
    return tuple(out)


def check_value(data: bytes | bytearray | memoryview, key: str,
                trusted: tuple[str, ...] = ()) -> None:
    """Raise :class:`UntrustedValue` (naming ``key``, the value's state-dict key) unless
    ``torch.load(data, weights_only=False)`` would build only allowed globals
    (:data:`DEFAULT_GLOBALS` and ``trusted``), used as ``weights_only`` allows. Nothing in
    ``data`` is called or built; safe on any bytes, from any thread."""
    policy = _policy(tuple(trusted))
    stream = io.BytesIO(data)
    if bytes(data[:4]) == _ZIP:
        _check_archive(stream, key, policy)
    else:
        _check_other(stream, key, policy)


# -- the policy and its stand-ins ----------------------------------------------------------------

class _Refused(pickle.UnpicklingError):
    """The pickle asks for something that is not allowed (``global_name``: a global)."""

    def __init__(self, message: str, global_name: str | None = None):
        super().__init__(message)
        self.global_name = global_name


class _StandInType(type):
    """Metaclass of the stand-ins: a pickle's BUILD on a global itself (which would change a
    class or function the whole process shares) is refused."""

    @property
    def __setstate__(cls):  # a data descriptor: found before any attribute of the class
        raise _Refused(f"its pickle sets attributes on the global {cls.name} itself")


class _StandIn(metaclass=_StandInType):
    """Stands in for an allowed global; its instances for what calling the global returns.
    Neither does anything but say whether the pickle may go on."""

    name = ""
    #: instances may be given state (BUILD)
    builds = False
    #: instances take dict items (SETITEM) and list items (APPEND): trusted globals, dicts
    takes_items = False
    takes_appends = False

    def __new__(cls, *args: Any, **kwargs: Any) -> "_StandIn":
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        if not self.builds:
            raise _Refused(f"its pickle gives state to what {self.name} returned")

    def __setitem__(self, key: Any, value: Any) -> None:
        if not self.takes_items:
            raise _Refused(f"its pickle adds items to what {self.name} returned")

    def append(self, item: Any) -> None:
        """APPEND on an instance: only for trusted globals."""
        if not self.takes_appends:
            raise _Refused(f"its pickle appends to what {self.name} returned")

    def extend(self, items: Any) -> None:
        """APPENDS on an instance: only for trusted globals."""
        self.append(items)

    def add(self, item: Any) -> None:
        """ADDITEMS on an instance: only for trusted globals."""
        self.append(item)


class _Storage:
    """What a torch storage (a persistent id) stands for in the check."""


# -- numpy: globals checked by what they are given -----------------------------------------------

#: dtype names as numpy pickles a plain dtype (kind and item size: 'f8', 'U5', 'b1', 'M8')
_PLAIN_DTYPE = re.compile(r"[biufcSUVMm][0-9]{1,10}")
_PLAIN_KINDS = frozenset("biufcSUVMm")
#: datetime64/timedelta64 units numpy writes in a dtype's state
_TIME_UNITS = frozenset({"Y", "M", "W", "D", "h", "m", "s", "ms", "us", "ns", "ps", "fs", "as",
                         "generic"})
_ONLY_PLAIN = ("only plain dtypes (bool, numbers, bytes, str, datetime, void without fields) "
               "are loaded from a tier, since a dtype's state decides how numpy reads an "
               "array's memory")
_LATIN1 = frozenset({"latin1", "latin-1"})


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # the real load cannot build it either
        raise _Refused("it builds a numpy value and numpy is not installed") from None
    return numpy


def _same(got: Any, want: Any) -> bool:
    """``got == want`` with the same types throughout (a pickle's ``1.0`` or ``True`` is not the
    ``1`` numpy wrote); ``got`` comes from the pickle, ``want`` from numpy."""
    if type(got) is not type(want):
        return False
    if isinstance(want, tuple):
        return len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))
    return bool(got == want)


def _describe_dtype_state(state: Any) -> str:
    """Why a dtype's state is not a plain dtype's, in a user's words."""
    if type(state) is not tuple or len(state) < 8:
        return f"state is not numpy's dtype state ({_short(state)})"
    if state[3] is not None or state[4] is not None:
        return f"state makes it a structured dtype, with fields ({_short(state[3])})"
    if state[2] is not None:
        return "state makes it a subarray dtype"
    return f"state is not the one numpy writes for that dtype ({_short(state)})"


class _NumpyDtype(_StandIn):
    """``numpy.dtype(name, align, copy)`` then BUILD with its state, as numpy pickles a dtype:
    only a plain dtype's name, and once only exactly the state numpy writes for it (either
    byte order; a datetime's unit)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "_NumpyDtype":
        np = _numpy()
        name = args[0] if args else None
        if (kwargs or not 1 <= len(args) <= 3 or not isinstance(name, str)
                or not all(type(a) is bool for a in args[1:])):
            raise _Refused(f"it builds a numpy dtype from {_short(args)}, which is not how "
                           f"numpy pickles a dtype; {_ONLY_PLAIN}")
        if name[:1] == "O":
            raise _Refused(f"it builds a numpy object dtype ({name!r}), whose arrays hold "
                           f"Python objects; {_ONLY_PLAIN}")
        try:
            dtype = np.dtype(name) if _PLAIN_DTYPE.fullmatch(name) else None
        except (TypeError, ValueError):
            dtype = None
        if (dtype is None or dtype.kind not in _PLAIN_KINDS or dtype.fields is not None
                or dtype.subdtype is not None or dtype.hasobject):
            raise _Refused(f"it builds a numpy dtype from {_short(name)}, which is not a plain "
                           f"dtype's name as numpy pickles it; {_ONLY_PLAIN}")
        self = object.__new__(cls)
        self.dtype, self.built = dtype, False
        return self

    def __setstate__(self, state: Any) -> None:
        if self.built:  # numpy's own pickles give a dtype its state once
            raise _Refused(f"its pickle gives the numpy dtype {self.dtype.str!r} state twice")
        self.built = True
        base = self.dtype
        if base.kind in "Mm" and type(state) is tuple and len(state) == 9:
            base = self._with_unit(state[8])
        for order in "<>":
            candidate = base.newbyteorder(order)
            if _same(state, candidate.__reduce__()[2]):
                self.dtype = candidate
                return
        raise _Refused(f"it builds a numpy dtype {self.dtype.str!r} whose "
                       f"{_describe_dtype_state(state)}; {_ONLY_PLAIN}")

    def _with_unit(self, meta: Any) -> Any:
        """This datetime dtype with the unit a state's metadata names, when it is one numpy
        writes: ``(None, (unit, count, 1, 1))``."""
        np = _numpy()
        if not (type(meta) is tuple and len(meta) == 2 and meta[0] is None
                and type(meta[1]) is tuple and len(meta[1]) == 4):
            return self.dtype
        unit, count = meta[1][:2]
        if (type(unit) is not bytes or unit.decode("ascii", "replace") not in _TIME_UNITS
                or type(count) is not int or not 1 <= count < 2 ** 31):
            return self.dtype
        text = unit.decode("ascii")
        if text == "generic":
            return self.dtype
        return np.dtype(f"{self.dtype.str}[{count if count > 1 else ''}{text}]")


def _checked_dtype(value: Any, what: str) -> Any:
    """The numpy dtype ``value`` stands for, if the check built it (else refused)."""
    if not isinstance(value, _NumpyDtype):
        raise _Refused(f"it builds a numpy {what} whose dtype is not a plain numpy dtype "
                       f"({_short(value)})")
    return value.dtype


class _NumpyArrayType(_StandIn):
    """``numpy.ndarray``: numpy's pickles name it for ``_reconstruct`` and never call it."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "_NumpyArrayType":
        raise _Refused("its pickle calls numpy.ndarray itself, which numpy's pickles never do "
                       "(an array could be made to read memory it does not own)")


class _NumpyArray(_StandIn):
    """``_reconstruct(numpy.ndarray, (0,), b'b')`` then BUILD with ``(1, shape, dtype,
    fortran, data)``, as numpy pickles an array: a checked dtype and exactly its bytes."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "_NumpyArray":
        if (kwargs or len(args) != 3 or not (isinstance(args[0], type)
                                             and issubclass(args[0], _NumpyArrayType))
                or not _same(args[1], (0,)) or not _same(args[2], b"b")):
            raise _Refused(f"it rebuilds a numpy array from {_short(args)}, which is not how "
                           f"numpy pickles an array")
        self = object.__new__(cls)
        self.built = False
        return self

    def __setstate__(self, state: Any) -> None:
        if self.built:
            raise _Refused("its pickle gives a numpy array state twice")
        self.built = True
        if type(state) is not tuple or len(state) != 5 or not _same(state[0], 1):
            raise _Refused(f"it gives a numpy array the state {_short(state)}, which is not "
                           f"numpy's (version, shape, dtype, fortran, data)")
        _, shape, dtype, fortran, data = state
        dtype = _checked_dtype(dtype, "array")
        if (type(shape) is not tuple or not all(type(n) is int and n >= 0 for n in shape)
                or type(fortran) is not bool or type(data) is not bytes):
            raise _Refused(f"it gives a numpy array the state {_short(state)}, which is not "
                           f"numpy's (version, shape, dtype, fortran, data bytes)")
        count = 1
        for n in shape:
            count *= n
        if len(data) != count * dtype.itemsize:
            raise _Refused(f"it gives a numpy array of shape {shape} and dtype {dtype.str!r} "
                           f"{len(data)} bytes of data, not {count * dtype.itemsize}")


class _NumpyScalar(_StandIn):
    """``scalar(dtype, data)``, as numpy pickles a scalar: a checked dtype and its bytes."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "_NumpyScalar":
        if kwargs or not 1 <= len(args) <= 2:
            raise _Refused(f"it builds a numpy scalar from {_short(args)}, which is not how "
                           f"numpy pickles a scalar")
        dtype = _checked_dtype(args[0], "scalar")
        if len(args) == 2 and not (type(args[1]) is bytes and len(args[1]) == dtype.itemsize):
            raise _Refused(f"it builds a numpy scalar of dtype {dtype.str!r} from "
                           f"{_short(args[1])}, not from its {dtype.itemsize} bytes")
        return object.__new__(cls)


class _EmptyBytes(_StandIn):
    """``bytes()``: how a protocol 2 pickle writes ``b""`` (an empty array's data); any other
    call (``bytes(10**12)``) is refused."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            raise _Refused(f"its pickle calls bytes{_short(args)}, where pickles only ever "
                           f"call bytes() for b''")
        return b""


class _Encode(_StandIn):
    """``_codecs.encode``: protocol 2 pickles (``torch.save``'s) write bytes as
    ``encode(text, 'latin1')``. Those bytes are computed (plain data, nothing runs) so that the
    numpy checks see an array's and a dtype's bytes; any other call stays a stand-in."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if (not kwargs and len(args) == 2 and type(args[0]) is str
                and type(args[1]) is str and args[1] in _LATIN1):
            try:
                return args[0].encode("latin1")
            except UnicodeEncodeError:  # the real call fails the same way
                raise _Refused(f"its pickle encodes {_short(args[0])} as latin1, which it "
                               f"is not") from None
        return object.__new__(cls)


#: globals whose stand-ins check what they are given, whatever ``trusted_pickles`` says
_CHECKED: dict[str, type[_StandIn]] = {
    "numpy.dtype": _NumpyDtype, "numpy.ndarray": _NumpyArrayType, "_codecs.encode": _Encode,
    "builtins.bytes": _EmptyBytes,
    **{name: _NumpyArray for name in _NUMPY_ARRAYS},
    **{name: _NumpyScalar for name in _NUMPY_SCALARS}}


class _Policy:
    """The allowed globals of one ``trusted_pickles`` list, each with its stand-in class."""

    def __init__(self, trusted: tuple[str, ...]):
        self.trusted = frozenset(check_trusted_names(trusted))
        # Shared by every check of this policy, on any thread: nothing a pickle does changes
        # them (BUILD on a global is refused; instances are per check).
        self.stand_ins: dict[str, type[_StandIn]] = {}
        defaults = _defaults()
        for name in {*defaults, *self.trusted}:
            base = _CHECKED.get(name, _StandIn)
            extra = name in self.trusted and base is _StandIn
            self.stand_ins[name] = _StandInType(f"StandIn[{name}]", (base,), {
                "name": name, "builds": extra or defaults.get(name, False),
                "takes_items": extra or name in _DICTS, "takes_appends": extra})


@functools.lru_cache(maxsize=16)
def _policy(trusted: tuple[str, ...]) -> _Policy:
    return _Policy(trusted)


class _Checker(pickle.Unpickler):
    """Walks a pickle with stand-ins for its allowed globals; counts the globals it met."""

    def __init__(self, stream: io.BytesIO, policy: _Policy):
        super().__init__(stream, encoding="utf-8")  # torch.load's default encoding
        self.policy = policy
        self.globals_met = 0

    def find_class(self, module: str, name: str) -> Any:
        self.globals_met += 1
        spelled = _global_name(module, name)
        mapped = _compat_name(module, name)
        # pickle's fix_imports reads a protocol 0-2 pickle's Python 2 names as today's
        # (torch.save writes builtins as __builtin__), a protocol 3+ one's as spelled: each
        # name the real load may resolve must be allowed; a module Python 3 lacks resolves
        # to nothing as spelled.
        names = {mapped} if module in _PY2_ONLY else {(module, name), mapped}
        for mod, attr in names:
            full = f"{mod}.{attr}"
            if _module_of(mod) in BLOCKED_MODULES:
                raise _Refused(f"{spelled} is in a blocked module", spelled)
            # A dotted name reaches attributes of attributes: only when trusted as spelled.
            if full not in self.policy.stand_ins or ("." in attr and
                                                     full not in self.policy.trusted):
                raise _Refused(f"{spelled} is not allowed", spelled)
        mod, attr = (module, name) if (module, name) in names else mapped
        return self.policy.stand_ins[f"{mod}.{attr}"]

    def persistent_load(self, pid: Any) -> Any:
        # torch.save's ids: ("storage", storage type, key, location, numel)
        self.globals_met += 1
        if (type(pid) is not tuple or len(pid) != 5 or pid[0] not in ("storage", b"storage")
                or not (isinstance(pid[1], type) and issubclass(pid[1], _StandIn)
                        and pid[1].name.endswith("Storage"))
                or not all(isinstance(p, (str, bytes)) for p in pid[2:4])
                or type(pid[4]) is not int):
            raise _Refused(f"its pickle holds a persistent id that is not a torch storage "
                           f"({_short(pid)})")
        return _Storage()


# -- the two formats -----------------------------------------------------------------------------

def _check_archive(stream: io.BytesIO, key: str, policy: _Policy) -> None:
    """A ``torch.save`` zip archive: check ``data.pkl`` as read by torch's own zip reader (the
    one ``torch.load`` uses, so both see the same record)."""
    import torch

    try:
        archive = torch._C.PyTorchFileReader(stream)
    except Exception:  # noqa: BLE001 - torch.load fails the same way, before any unpickling
        return
    records = archive.get_all_records()
    if "constants.pkl" in records:  # torch.load hands TorchScript archives to torch.jit.load
        raise _refusal(key, "it is a TorchScript archive, which torch.load runs as code")
    if "data.pkl" not in records:
        return  # torch.load finds no pickle to load and fails before unpickling anything
    _walk(io.BytesIO(archive.get_record("data.pkl")), key, policy)


def _check_other(stream: io.BytesIO, key: str, policy: _Policy) -> None:
    """Bytes that are not a zip archive: ``torch.load`` reads them as its legacy format (a tar
    archive of pickles, or a sequence of pickles that starts with a magic number)."""
    try:
        with tarfile.open(fileobj=stream, mode="r:"):
            pass
    except (tarfile.TarError, EOFError, OSError, ValueError):
        pass
    else:
        raise _refusal(key, "it is a tar archive, torch.save's oldest format, which DCP never "
                            "writes")
    stream.seek(0)
    checker = _Checker(stream, policy)
    try:
        first = checker.load()
    except _Refused as exc:
        raise _refused(key, exc) from None
    except Exception as exc:  # noqa: BLE001 - not a pickle: raw bytes
        if checker.globals_met:  # what an allowed call returned may have made it fail
            raise _malformed(key, exc) from None
        return  # torch.load fails at the same byte, having built nothing
    from torch.serialization import MAGIC_NUMBER

    if checker.globals_met or (type(first) is int and first == MAGIC_NUMBER):
        raise _refusal(key, "it is in torch.save's legacy format, which DCP never writes")
    # A pickle of plain data that is not the magic number: torch.load stops right there.


def _walk(stream: io.BytesIO, key: str, policy: _Policy) -> None:
    try:
        _Checker(stream, policy).load()
    except _Refused as exc:
        raise _refused(key, exc) from None
    except Exception as exc:  # noqa: BLE001 - any malformed pickle
        raise _malformed(key, exc) from None


# -- messages ------------------------------------------------------------------------------------

_NOTHING_RAN = "nothing of it was loaded and nothing ran"


def _refused(key: str, exc: _Refused) -> UntrustedValue:
    name = exc.global_name
    if name is None:
        return _refusal(key, str(exc))
    if _module_of(name) in BLOCKED_MODULES:
        return UntrustedValue(
            f"non-tensor value '{key}' would call {name} when unpickled, which runs programs "
            f"or changes the interpreter: refused, {_NOTHING_RAN}. It cannot be allowed; the "
            f"checkpoint was written by other code than a training job's, or was tampered "
            f"with: restore it from another copy or delete it", key, name)
    return UntrustedValue(
        f"non-tensor value '{key}' would build {name} when unpickled, which is not allowed in "
        f"values read from a tier (torch's weights_only list, io.BytesIO, numpy arrays): "
        f"refused, {_NOTHING_RAN}. If you trust the code that wrote it, allow it in the "
        f"store's TOML: [store] trusted_pickles = [\"{name}\"]", key, name)


def _refusal(key: str, why: str) -> UntrustedValue:
    return UntrustedValue(f"non-tensor value '{key}' is not loaded from a tier: {why}; "
                          f"{_NOTHING_RAN}", key)


def _malformed(key: str, exc: Exception) -> UntrustedValue:
    return _refusal(key, f"its pickle is malformed ({type(exc).__name__}: "
                         f"{_short(str(exc), 160)})")


def _compat_name(module: str, name: str) -> tuple[str, str]:
    """The name pickle's ``fix_imports`` turns a Python 2 name into (itself when none)."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def _module_of(full: str) -> str:
    """The top-level package of ``module.Name``."""
    return full.split(".", 1)[0]


def _global_name(module: Any, name: Any) -> str:
    """``module.name`` as the pickle spells it, quoted when it is not plain identifiers."""
    text = f"{module}.{name}"
    plain = all(isinstance(p, str) and p.replace(".", "_").isidentifier() and p.isascii()
                for p in (module, name))
    return text if plain and len(text) <= 120 else _short(text, 120)


def _short(value: Any, limit: int = 80) -> str:
    """``repr`` of what a pickle holds, cut short: it may be huge or full of control bytes."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
