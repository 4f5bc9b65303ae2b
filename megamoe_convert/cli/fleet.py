"""`megamoe` commands for fleet (registered into the main app by cli/commands.py): push, pull, merge."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from megamoe_convert.ui import ByteProgress, human_bytes, status


def register(app: typer.Typer, run_command: Callable[[Callable[[], Any]], Any],
             print_json: Callable[[Any], None]) -> None:
    """Add this module's commands to `app`."""

    @app.command()
    def push(
        out: Annotated[Path, typer.Argument(help="A finished converted directory (with manifest.json).")],
        repo_id: Annotated[str, typer.Argument(help="Hugging Face model repo (owner/name); created if needed.")],
        revision: Annotated[Optional[str], typer.Option(help="Branch to push to (created from main if needed; "
                                                             "default: main).")] = None,
        private: Annotated[bool, typer.Option(help="Create the repo private (an existing repo keeps its "
                                                   "visibility).")] = False,
        verify: Annotated[bool, typer.Option(help="Check every file's checksum before uploading (sizes are "
                                                  "always checked).")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary on stdout.")] = False,
    ) -> None:
        """Upload a conversion to the Hugging Face hub: data first (resumable), then manifest.json and a
        generated model card (README.md) in one last commit. Rerun the same command to resume."""
        from megamoe_convert.serve.hub import push as hub_push

        out = out.resolve()  # --json reports absolute paths

        def body() -> None:
            result = hub_push(out, repo_id, revision=revision, private=private, verify=verify)
            if as_json:
                print_json(result)
            else:
                status(f"[green]pushed[/green] {out} to {result['url']} @ {result['revision']} "
                                  f"({result['files']} files, {human_bytes(result['bytes'])}, EP {result['ep_size']})")
        run_command(body)

    @app.command()
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
        as_json: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary on stdout.")] = False,
        ep_size: Annotated[Optional[int], typer.Option(min=1, help="A store: the EP size the node serves at; just "
                                                                   "the byte ranges --ranks read are fetched "
                                                                   "(needs --local-dir).")] = None,
        num_redundant_experts: Annotated[int, typer.Option(min=0, help="With --ep-size: redundant experts.")] = 0,
        placement_file: Annotated[Optional[Path], typer.Option("--placement", help="With --ep-size: JSON list, "
                                                                                 "logical expert of every slot.")] = None,
        engine: Annotated[str, typer.Option(help="With --ep-size: whose per-layer placement rule (vllm, sglang).")]
            = "vllm",
    ) -> None:
        """Download the manifest, small files, non-expert shards and just the named ranks' shards of a
        pushed conversion, then verify them against manifest.json. Honours HF_HUB_OFFLINE and the cache.
        A store with --ep-size: just the byte ranges of its expert files that --ranks read."""
        from megamoe_convert.serve.hub import pull as hub_pull

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
                                  f"{','.join(map(str, result.ranks))} into {result.path} ({data['files']} files, "
                                  f"{human_bytes(data['bytes'])}, {data['verified']}s verified)")
                print(result.path)
        run_command(body)

    def _pull_ranges(repo_id: str, ranks: Optional[str], local_dir: Optional[Path], revision: Optional[str],
                     experts_only: bool, verify: bool, as_json: bool, ep_size: int, redundant: int,
                     placement_file: Optional[Path], engine: str) -> None:
        from megamoe_convert.serve.hub import HubError
        from megamoe_convert.serve.hub_ranges import pull_ranges

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
                       f"{','.join(map(str, data['ranks']))} of EP {ep_size} into {local_dir}: "
                       f"{human_bytes(data['fetched_bytes'])} of the store's "
                       f"{human_bytes(data['store_expert_bytes'])} in {data['requests']} ranged reads")
                print(local_dir)
        run_command(body)

    @app.command()
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
        as_json: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary on stdout.")] = False,
    ) -> None:
        """Assemble the N parts of a split conversion into one: files hard-linked (or copied) into OUT and
        re-checked, then the non-expert index and manifest.json, byte for byte what one machine writes."""
        from megamoe_convert.convert.fleet import merge as run_merge

        out, parts = out.resolve(), [p.resolve() for p in parts or []]  # --json reports absolute paths

        def body() -> None:
            with ByteProgress("merge", quiet=False) as progress:
                result = run_merge(out, parts or [], verify=verify, fsync=not no_fsync, workers=workers,
                                   progress=progress)
            if as_json:
                print_json(result)
            else:
                status(f"[green]merged[/green] {result['parts']} parts into {out} ({result['files']} "
                                  f"files, {human_bytes(result['bytes'])}: {result['linked']} linked, "
                                  f"{result['copied']} copied, {result['in_place'] + result['present']} already "
                                  f"in place; {result['verified']}s verified)")
        run_command(body)
