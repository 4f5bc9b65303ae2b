"""The one reader for every JSON document the tool trusts (configs, indexes, placement files,
manifests, journals, state files, safetensors headers).

Hostile or damaged input must fail as one line naming the file and what was expected, never
as a traceback: so nesting depth, duplicate keys, non-finite and huge numbers and invalid
UTF-8 are refused while parsing, and the typed accessors below check each field's type and
range before any code uses it. Every function takes the caller's error class and raises each
problem once, as that class, naming the file (``JsonError`` where the caller has none of its own).
"""

from __future__ import annotations

import builtins
import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any, Callable, TypeVar

#: Deeper documents are refused (ours nest 4 levels; the C parser recurses without limit).
MAX_DEPTH = 32
#: Integers beyond this are refused (sizes and offsets of any real file fit in an int64).
MAX_INT = (1 << 63) - 1
#: Largest JSON file read whole, for documents without a bound of their own.
MAX_JSON_BYTES = 256 << 20
#: What each kind of document can legitimately hold, checked on the file's size before a byte is
#: parsed (a 99 MB placement file once took 51 s and 5 GB to parse under the generic limit).
#: config.json: a few KB (Kimi-K3's, with its vision config, is ~10 KB).
MAX_CONFIG_BYTES = 4 << 20
#: model.safetensors.index.json: one ~100-byte entry per tensor (DeepSeek-V4-Pro: ~150k tensors).
MAX_INDEX_BYTES = 64 << 20
#: A placement file: at most 2**20 ids of at most 7 digits, one per line with an indent (~10.5 MB).
MAX_PLACEMENT_BYTES = 16 << 20
#: manifest.json: the placement (as above) and one ~200-byte entry per file of a plan of at most
#: ``MAX_PLAN_FILES`` files (``convert`` refuses larger plans, so every manifest it writes fits).
MAX_PLAN_FILES = 1 << 19
MAX_MANIFEST_BYTES = 128 << 20
#: OUT/.megamoe/ state files (plan.json holds the placement) and the journal (a line per file
#: written, appended again by every rerun that redoes it).
MAX_STATE_BYTES = 64 << 20
MAX_JOURNAL_BYTES = 256 << 20

E = TypeVar("E", bound=Exception)
T = TypeVar("T")


# The parser's hooks raise plain ValueErrors: :func:`parse` turns each into the caller's error,
# with the document's name (the hooks know neither).

def _constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} out of range")
    return value


def _int(text: str) -> int:
    if len(text.lstrip("-")) > 19 or abs(value := int(text)) > MAX_INT:
        raise ValueError(f"integer {text[:20]}{'...' if len(text) > 20 else ''} out of range")
    return value


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate key {duplicate!r}")
    return data


def _check_depth(data: Any) -> None:
    """Iterative (a recursive walk would fail where the parser just did)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, depth + 1) for child in children)


def parse(raw: bytes | str, where: object, error: type[E], hint: str = "") -> Any:
    """Parse ``raw`` strictly; any problem is ``error("WHERE: invalid JSON (why)")``, ``hint`` after it."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        data = json.loads(text, parse_constant=_constant, parse_float=_float, parse_int=_int,
                          object_pairs_hook=_object)
        _check_depth(data)
    except RecursionError:
        raise error(f"{where}: invalid JSON (nested too deeply){hint}") from None
    except UnicodeDecodeError as e:
        raise error(f"{where}: invalid JSON (not UTF-8 text: byte {e.start}){hint}") from None
    except ValueError as e:  # JSONDecodeError and the hooks' refusals
        raise error(f"{where}: invalid JSON ({e}){hint}") from None
    return data


def _file_kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def read_regular(path: Path, error: type[E], what: str, max_bytes: int, hint: str = "") -> bytes:
    """The bytes of ``path``, which must be a regular file of at most ``max_bytes``: the one way
    every input document is opened. It is opened non-blocking, so a FIFO (or a device) under the
    name is refused instead of blocking forever; its size is checked before anything is read.
    ``hint`` ends every error (what to do about it, where the caller knows)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{path}: missing {what}{hint}") from None
    except OSError as e:
        raise error(f"{path}: unreadable {what} ({e.strerror or e}){hint}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: {what} is {_file_kind(st.st_mode)}, not a regular file{hint}")
        if st.st_size > max_bytes:
            raise error(f"{path}: {what} is {st.st_size} bytes, more than one can hold ({max_bytes}){hint}")
        os.set_blocking(fd, True)
        chunks, total = [], 0
        while total <= max_bytes and (chunk := os.read(fd, min(16 << 20, max_bytes + 1 - total))):
            chunks.append(chunk)
            total += len(chunk)
    except OSError as e:
        raise error(f"{path}: unreadable {what} ({e.strerror or e}){hint}") from None
    finally:
        os.close(fd)
    raw = b"".join(chunks)
    if len(raw) > max_bytes:  # it grew while being read
        raise error(f"{path}: {what} is more than {max_bytes} bytes, more than one can hold{hint}")
    return raw


def read(path: Path, error: type[E], what: str = "JSON file", max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Read (:func:`read_regular`) and :func:`parse` a whole file; a missing, unreadable, irregular
    or oversized one is ``error`` too."""
    return parse(read_regular(Path(path), error, what, max_bytes), path, error)


# --------------------------------------------------------------------------------------
# Numbers typed by a person (command-line options, environment): one strict parser
# --------------------------------------------------------------------------------------

_ASCII_UINT = re.compile(r"[0-9]{1,18}")


def is_uint(text: str) -> bool:
    """``text`` is 1-18 ASCII digits (what :func:`parse_uint` takes)."""
    return isinstance(text, str) and _ASCII_UINT.fullmatch(text) is not None


def parse_uint(text: str, what: str, error: type[E], lo: int = 0, hi: int = MAX_INT) -> int:
    """``text`` as a non-negative integer in ``lo..hi``: ASCII digits only (``str.isdigit`` and
    ``int`` also take ``'²'``, ``'٣'``, ``' 3'``, ``'3_0'``), no sign, at most 18 of them."""
    if not isinstance(text, str) or not _ASCII_UINT.fullmatch(text):
        raise error(f"{what}: cannot parse {short(text)} (expected a whole number {lo}..{hi} in ASCII digits)")
    value = int(text)
    if not lo <= value <= hi:
        raise error(f"{what}: {value} is outside {lo}..{hi}")
    return value


# --------------------------------------------------------------------------------------
# Typed access: each returns the value or raises ``error`` naming the field and the file
# --------------------------------------------------------------------------------------

_MISSING = object()


def one_line(text: str) -> str:
    """``text`` with control characters escaped: names read from a file cannot break an error line."""
    return re.sub(r"[\x00-\x1f\x7f]", lambda m: repr(m.group())[1:-1], text)


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def describe(value: Any) -> str:
    """``null``, ``a list``, ``the string '2'``, ``1.5``: what was found, for one-line errors."""
    if value is None or isinstance(value, (dict, list)):
        return _type_name(value)
    return f"the string {short(value)}" if isinstance(value, str) else short(value)


class Fields:
    """Checked reads from a parsed JSON document: ``Fields(where, Error).int(data, "size", 0)``;
    ``hint`` ends every error (what to do about it, where the caller knows)."""

    def __init__(self, where: object, error: type[Exception], hint: str = "") -> None:
        self.where, self.error, self.hint = where, error, hint

    def fail(self, what: str) -> Exception:
        return self.error(one_line(f"{self.where}: {what}{self.hint}"))

    def _get(self, data: Any, key: str | int, name: str | None) -> tuple[Any, str]:
        label = name or (key if isinstance(key, str) else "value")
        if isinstance(key, str):
            if not isinstance(data, dict):
                raise self.fail(f"expected an object holding {label!r}, got {_type_name(data)}")
            value = data.get(key, _MISSING)
            if value is _MISSING:
                raise self.fail(f"missing field {label!r}")
            return value, label
        return data, label

    def obj(self, data: Any, key: str | int = -1, name: str | None = None) -> dict[str, Any]:
        value, label = self._get(data, key, name)
        if not isinstance(value, dict):
            raise self.fail(f"{label} must be an object, got {_type_name(value)}")
        return value

    def list(self, data: Any, key: str | int = -1, name: str | None = None, max_len: int = 1 << 24) -> list[Any]:
        value, label = self._get(data, key, name)
        if not isinstance(value, list):
            raise self.fail(f"{label} must be a list, got {_type_name(value)}")
        if len(value) > max_len:
            raise self.fail(f"{label} has {len(value)} entries, at most {max_len} allowed")
        return value

    def str(self, data: Any, key: str | int = -1, name: str | None = None) -> str:
        value, label = self._get(data, key, name)
        if not isinstance(value, str):
            raise self.fail(f"{label} must be a string, got {describe(value)}")
        return value

    # The readers are named for the JSON type they return, so the class body's `str`, `int`, `list`
    # and `bool` are these methods from here on: signatures below name the builtins.
    def bool(self, data: Any, key: builtins.str | builtins.int = -1, name: builtins.str | None = None) -> builtins.bool:
        value, label = self._get(data, key, name)
        if not isinstance(value, bool):
            raise self.fail(f"{label} must be true or false, got {describe(value)}")
        return value

    def int(self, data: Any, key: builtins.str | builtins.int = -1, lo: builtins.int = 0, hi: builtins.int = MAX_INT,
            name: builtins.str | None = None) -> builtins.int:
        value, label = self._get(data, key, name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(f"{label} must be an integer, got {describe(value)}")
        if not lo <= value <= hi:
            raise self.fail(f"{label} = {value} is outside {lo}..{hi}")
        return value

    def number(self, data: Any, key: builtins.str | builtins.int = -1, lo: float = -math.inf, hi: float = math.inf,
               name: builtins.str | None = None, lo_open: builtins.bool = False) -> float:
        """A JSON number (an integer or a finite float, never a boolean) in ``lo..hi`` (``lo_open``:
        greater than ``lo``)."""
        value, label = self._get(data, key, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise self.fail(f"{label} must be a number, got {describe(value)}")
        if not (lo < value if lo_open else lo <= value) or value > hi:
            raise self.fail(f"{label} = {short(value)} is out of range (expected {'>' if lo_open else '>='} {lo:g} "
                            f"and <= {hi:g})")
        return float(value)

    def ints(self, data: Any, key: builtins.str | builtins.int = -1, lo: builtins.int = 0,
             hi: builtins.int = MAX_INT, name: builtins.str | None = None,
             max_len: builtins.int = 1 << 24) -> builtins.list[builtins.int]:
        label = name or (key if isinstance(key, str) else "value")
        items = self.list(data, key, label, max_len)
        return [self.int(x, name=f"{label}[{i}]", lo=lo, hi=hi) for i, x in enumerate(items)]

    def each(self, items: builtins.list[Any], read: Callable[[Any, builtins.str], T],
             label: builtins.str) -> builtins.list[T]:
        """``read(item, "label[i]")`` of every item: field errors then say which entry."""
        return [read(item, f"{label}[{i}]") for i, item in enumerate(items)]
