"""The ``megamoe`` command line (top of the pipeline: it may import every stage, nothing imports it).

``commands`` holds the app and the core commands; ``inspect`` (inspect, plan), ``verify``, ``fleet`` and
``preload`` add theirs here; ``conventions`` applies the command line's conventions to all of them (``-h``,
``-q/--quiet``, metavars, plain-worded usage errors, JSON errors under ``--json``, SIGTERM);
``demo`` is ``make demo``'s last step.
"""

from __future__ import annotations

import sys

from megamoe_convert.cli import conventions, fleet, inspect, preload, verify
from megamoe_convert.cli.commands import app, print_json, run_command

inspect.register(app, run_command, print_json)
verify.register(app, run_command, print_json)
fleet.register(app, run_command, print_json)
preload.register(app, run_command, print_json)
# `megamoe --help` lists commands in the order they were added: the order a user runs them.
_ORDER = ["synth", "inspect", "plan", "convert", "verify", "push", "pull", "merge", "preload"]
app.registered_commands.sort(key=lambda c: _ORDER.index(c.callback.__name__) if c.callback and
                             c.callback.__name__ in _ORDER else len(_ORDER))

__all__ = ["app", "main"]


def main(args: list[str] | None = None) -> None:
    """The ``megamoe`` console script (also ``python -m megamoe_convert.cli``), with the conventions of
    :mod:`.conventions` applied to every command."""
    import typer.main

    conventions.install_signal_handlers()
    command = conventions.apply(typer.main.get_command(app))
    sys.exit(conventions.run(command, sys.argv[1:] if args is None else args, "megamoe"))
