"""Ctrl-C and SIGTERM: handled from a command's first instant, and remembered as well as raised.

The command line installs the handlers (:func:`install`) before its own imports, so a stop that lands
anywhere (an import, the argument parser, a command's body) ends the same way: one line, exit 130
(Ctrl-C) or 143 (SIGTERM: ``timeout``, Kubernetes), never a traceback. Imports nothing but the
standard library, so that installing them is itself immediate.

Python raises ``KeyboardInterrupt`` wherever the main thread is when a signal's handler runs. If that
is inside a finalizer (a ``__del__``, a weakref callback, the garbage collector's), the exception is
printed and dropped, and a conversion would run on to a finished result with exit 0; inside an
extension module's initialiser it may abort the process. So every stop is also recorded here, and
the long loops poll the record (:func:`check`): a stop is never lost.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any, Callable

_requested = threading.Event()
_raise: type[BaseException] = KeyboardInterrupt


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that every clean-up a Ctrl-C runs also runs."""

    exit_code = 143


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


def _on_sigterm(signum: int, frame: Any) -> None:
    request(Terminated)
    if not _importing(frame):
        raise Terminated()


def _on_sigint(signum: int, frame: Any) -> None:
    request(KeyboardInterrupt)  # remembered too: a KeyboardInterrupt raised in a finalizer is dropped
    if not _importing(frame):
        raise KeyboardInterrupt


def _importing(frame: Any) -> bool:
    """Whether the stop landed in an import. There it is only recorded, and raised by the next
    :func:`check` once the import is done: an extension module's initialiser (torch's C++
    ``_c10d_init``, say) may be on the stack, and an exception raised through its C++ aborts the
    whole process (SIGABRT, a C++ message) instead of unwinding."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def install() -> None:
    """Handle Ctrl-C and SIGTERM from now on (a new command: any earlier stop forgotten)."""
    clear()
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, _on_sigint)
    sys.unraisablehook = _unraisable


_default_unraisable = sys.unraisablehook


def _unraisable(args: Any) -> None:
    """A stop raised inside a finalizer (an import lock's callback, say) is dropped by Python, which
    would print a traceback for it: it is recorded and acted on at the next :func:`check` instead, so
    it is said once, as every stop is."""
    if not isinstance(args.exc_value, KeyboardInterrupt):
        _default_unraisable(args)


def exit_code(stop: BaseException) -> int:
    """130 for Ctrl-C, 143 for SIGTERM."""
    return int(getattr(stop, "exit_code", 130))


def what(code: int) -> str:
    """The stop an exit code says, as the one line names it."""
    return "terminated (SIGTERM)" if code == 143 else "interrupted"


def stoppable(run: Callable[[], int], hint: str = "rerun the same command") -> int:
    """``run()``'s exit code; a stop that reaches here (one no command body caught: in an import,
    say) is one line and its exit code. Further stops are only recorded from then on: the process
    is ending."""
    try:
        return run()
    except KeyboardInterrupt as stop:
        code = exit_code(stop)
        _record_only()
        print(f"{what(code)}: {hint}", file=sys.stderr)
        return code


def _record_only() -> None:
    signal.signal(signal.SIGTERM, lambda *_: request(Terminated))
    signal.signal(signal.SIGINT, lambda *_: request(KeyboardInterrupt))
