"""``megamoe merge``: assemble the parts of a conversion split over machines (``convert --shard I/N``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from megamoe_convert.cli._run import print_json, run_command
from megamoe_convert.cli.options import JsonOption
from megamoe_convert.ui import ByteProgress, human_bytes, status


def merge(
    out: Annotated[Path, typer.Argument(help="Where the merged conversion goes: a new directory, the shared "
                                             "directory the parts were written into, or one of the parts.")],
    parts: Annotated[Optional[list[Path]], typer.Argument(help="Directories holding parts (from "
                                                               "`megamoe convert --shard I/N`); OUT is "
                                                               "always searched too.")] = None,
    verify: Annotated[bool, typer.Option(help="Re-check every file's checksum (sizes are always "
                                              "checked).")] = True,
    workers: Annotated[int, typer.Option(min=0, help="Files checked/copied in parallel (0: one per core, at most "
                                              "8).")] = 0,
    no_fsync: Annotated[bool, typer.Option("--no-fsync", help="Skip fsync before renames.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Assemble the N parts of a split conversion into one: files hard-linked (or copied) into OUT and
    re-checked, then the non-expert index and manifest.json, byte for byte what one machine writes.
    \f
    Examples::

        # the parts were written into one shared OUT
        megamoe merge /shared/V4-Pro-ep64
        # the parts were written apart
        megamoe merge V4-Pro-ep64 /scratch/part-0 /scratch/part-1
    """
    from megamoe_convert.convert.fleet import merge as run_merge

    out, parts = out.resolve(), [p.resolve() for p in parts or []]  # --json reports absolute paths

    def body() -> None:
        with ByteProgress("merge", quiet=False) as progress:
            result = run_merge(out, parts or [], verify=verify, fsync=not no_fsync, workers=workers,
                               progress=progress)
        if as_json:
            print_json(result)
        else:
            status(f"[green]merged[/green] {result['parts']} parts into {escape(str(out))} ({result['files']} "
                   f"files, {human_bytes(result['bytes'])}: {result['linked']} linked, "
                   f"{result['copied']} copied, {result['in_place'] + result['present']} already "
                   f"in place; {result['verified']}s verified)")
    run_command(body)
