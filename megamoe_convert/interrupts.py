"""A stop request (Ctrl-C, SIGTERM) remembered as well as raised.

Python raises ``KeyboardInterrupt`` wherever the main thread is when the signal's handler runs. If
that is inside a finalizer (a ``__del__``, a weakref callback, the garbage collector's), the
exception is printed and dropped, and a conversion would run on to a finished result with exit 0.
The command line's handlers therefore also record the request here, and the long loops poll it
(:func:`check`), so a stop is never lost.
"""

from __future__ import annotations

import threading

_requested = threading.Event()
_raise: type[BaseException] = KeyboardInterrupt


def request(exception: type[BaseException]) -> None:
    """Remember a stop: :func:`check` raises ``exception`` from now on."""
    global _raise
    _raise = exception
    _requested.set()


def clear() -> None:
    """Forget any earlier request (a new command starts)."""
    _requested.clear()


def check() -> None:
    """Raise the recorded stop, if there is one (the backstop for a dropped ``KeyboardInterrupt``)."""
    if _requested.is_set():
        raise _raise()
