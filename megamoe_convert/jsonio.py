"""The one reader for every JSON document the tool trusts (configs, indexes, placement files,
manifests, journals, state files, safetensors headers).

Hostile or damaged input must fail as one line naming the file and what was expected, never
as a traceback: so nesting depth, duplicate keys, non-finite and huge numbers and invalid
UTF-8 are refused while parsing, and the typed accessors below check each field's type and
range before any code uses it. Every error is raised as the caller's own error class.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable, TypeVar

#: Deeper documents are refused (ours nest 4 levels; the C parser recurses without limit).
MAX_DEPTH = 32
#: Integers beyond this are refused (sizes and offsets of any real file fit in an int64).
MAX_INT = (1 << 63) - 1
#: Largest JSON file read whole (a manifest of a 1024-rank conversion is a few MB).
MAX_JSON_BYTES = 256 << 20

E = TypeVar("E", bound=Exception)
T = TypeVar("T")


class JsonError(ValueError):
    """Invalid JSON; callers re-raise it as their own error class (see :func:`parse`)."""


def _constant(name: str) -> Any:
    raise JsonError(f"non-finite number {name}")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonError(f"number {text[:20]} out of range")
    return value


def _int(text: str) -> int:
    if len(text.lstrip("-")) > 19 or abs(value := int(text)) > MAX_INT:
        raise JsonError(f"integer {text[:20]}{'...' if len(text) > 20 else ''} out of range")
    return value


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise JsonError(f"duplicate key {duplicate!r}")
    return data


def _check_depth(data: Any) -> None:
    """Iterative (a recursive walk would fail where the parser just did)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise JsonError(f"nested deeper than {MAX_DEPTH} levels")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, depth + 1) for child in children)


def parse(raw: bytes | str, where: object, error: type[E]) -> Any:
    """Parse ``raw`` strictly; any problem is ``error("WHERE: invalid JSON (why)")``."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        data = json.loads(text, parse_constant=_constant, parse_float=_float, parse_int=_int,
                          object_pairs_hook=_object)
        _check_depth(data)
    except RecursionError:
        raise error(f"{where}: invalid JSON (nested too deeply)") from None
    except UnicodeDecodeError as e:
        raise error(f"{where}: invalid JSON (not UTF-8 text: byte {e.start})") from None
    except ValueError as e:  # JSONDecodeError and JsonError
        raise error(f"{where}: invalid JSON ({e})") from None
    return data


def read(path: Path, error: type[E], what: str = "JSON file", max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Read and :func:`parse` a whole file; a missing, unreadable or oversized one is ``error`` too."""
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise error(f"{path}: missing {what}") from None
    except OSError as e:
        raise error(f"{path}: unreadable {what} ({e.strerror or e})") from None
    if len(raw) > max_bytes:
        raise error(f"{path}: {what} larger than {max_bytes} bytes")
    return parse(raw, path, error)


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
    """Checked reads from a parsed JSON document: ``Fields(where, Error).int(data, "size", 0)``."""

    def __init__(self, where: object, error: type[Exception]) -> None:
        self.where, self.error = where, error

    def fail(self, what: str) -> Exception:
        return self.error(one_line(f"{self.where}: {what}"))

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

    def bool(self, data: Any, key: str | int = -1, name: str | None = None) -> bool:
        value, label = self._get(data, key, name)
        if not isinstance(value, bool):
            raise self.fail(f"{label} must be true or false, got {describe(value)}")
        return value

    def int(self, data: Any, key: str | int = -1, lo: int = 0, hi: int = MAX_INT, name: str | None = None) -> int:
        value, label = self._get(data, key, name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(f"{label} must be an integer, got {describe(value)}")
        if not lo <= value <= hi:
            raise self.fail(f"{label} = {value} is outside {lo}..{hi}")
        return value

    def ints(self, data: Any, key: str | int = -1, lo: int = 0, hi: int = MAX_INT, name: str | None = None,
             max_len: int = 1 << 24) -> list[int]:
        label = name or (key if isinstance(key, str) else "value")
        items = self.list(data, key, label, max_len)
        return [self.int(x, name=f"{label}[{i}]", lo=lo, hi=hi) for i, x in enumerate(items)]

    def each(self, items: list[Any], read: Callable[[Any, str], T], label: str) -> list[T]:
        """``read(item, "label[i]")`` of every item: field errors then say which entry."""
        return [read(item, f"{label}[{i}]") for i, item in enumerate(items)]
