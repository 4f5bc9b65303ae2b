"""The ``megamoe`` command line (top of the pipeline: it may import every stage, nothing imports it).

One module per command (``synth``, ``inspect``, ``plan``, ``convert``, ``verify``, ``push``, ``pull``,
``merge``, ``preload``), each a top-level function whose docstring carries its examples. :data:`COMMANDS`
(``application``) lists them in the order ``megamoe --help`` shows them, the order a user runs them; the app is
built from it. Shared pieces: ``options`` (option types several commands take), ``_run`` (what one run
was asked for, the one error path, what every command needs, JSON output), ``conventions`` (``-h``, ``-q``,
metavars, plain usage errors, JSON errors, SIGTERM), ``describe`` and ``store`` (what ``inspect`` and
``plan`` say); ``demo`` is ``make demo``'s last step.

This module itself stays light: :func:`main` handles Ctrl-C and SIGTERM (:mod:`megamoe_convert.interrupts`)
before it imports the app (``application``), so a stop during those imports ends like any other. No
command module imports torch at its top: ``--version`` and every ``-h`` answer without it.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["app", "main"]


def __getattr__(name: str) -> Any:
    """``app`` and ``COMMANDS`` (:mod:`.application`), imported on first use."""
    if name in ("app", "COMMANDS"):
        from megamoe_convert.cli import application
        return getattr(application, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(args: list[str] | None = None) -> None:
    """The ``megamoe`` console script (also ``python -m megamoe_convert.cli``), with the conventions of
    :mod:`.conventions` applied to every command."""
    from megamoe_convert import interrupts

    interrupts.install()  # first: a stop may land in the imports below
    sys.exit(interrupts.stoppable(lambda: _run_app(sys.argv[1:] if args is None else args)))


def _run_app(args: list[str]) -> int:
    """The app on ``args``; not named ``_run``, the submodule that importing the app binds to that name here."""
    import typer.main

    from megamoe_convert import interrupts
    from megamoe_convert.cli import conventions
    from megamoe_convert.cli.application import app

    interrupts.check()  # a stop Python dropped during the imports (in a finalizer) ends the command here
    return conventions.run(conventions.apply(typer.main.get_command(app)), args, "megamoe")
