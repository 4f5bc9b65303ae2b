"""The ``megamoe`` command line (top of the pipeline: it may import every stage, nothing imports it).

``commands`` holds the app and the core commands; ``verify``, ``fleet`` and ``preload`` add theirs here;
``demo`` is ``make demo``'s last step.
"""

from __future__ import annotations

from megamoe_convert.cli import fleet, preload, verify
from megamoe_convert.cli.commands import app, print_json, run_command

verify.register(app, run_command, print_json)
fleet.register(app, run_command, print_json)
preload.register(app, run_command, print_json)

__all__ = ["app", "main"]


def main() -> None:
    """The ``megamoe`` console script (also ``python -m megamoe_convert.cli``)."""
    app(prog_name="megamoe")
