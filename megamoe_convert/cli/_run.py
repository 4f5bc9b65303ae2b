"""What every command shares: the one error path (:func:`run_command`) and JSON output.

Every error the tool raises on purpose is a :class:`~megamoe_convert.errors.MegamoeError`; the
operating system's own errors (a full disk, a missing file, a denied permission) are ``OSError``s
that name their file. Both end a command the same way: one line on stderr (and a JSON object on
stdout under ``--json``), exit 2. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import json
import sys
from typing import Any, Callable

import typer

from megamoe_convert import interrupts
from megamoe_convert.cli import conventions, signals
from megamoe_convert.errors import MegamoeError
from megamoe_convert.jsonio import one_line

#: ``debug``: ``--debug`` was given (tracebacks instead of one line); ``command``: the subcommand running.
state: dict[str, Any] = {"debug": False, "command": None}

#: What a command turns into one line instead of a traceback.
HANDLED_ERRORS: tuple[type[BaseException], ...] = (MegamoeError, OSError)

#: Commands that write only through temporary files and, rerun, go on from where they stopped:
#: after a full disk, only they can say "nothing partial was kept: rerun to resume".
RESUMABLE_COMMANDS = frozenset({"convert", "merge"})

#: Exit code of a handled error (usage errors share it: both mean "the command cannot do that").
ERROR_EXIT = 2


def run_command(body: Callable[[], Any]) -> Any:
    """Run a command body; expected failures become one line on stderr (and a JSON object on stdout
    under ``--json``) and exit code 2. Ctrl-C and SIGTERM stop cleanly with a resume hint: 130 / 143."""
    try:
        result = body()
        interrupts.check()  # a stop recorded, not raised, in the body's last import: the work may be cut short
        return result
    except KeyboardInterrupt as e:
        _stopped(signals.exit_code(e))
    except HANDLED_ERRORS as e:
        if state["debug"] or conventions.state["debug"]:  # --debug before the command, or after it
            raise
        _failed(e)


def _stopped(code: int) -> None:
    what = signals.what(code)
    hint = ("rerun the same command to resume" if state["command"] in RESUMABLE_COMMANDS else
            "nothing was changed" if state["command"] in ("inspect", "plan", "verify") else
            "rerun the same command")
    print(f"{what}: {hint}", file=sys.stderr)
    if conventions.state["json"]:
        conventions.print_json_error(f"{what}: {hint}", code)
    raise typer.Exit(code) from None


def _failed(e: BaseException) -> None:
    message = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename and e.strerror else str(e)
    disk_full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
    if disk_full and state["command"] in RESUMABLE_COMMANDS:
        message += " (nothing partial was kept: free space and rerun the same command to resume)"
    print(f"error: {one_line(message)}", file=sys.stderr)
    if conventions.state["json"]:
        conventions.print_json_error(one_line(message), ERROR_EXIT)
    raise typer.Exit(ERROR_EXIT) from None


def print_json(data: Any) -> None:
    """``--json`` output: one indented document on stdout."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")
