"""``megamoe pull``: download a pushed conversion, only the ranks (or a store's byte ranges) a node serves."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from megamoe_convert.cli._run import print_json, run_command
from megamoe_convert.cli.options import JsonOption
from megamoe_convert.ui import human_bytes, status


def pull(
    repo_id: Annotated[str, typer.Argument(help="Hugging Face repo of a pushed conversion (owner/name).")],
    ranks: Annotated[Optional[str], typer.Option(help="Only these ranks' shards, e.g. 0-7 or 8,9 "
                                                      "(default: every converted rank).")] = None,
    local_dir: Annotated[Optional[Path], typer.Option(help="Download into this directory (default: the "
                                                           "Hugging Face cache; the path is printed).")] = None,
    revision: Annotated[Optional[str], typer.Option(help="Branch, tag or commit (default: main).")] = None,
    experts_only: Annotated[bool, typer.Option(help="Skip the non-expert shards (model-*.safetensors).")] = False,
    verify: Annotated[bool, typer.Option(help="Check checksums of everything downloaded (sizes are always "
                                              "checked).")] = True,
    force_download: Annotated[bool, typer.Option(help="Download again even if present (after a checksum "
                                                      "failure).")] = False,
    as_json: JsonOption = False,
    ep_size: Annotated[Optional[int], typer.Option(min=1, help="A store: the EP size the node serves at; just "
                                                               "the byte ranges --ranks read are fetched "
                                                               "(needs --local-dir).")] = None,
    num_redundant_experts: Annotated[int, typer.Option(min=0, help="With --ep-size: redundant experts.")] = 0,
    placement_file: Annotated[Optional[Path], typer.Option("--placement", help="With --ep-size: JSON list, "
                                                                             "logical expert of every slot.")] = None,
    engine: Annotated[Optional[str], typer.Option(help="With --ep-size: whose per-layer placement rule (vllm, "
                                                       "sglang; default: the engine that serves the store's "
                                                       "family).")] = None,
) -> None:
    """Download the manifest, small files, non-expert shards and just the named ranks' shards of a
    pushed conversion, then verify them against manifest.json. Honours HF_HUB_OFFLINE and the cache.
    A store with --ep-size: just the byte ranges of its expert files that --ranks read.
    \f
    Examples::

        # ranks 0-3 into the hub's cache; prints the local path
        megamoe pull owner/V4-Flash-ep8 --ranks 0-3
        megamoe pull owner/V4-Flash-ep8 --ranks 4-7 --local-dir node1
        # a store: only the byte ranges ranks 0-7 of EP 16 read
        megamoe pull owner/V4-Flash-store --ep-size 16 --ranks 0-7 \\
            --local-dir node0
    """
    from megamoe_convert.hub.pull import pull as hub_pull

    local_dir = local_dir.resolve() if local_dir is not None else None  # --json reports absolute paths
    if ep_size is not None:
        _pull_ranges(repo_id, ranks, local_dir, revision, experts_only, verify, as_json, ep_size,
                     num_redundant_experts, placement_file, engine)
        return

    def body() -> None:
        result = hub_pull(repo_id, ranks, local_dir, revision, non_expert=not experts_only, verify=verify,
                          force_download=force_download)
        data = result.to_json()
        if as_json:
            print_json(data)
        else:
            status(f"[green]pulled[/green] {repo_id}@{result.commit[:12]} ranks "
                   f"{','.join(map(str, result.ranks))} into {escape(str(result.path))} ({data['files']} files, "
                   f"{human_bytes(data['bytes'])}, {data['verified']}s verified)")
            print(result.path)
    run_command(body)


def _pull_ranges(repo_id: str, ranks: Optional[str], local_dir: Optional[Path], revision: Optional[str],
                 experts_only: bool, verify: bool, as_json: bool, ep_size: int, redundant: int,
                 placement_file: Optional[Path], engine: Optional[str]) -> None:
    """``pull --ep-size``: just the byte ranges of a store that the named ranks read."""
    from megamoe_convert.errors import HubError
    from megamoe_convert.hub.ranges import pull_ranges

    def body() -> None:
        if local_dir is None:
            raise HubError("pull --ep-size writes the store's ranges into --local-dir (partial files do not "
                           "belong in the Hugging Face cache): give --local-dir")
        data = pull_ranges(repo_id, local_dir, ep_size, ranks, num_redundant=redundant,
                           placement_file=placement_file, engine=engine, revision=revision,
                           non_expert=not experts_only, verify=verify)
        if as_json:
            print_json(data)
        else:
            status(f"[green]pulled[/green] {repo_id}@{data['commit'][:12]} ranks "
                   f"{','.join(map(str, data['ranks']))} of EP {ep_size} into {escape(str(local_dir))}: "
                   f"{human_bytes(data['fetched_bytes'])} of the store's "
                   f"{human_bytes(data['store_expert_bytes'])} in {data['requests']} ranged reads")
            print(local_dir)
    run_command(body)
