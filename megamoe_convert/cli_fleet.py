"""`megamoe` commands for fleet (registered into the main app by cli.py)."""

from __future__ import annotations

from typing import Any, Callable

import typer


def register(app: typer.Typer, run_command: Callable[[Callable[[], Any]], Any],
             print_json: Callable[[Any], None]) -> None:
    """Add this module's commands to `app`."""
