"""What every command shares: what one run of the command line was asked for (:class:`Invocation`),
what every command needs before its own imports (:func:`preflight`), the one error path
(:func:`run_command`) and JSON output.

Every error the tool raises on purpose is a :class:`~megamoe_convert.errors.MegamoeError`; the
operating system's own errors (a full disk, a missing file, a denied permission) are ``OSError``s
that name their file. Both end a command the same way: one line on stderr (and a JSON object on
stdout under ``--json``), exit 2. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextvars
import errno
import json
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

import typer

from megamoe_convert import faults, interrupts, settings, ui
from megamoe_convert.errors import DependencyError, MegamoeError
from megamoe_convert.jsonio import one_line

#: What a command turns into one line instead of a traceback.
HANDLED_ERRORS: tuple[type[BaseException], ...] = (MegamoeError, OSError)

#: Commands that write only through temporary files and, rerun, go on from where they stopped:
#: after a full disk, only they can say "nothing partial was kept: rerun to resume".
RESUMABLE_COMMANDS = frozenset({"convert", "merge"})

#: Exit code of a handled error (usage errors share it: both mean "the command cannot do that").
ERROR_EXIT = 2

#: The oldest torch the package runs on: pyproject.toml declares the same bound.
TORCH_MINIMUM = (2, 8)
#: What to do about a torch that is missing, broken or too old.
TORCH_ADVICE = ("install the serving engine first (it brings the torch it runs with), or, on a machine that only "
                "converts, torch's CPU build: pip install torch --index-url https://download.pytorch.org/whl/cpu")


@dataclass
class Invocation:
    """What one run of the command line was asked for, set by its options as they are parsed."""

    command: str | None = None  # the subcommand running
    debug: bool = False  # --debug, before the command or after it: tracebacks instead of one line
    json: bool = False  # --json: errors as a JSON object on stdout too
    quiet: bool = False  # -q/--quiet: no progress or status lines


_current: contextvars.ContextVar[Invocation | None] = contextvars.ContextVar("megamoe_invocation", default=None)


def begin() -> Invocation:
    """A new run of the command line: its own :class:`Invocation`, nothing of an earlier run's kept
    (the quiet switch, a fault's counts: a process may run several)."""
    invocation = Invocation()
    _current.set(invocation)
    ui.set_quiet(False)
    faults.reset()
    return invocation


def invocation() -> Invocation:
    """The running command line's :class:`Invocation` (a default one for a body run outside it)."""
    return _current.get() or Invocation()


def preflight() -> None:
    """What every command needs, checked before its own imports (which would end in a traceback):
    an importable torch, new enough, and every ``MEGAMOE_*`` setting valid."""
    need_torch()
    settings.check()


def need_torch() -> None:
    """torch, importable and at least :data:`TORCH_MINIMUM`, or a :class:`DependencyError` saying
    what is wrong and what to do."""
    least = ".".join(map(str, TORCH_MINIMUM))
    try:
        import torch
    except Exception as e:  # a broken install raises anything from its import: OSError, ImportError, ...
        missing = isinstance(e, ModuleNotFoundError) and e.name == "torch"
        problem = "is not installed" if missing else f"cannot be imported ({type(e).__name__}: {one_line(str(e))})"
        raise DependencyError(f"torch {problem}; megamoe needs torch >= {least}: {TORCH_ADVICE}") from e
    version = str(getattr(torch, "__version__", ""))
    release = re.match(r"(\d+)\.(\d+)", version)
    if release and (int(release[1]), int(release[2])) < TORCH_MINIMUM:
        raise DependencyError(f"torch {version} is older than {least}, the oldest megamoe runs on: {TORCH_ADVICE}")


def run_command(body: Callable[[], Any]) -> Any:
    """Run a command body; expected failures become one line on stderr (and a JSON object on stdout
    under ``--json``) and exit code 2. Ctrl-C and SIGTERM stop cleanly with a resume hint: 130 / 143."""
    try:
        result = body()
        interrupts.check()  # a stop recorded, not raised, in the body's last import: the work may be cut short
        return result
    except KeyboardInterrupt as e:
        raise typer.Exit(say_stopped(interrupts.exit_code(e), _stop_hint())) from None
    except HANDLED_ERRORS as e:
        if invocation().debug:
            raise
        raise typer.Exit(_say_failed(e)) from None


def _stop_hint() -> str:
    command = invocation().command
    return ("rerun the same command to resume" if command in RESUMABLE_COMMANDS else
            "nothing was changed" if command in ("inspect", "plan", "verify") else
            "rerun the same command")


def say_stopped(code: int, hint: str = "rerun the same command") -> int:
    """A stop, in one line (and as JSON under ``--json``); returns its exit code."""
    line = f"{interrupts.what(code)}: {hint}"
    print(line, file=sys.stderr)
    if invocation().json:
        print_json_error(line, code)
    return code


def _say_failed(e: BaseException) -> int:
    message = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename and e.strerror else str(e)
    disk_full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
    if disk_full and invocation().command in RESUMABLE_COMMANDS:
        message += " (nothing partial was kept: free space and rerun the same command to resume)"
    print(f"error: {one_line(message)}", file=sys.stderr)
    if invocation().json:
        print_json_error(one_line(message), ERROR_EXIT)
    return ERROR_EXIT


def print_json(data: Any) -> None:
    """``--json`` output: one indented document on stdout."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def print_json_error(message: str, exit_code: int) -> None:
    """An error under ``--json``: ``{"ok": false, "error": ..., "exit_code": ...}`` on stdout."""
    print_json({"ok": False, "error": message, "exit_code": exit_code})
