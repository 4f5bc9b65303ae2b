"""``megamoe push``: publish a conversion on the Hugging Face hub."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from megamoe_convert.cli._run import print_json, run_command
from megamoe_convert.cli.options import JsonOption
from megamoe_convert.ui import human_bytes, status


def push(
    out: Annotated[Path, typer.Argument(help="A finished converted directory (with manifest.json).")],
    repo_id: Annotated[str, typer.Argument(help="Hugging Face model repo (owner/name); created if needed.")],
    revision: Annotated[Optional[str], typer.Option(help="Branch to push to (created from main if needed; "
                                                         "default: main).")] = None,
    private: Annotated[bool, typer.Option(help="Create the repo private (an existing repo keeps its "
                                               "visibility).")] = False,
    verify: Annotated[bool, typer.Option(help="Check every file's checksum before uploading (sizes are "
                                              "always checked).")] = False,
    as_json: JsonOption = False,
) -> None:
    """Upload a conversion to the Hugging Face hub: data first (resumable), then manifest.json and a
    generated model card (README.md) in one last commit. Rerun the same command to resume.
    \f
    Examples::

        megamoe push V4-Flash-ep8 owner/V4-Flash-ep8
        megamoe push V4-Flash-store owner/V4-Flash-store --private --verify
        megamoe push V4-Flash-ep8 owner/V4-Flash-ep8 --revision ep8-r32
    """
    from megamoe_convert.hub.push import push as hub_push

    out = out.resolve()  # --json reports absolute paths

    def body() -> None:
        result = hub_push(out, repo_id, revision=revision, private=private, verify=verify)
        if as_json:
            print_json(result)
        else:
            status(f"[green]pushed[/green] {escape(str(out))} to {result['url']} @ {result['revision']} "
                   f"({result['files']} files, {human_bytes(result['bytes'])}, EP {result['ep_size']})")
    run_command(body)
