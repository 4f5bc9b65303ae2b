"""``megamoe convert``: a checkpoint into per-rank MegaMoE files, or a store every EP size reads."""

from __future__ import annotations

import shlex
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from megamoe_convert.cli._run import print_json, run_command
from megamoe_convert.cli.options import (
    EngineOption,
    JsonOption,
    PlacementOption,
    RevisionOption,
    resolve_source,
)
from megamoe_convert.devices import Device
from megamoe_convert.source import engines_table
from megamoe_convert.ui import ByteProgress, human_bytes, status


class ShardBy(str, Enum):
    layer = "layer"
    rank = "rank"


def convert(
    src: Annotated[str, typer.Argument(help=f"Checkpoint directory of a family an engine serves "
                                            f"({engines_table.family_titles()}): config.json + safetensors "
                                            "index, or a Hugging Face repo id (owner/name).")],
    out: Annotated[Path, typer.Argument(help="Output model directory (new, empty, or a previous run to resume).")],
    ep_size: Annotated[Optional[int], typer.Option(min=1, help="Expert-parallel size the model will be served with "
                                                               "(per-rank files). Without it: a store of every "
                                                               "logical expert once, served at any EP size.")] = None,
    num_redundant_experts: Annotated[int, typer.Option(min=0, help="Redundant experts (EPLB); n_routed + this must "
                                                            "divide by --ep-size.")] = 0,
    placement_file: PlacementOption = None,
    device: Annotated[Device, typer.Option(
        help="Where the layout transform runs (same bytes either way).")] = Device.cpu,
    workers: Annotated[int, typer.Option(min=0, help="Parallel files in flight (0: one per core, at most 8).")] = 0,
    ranks: Annotated[Optional[str], typer.Option(help="Only these ranks, e.g. 0,3-5 (default: all).")] = None,
    layers: Annotated[Optional[str], typer.Option(help="Only these MoE layers, e.g. 0-3,mtp.0 (default: all).")] = None,
    experts_only: Annotated[bool, typer.Option(help="Skip copying the non-expert tensors.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an OUT made with different options.")] = False,
    chunk_mb: Annotated[int, typer.Option(
        min=1, help="Experts read and transformed per step, in MB (bounds memory).")] = 32,
    no_fsync: Annotated[bool, typer.Option("--no-fsync", help="Skip fsync before renames (faster; not "
                                                              "crash-durable on power loss).")] = False,
    as_json: JsonOption = False,
    revision: RevisionOption = None,
    shard: Annotated[Optional[str], typer.Option(help="Convert only part I of N (0-based, e.g. 3/8), to run one "
                                                      "conversion on N machines; see `megamoe merge`.")] = None,
    shard_by: Annotated[ShardBy, typer.Option(help="What --shard splits the expert shards by.")] = ShardBy.layer,
    auto_merge: Annotated[bool, typer.Option(help="With --shard: the last part to finish in a shared OUT writes "
                                                  "the manifest (merges all parts).")] = True,
    engine: EngineOption = None,
) -> None:
    """Convert a checkpoint into per-rank MegaMoE shards (--ep-size) or a rank-agnostic store (experts/,
    every logical expert once), non-expert shards and manifest.json.

    Streaming (memory bounded by --workers x --chunk-mb), atomic (temp file + rename,
    manifest last) and resumable: rerun the same command after a crash or Ctrl-C.
    \f
    Examples::

        # per-rank files for EP 8
        megamoe convert V4-Flash V4-Flash-ep8 --ep-size 8
        # no --ep-size: a store, which serves every EP size
        megamoe convert V4-Flash V4-Flash-store
        # DeepSeek-V3 / Qwen3-MoE (FP8): SGLang's Hopper placement, their engine's
        megamoe convert DeepSeek-V3 V3-ep8 --ep-size 8
        # from the hub, with redundant experts
        megamoe convert deepseek-ai/DeepSeek-V4.1-Flash V4.1-ep16 \\
            --ep-size 16 --num-redundant-experts 32
        # part 3 of 8 of one conversion (then: megamoe merge)
        megamoe convert V4-Pro /shared/V4-Pro-ep64 --ep-size 64 --shard 3/8
    """
    from megamoe_convert.convert.plan import ConvertOptions, parse_shard
    from megamoe_convert.convert.run import convert as run_convert

    options = ConvertOptions(ep_size=ep_size, num_redundant_experts=num_redundant_experts,
                             placement_file=placement_file, device=device.value, workers=workers, ranks=ranks,
                             layers=layers, experts_only=experts_only, overwrite=overwrite,
                             chunk_bytes=chunk_mb << 20, fsync=not no_fsync, shard_by=shard_by.value,
                             auto_merge=auto_merge, engine=engine and engine.value)

    def body() -> None:
        from megamoe_convert.cli.outputs import refuse_as_source

        refuse_as_source(src, "convert")
        options.shard = parse_shard(shard) if shard is not None else None
        with ByteProgress("convert" if shard is None else f"convert part {shard}", quiet=False) as progress:
            summary = run_convert(resolve_source(src, revision), out, options, progress)
        data = summary.to_json()
        data["engine_problems"] = _engine_problems(out, data)
        if as_json:
            print_json(data)
        else:
            status(done_line(out, data, shard))
    run_command(body)


def _engine_problems(out: Path, data: dict[str, Any]) -> list[str]:
    """Why the engine converted for cannot serve what was written (its shapes, its weight format):
    said on the done line rather than "serve it"; empty for a store (any engine) or an unmerged part."""
    from megamoe_convert.cli.describe import engine_problems
    from megamoe_convert.output.manifest import read_manifest

    if data.get("store") or not (out / "manifest.json").is_file():
        return []
    manifest = read_manifest(out)
    data["engine"] = manifest.engine
    return engine_problems(manifest.engine, manifest)


def done_line(out: Path, data: dict[str, Any], shard: str | None) -> str:
    """The ``done:`` line of ``convert``: what was written, how fast, and whether it is partial."""
    rate = (f", {human_bytes(data['bytes_written'] / data['write_seconds'])}/s"
            if data["write_seconds"] > 0 and data["bytes_written"] else "")
    work = (f"{data['files_written']} files written, {data['files_skipped']} already done, "
            f"{human_bytes(data['bytes_written'])} in {data['seconds']:.1f} s{rate}")
    if shard is not None:
        return (f"[green]done[/green]: part {shard} in {escape(str(out))} ({work}); " + (
            "all parts present: merged, manifest.json written" if data["merged"] else
            "run `megamoe merge` once every part is done"))
    coverage = data["coverage"]
    tail = (f"; [yellow]partial[/yellow]: {escape(coverage['note'])}" if coverage["partial"] else
            f"; [yellow]{data['engine']} cannot serve it[/yellow]: {escape('; '.join(data['engine_problems']))} (the "
            "files are right: verify and load_rank read them)" if data.get("engine_problems") else
            f"; serve it: megamoe inspect {escape(shlex.quote(str(out)))}")
    what = (" is a store (no --ep-size: every logical expert once, served at any EP size; --ep-size N writes "
            "per-rank files instead)" if data.get("store") else "")
    return f"[green]done[/green]: {escape(str(out))}{what} ({work}){tail}"
