"""Options and arguments several commands share, typed once."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from megamoe_convert.source import engines_table


class Engine(str, Enum):
    vllm = "vllm"
    sglang = "sglang"


#: ``--engine``: whose per-layer expert placement to use (SGLang builds the MTP layer its own way);
#: left out, the engine that serves the checkpoint's family (``engines_table.resolve_engine``).
EngineOption = Annotated[Optional[Engine], typer.Option(
    help="Serving engine whose expert placement the ranks follow: SGLang builds the MTP layer without redundant "
         f"experts (default: the engine that serves the model family: {engines_table.engine_defaults()}).")]

#: ``--revision`` of the commands that read a source checkpoint.
RevisionOption = Annotated[Optional[str], typer.Option(help="SRC is a hub repo id: branch, tag or commit to "
                                                            "download (default: main).")]

#: ``--json`` of the commands whose result is a summary.
JsonOption = Annotated[bool, typer.Option("--json", help="Print a machine-readable summary on stdout.")]

#: ``--ep-size`` / ``--num-redundant-experts`` wording shared by inspect and plan.
RedundantOption = Annotated[int, typer.Option(min=0, help="Redundant experts (EPLB).")]

#: ``--placement FILE``.
PlacementOption = Annotated[Optional[Path], typer.Option("--placement", help="JSON list: logical expert id of "
                                                                             "every physical slot.")]


def resolve_source(src: str, revision: str | None = None) -> Path:
    """SRC as a local directory: a path that exists is one; anything else is a hub repo id, downloaded
    (or found in the cache) by :func:`megamoe_convert.hub.pull.resolve_source`."""
    path = Path(src)
    if path.exists():
        return path
    try:
        from megamoe_convert.hub.pull import resolve_source as hub_resolve
    except ImportError:
        return path
    return hub_resolve(src, revision)
