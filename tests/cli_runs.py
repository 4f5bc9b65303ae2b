"""The ``megamoe`` command line as the tests run it: in the pytest process (:func:`run_cli`, the unit
tier: no interpreter start, no torch import per call) or in a process of its own
(:func:`run_cli_process`, the e2e tier: signals, kills, a fresh interpreter).

Both answer a :class:`subprocess.CompletedProcess` (``returncode``, ``stdout``, ``stderr``), run from
the repository with ``COLUMNS=200`` and ``env`` over the environment. In the process, what the command
line sets for the whole process (signal handlers, the unraisable hook, the quiet switch, a recorded
stop, the fault counts, the working directory, the invocation's context) is put back once it returns,
so each test starts from the same state; warnings and log records land on the command's stderr, as in
a process of its own, not in pytest's collection of them.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import logging
import os
import signal
import subprocess
import sys
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path

from megamoe_convert import cli, faults, interrupts, settings, ui

REPO = Path(__file__).resolve().parent.parent

#: The environment a command in the pytest process honours: ``COLUMNS`` and the package's own
#: settings, read when used. The rest (the Hugging Face hub's endpoint and offline mode, say) is read
#: once, when a library is imported, and needs a process of its own.
IN_PROCESS_ENV = frozenset({"COLUMNS", *settings.NAMES})


class CliTimeout(BaseException):
    """A command in the pytest process ran past its ``timeout`` (a BaseException: no ``except
    Exception`` of the command's own swallows it)."""


def run_cli(*args: object, check: bool = True, timeout: float = 300, env: dict[str, str] | None = None,
            ) -> subprocess.CompletedProcess[str]:
    """``megamoe ARGS...`` in the pytest process, through the console script's own entry
    (``megamoe_convert.cli.main``); ``check``: a non-zero exit fails the test."""
    argv = list(map(str, args))
    env = {"COLUMNS": "200", **(env or {})}
    refused = sorted(set(env) - IN_PROCESS_ENV)
    if refused or env.get(settings.TEST_FAULTS, "").startswith("kill-"):
        raise AssertionError(f"megamoe {' '.join(argv)}: {refused or env[settings.TEST_FAULTS]} needs a process "
                             "of its own: run_cli_process, in tests/e2e")
    with _environment(env), _process_state(), _streams() as (out, err):
        try:
            code = contextvars.copy_context().run(_main, argv, timeout)
        except CliTimeout:
            raise subprocess.TimeoutExpired(["megamoe", *argv], timeout, _text(out), _text(err)) from None
        proc = subprocess.CompletedProcess(["megamoe", *argv], code, _text(out), _text(err))
    return _checked(proc, argv, check)


def run_cli_process(*args: object, check: bool = True, timeout: float = 300, env: dict[str, str] | None = None,
                    ) -> subprocess.CompletedProcess[str]:
    """``megamoe ARGS...`` as a real subprocess (the console script's module, ``python -m``)."""
    argv = list(map(str, args))
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "megamoe_convert.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=REPO)
    return _checked(proc, argv, check)


def _checked(proc: subprocess.CompletedProcess[str], argv: list[str], check: bool) -> subprocess.CompletedProcess[str]:
    if check and proc.returncode != 0:
        raise AssertionError(f"megamoe {' '.join(argv)} exited {proc.returncode}:\n"
                             f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def _main(argv: list[str], timeout: float) -> int:
    """The exit code ``cli.main`` ends with; a bug's traceback goes to stderr with exit 1, as Python's
    own handler does at a process's end."""
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        cli.main(argv)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except CliTimeout:
        raise
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return 0


def _on_alarm(signum: int, frame: object) -> None:
    raise CliTimeout


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``env`` over it for the call, then exactly as it was."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _process_state() -> Iterator[None]:
    """Everything process-wide the command line sets, put back when it returns."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}
    hook, quiet, cwd, root = sys.unraisablehook, ui.is_quiet(), os.getcwd(), logging.getLogger()
    log_handlers = root.handlers[:]
    os.chdir(REPO)
    root.handlers = []  # logging's last resort then writes warnings to sys.stderr, as in a process
    try:
        with warnings.catch_warnings():
            _fresh_warning_filters()
            yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        sys.unraisablehook, root.handlers = hook, log_handlers
        ui.set_quiet(quiet)
        interrupts.clear()
        faults.reset()
        os.chdir(cwd)


def _fresh_warning_filters() -> None:
    """A fresh interpreter's warning filters, each warning written to ``sys.stderr``."""
    warnings.resetwarnings()
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category, append=True)
    warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: sys.stderr.write(
        warnings.formatwarning(message, category, filename, lineno, line))


@contextlib.contextmanager
def _streams() -> Iterator[tuple[io.TextIOWrapper, io.TextIOWrapper]]:
    """stdin empty (a process's ``/dev/null``), stdout and stderr pipes of their own."""
    saved = sys.stdin, sys.stdout, sys.stderr
    out, err = (io.TextIOWrapper(io.BytesIO(), encoding="utf-8", write_through=True) for _ in range(2))
    sys.stdin, sys.stdout, sys.stderr = io.TextIOWrapper(io.BytesIO(b""), encoding="utf-8"), out, err
    try:
        yield out, err
    finally:
        sys.stdin, sys.stdout, sys.stderr = saved


def _text(stream: io.TextIOWrapper) -> str:
    """What ``subprocess.run(text=True)`` reads from a pipe: UTF-8, universal newlines."""
    stream.flush()
    raw = stream.buffer.getvalue()  # type: ignore[attr-defined]
    return io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8").read()
