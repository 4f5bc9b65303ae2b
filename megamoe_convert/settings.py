"""Every ``MEGAMOE_*`` environment variable the package reads, in one place.

Each is read when it is used, never at import: a process (or a test) that sets one after importing
the package is heard, and a command that never uses one is not stopped by it. Each is checked when
read: a bad value raises :class:`~megamoe_convert.errors.SettingError`, one line naming the variable
and what it accepts. An empty value is the same as an unset one. The command line checks them all as
a command starts (:func:`check`), so a bad one is said before any work, whichever command runs.

- ``MEGAMOE_READ_THREADS``: reader lanes of a warm GPU load (``serve/staging.py``);
- ``MEGAMOE_FAST_PIN``, ``MEGAMOE_CUDART``: the GPU load path's switches (``serve/staging.py``);
- ``MEGAMOE_STAGED_REST``: ``0`` leaves a conversion's non-expert weights to the engine's own
  safetensors iterator (``serve/tensor_stream.py``, ``engines/vllm/loader.py``);
- ``MEGAMOE_LAYOUT_PROBE``: ``0`` installs without the layout probe (``engines/probe.py``);
- ``MEGAMOE_TEST_FAULTS``: one fault the reliability tests inject (``faults.py``); never set in use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from megamoe_convert.errors import SettingError

READ_THREADS = "MEGAMOE_READ_THREADS"
FAST_PIN = "MEGAMOE_FAST_PIN"
CUDART = "MEGAMOE_CUDART"
LAYOUT_PROBE = "MEGAMOE_LAYOUT_PROBE"
STAGED_REST = "MEGAMOE_STAGED_REST"
TEST_FAULTS = "MEGAMOE_TEST_FAULTS"

#: Every variable above, in the order :func:`check` reads them.
NAMES = (READ_THREADS, FAST_PIN, CUDART, LAYOUT_PROBE, STAGED_REST, TEST_FAULTS)

#: The most reader lanes a warm load runs (a cold one runs twice as many).
MAX_READ_THREADS = 256

#: Each fault of ``MEGAMOE_TEST_FAULTS`` and what its argument is: a count, a file name, or a count
#: and a path (``N:PATH``). :mod:`megamoe_convert.faults` says what each does.
FAULT_ARGUMENTS = {
    "kill-after-files": "N", "kill-after-bytes": "N", "kill-before-rename": "NAME", "kill-before-append": "NAME",
    "enospc-after-bytes": "N", "wait-after-files": "N:PATH", "free-bytes": "N",
}


def _raw(name: str) -> str | None:
    """The variable's value, ``None`` when it is unset or empty."""
    return os.environ.get(name) or None


def _whole_number(text: str) -> int | None:
    """``text`` as a whole number written in ASCII digits (``'²'`` and ``'+1'`` are none), else ``None``."""
    return int(text) if text.isascii() and text.isdigit() else None


def _integer(name: str, default: int, low: int, high: int) -> int:
    raw = _raw(name)
    if raw is None:
        return default
    value = _whole_number(raw)
    if value is None or not low <= value <= high:
        raise SettingError(f"{name}={raw!r}: expected an integer in {low}..{high}")
    return value


def _switch(name: str, default: bool = True) -> bool:
    """A switch that is ``default`` unless set to ``0`` (off) or ``1`` (on)."""
    raw = _raw(name)
    if raw not in (None, "0", "1"):
        raise SettingError(f"{name}={raw!r}: expected 0 (off) or 1 (on)")
    return default if raw is None else raw == "1"


def read_threads() -> int:
    """Reader lanes of a warm load: the CPU count, 4 to 16, unless set (1..256)."""
    return _integer(READ_THREADS, max(4, min(16, os.cpu_count() or 4)), 1, MAX_READ_THREADS)


def fast_pin() -> bool:
    """Pin the staging ring by registering huge pages (``1``; default: with ``torch``'s allocator)."""
    return _switch(FAST_PIN, default=False)


def cudart() -> bool:
    """Issue the host-to-device copies through the CUDA runtime (``0``: through ``torch``)."""
    return _switch(CUDART)


def layout_probe() -> bool:
    """Run the layout probe before an install (``0``: install unchecked, logged on every install)."""
    return _switch(LAYOUT_PROBE)


def staged_rest() -> bool:
    """Read a local conversion's non-expert weights through the staging ring (``0``: through the
    engine's own safetensors iterator)."""
    return _switch(STAGED_REST)


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``kind``, its count (``N``, or ``N`` of ``N:PATH``) and its name or path."""

    kind: str
    count: int = 0
    name: str = ""


def injected_fault() -> Fault | None:
    """The fault ``MEGAMOE_TEST_FAULTS`` asks for (``KIND=ARGUMENT``), ``None`` when unset."""
    raw = _raw(TEST_FAULTS)
    if raw is None:
        return None
    kind, _, argument = raw.partition("=")
    fault = _fault(kind.strip(), argument.strip())
    if fault is None:
        known = ", ".join(f"{kind}={shape}" for kind, shape in FAULT_ARGUMENTS.items())
        raise SettingError(f"{TEST_FAULTS}={raw!r}: expected one fault of {known}")
    return fault


def _fault(kind: str, argument: str) -> Fault | None:
    """``KIND=ARGUMENT`` as a :class:`Fault`, ``None`` where the kind is unknown or the argument not its shape."""
    shape = FAULT_ARGUMENTS.get(kind)
    if shape == "NAME":
        return Fault(kind, name=argument) if argument else None
    count, _, path = argument.partition(":") if shape == "N:PATH" else (argument, "", "")
    number = _whole_number(count)
    if shape is None or number is None or (shape == "N:PATH") != bool(path):
        return None
    return Fault(kind, number, path)


def check() -> None:
    """Read every setting, so that a bad one is refused now (the command line, as a command starts)."""
    read_threads(), fast_pin(), cudart(), layout_probe(), staged_rest(), injected_fault()
