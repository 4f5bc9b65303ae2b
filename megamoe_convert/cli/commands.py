"""The ``megamoe`` command line: the app, its shared error handling and output, and the core commands
(synth, inspect, plan, convert). ``cli/__init__.py`` adds the commands kept in modules of their own."""

from __future__ import annotations

import errno
import json
import sys
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional

import typer
from rich.table import Table

from megamoe_convert import __version__
from megamoe_convert.devices import Device
from megamoe_convert.jsonio import one_line
from megamoe_convert.ui import ByteProgress, err_console, human_bytes, out_console

if TYPE_CHECKING:
    from megamoe_convert.placement import Placement

app = typer.Typer(
    name="megamoe",
    help="Pre-bake DeepSeek-V4, DeepSeek-V4.1 and Kimi-K3 MoE experts into DeepGEMM's MegaMoE per-rank layout, "
         "offline, "
         "so that vLLM ranks load them with no transform work.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain click help: option names are never cut at 80 columns (CI logs)
)

_state: dict[str, Any] = {"debug": False, "command": None}  # "command": the subcommand running

#: Commands that write only through temporary files and, rerun, go on from where they stopped:
#: after a full disk, only they can say "nothing partial was kept: rerun to resume".
RESUMABLE_COMMANDS = frozenset({"convert", "merge"})


def _known_errors() -> tuple[type[BaseException], ...]:
    from megamoe_convert.devices import DeviceError
    from megamoe_convert.layout import LayoutError
    from megamoe_convert.output.manifest import ManifestError
    from megamoe_convert.output.state import ConvertError
    from megamoe_convert.placement import PlacementError
    from megamoe_convert.serve.errors import LoadError
    from megamoe_convert.serve.hub import HubError
    from megamoe_convert.source.checkpoint import CheckpointError
    from megamoe_convert.source.families import FamilyError
    from megamoe_convert.source.formats import FormatError
    from megamoe_convert.source.safetensors_io import SafetensorsError
    from megamoe_convert.synth.write import SynthError
    return (CheckpointError, ConvertError, DeviceError, FormatError, HubError, LayoutError, LoadError, ManifestError,
            PlacementError, SafetensorsError, SynthError, FamilyError, OSError)


def run_command(body: Callable[[], Any]) -> Any:
    """Run a command body; expected failures become one line on stderr and exit code 2."""
    try:
        return body()
    except KeyboardInterrupt:
        err_console.print("[red]interrupted[/red]: rerun the same command to resume")
        raise typer.Exit(130) from None
    except _known_errors() as e:
        if _state["debug"]:
            raise
        message = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename and e.strerror else str(e)
        disk_full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
        if disk_full and _state["command"] in RESUMABLE_COMMANDS:
            message += " (nothing partial was kept: free space and rerun the same command to resume)"
        print(f"error: {one_line(message)}", file=sys.stderr)
        raise typer.Exit(2) from None


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def _print_version(requested: bool) -> None:
    """Eager, so that ``megamoe --version`` answers without a command."""
    if requested:
        print(f"megamoe-convert {__version__}")
        raise typer.Exit(0)


@app.callback()
def main_options(
    ctx: typer.Context,
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks instead of one-line errors.")] = False,
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    _state["debug"] = debug
    _state["command"] = ctx.invoked_subcommand


# --------------------------------------------------------------------------------------
# synth
# --------------------------------------------------------------------------------------

#: ``synth`` presets (``configs/``): DeepSeek-V4 tiny / Flash / Pro, DeepSeek-V4.1 tiny / Flash, Kimi-K3 tiny / full.
Preset = Enum("Preset", {name.replace("-", "_").replace(".", "_"): name for name in
                         ("tiny", "flash", "pro", "v4.1-tiny", "v4.1-flash", "kimi-k3-tiny", "kimi-k3")}, type=str)


class WeightDtype(str, Enum):
    int8 = "int8"
    uint8 = "uint8"
    float4 = "float4"


class ScaleDtype(str, Enum):
    e8m0 = "e8m0"
    uint8 = "uint8"


@app.command()
def synth(
    out: Annotated[Path, typer.Argument(help="Directory to write the checkpoint into.")],
    preset: Annotated[Preset, typer.Option(help="Model family and dimensions: tiny (DeepSeek-V4, tests), flash/pro "
                                                "(real DeepSeek-V4 dims), v4.1-flash (DeepSeek-V4.1), kimi-k3 (Kimi-K3), "
                                                "*-tiny for tests; cut real ones down with --layers/--experts.")
                      ] = Preset.tiny,  # type: ignore[attr-defined]
    layers: Annotated[Optional[int], typer.Option(min=1, help="Decoder layers (default: the preset's).")] = None,
    experts: Annotated[Optional[int], typer.Option(min=1, help="Routed experts per layer (default: the preset's).")] = None,
    mtp_layers: Annotated[Optional[int], typer.Option(min=0, help="MTP blocks (default: the preset's).")] = None,
    seed: Annotated[int, typer.Option(min=0, help="Random seed (same seed, same bytes).")] = 0,
    weight_format: Annotated[str, typer.Option(
        "--format", help="Routed experts' MegaMoE weight format: mxfp4 (DeepSeek-V4's), mxfp8, nvfp4 or bf16.")] = "mxfp4",
    weight_dtype: Annotated[Optional[WeightDtype], typer.Option(
        help="Stored dtype of packed FP4 expert weights (mxfp4; default int8).")] = None,
    scale_dtype: Annotated[Optional[ScaleDtype], typer.Option(
        help="Stored dtype of UE8M0 expert scales (mxfp4; default e8m0).")] = None,
    shard_mb: Annotated[Optional[float], typer.Option(min=0.001, help="Shard size in MB (default: 0.4 of a layer's "
                                                           "experts, so layers span shards).")] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace OUT if it is not empty.")] = False,
) -> None:
    """Write a random checkpoint of a supported model family (real tensor names, FP4 experts, size-cut shards)."""
    from megamoe_convert.source.families import detect
    from megamoe_convert.synth.write import synthesize

    def body() -> None:
        with ByteProgress(f"synth {preset.value}") as progress:
            config = synthesize(out, preset.value, layers=layers, experts=experts, mtp_layers=mtp_layers, seed=seed,
                                weight_format=weight_format, weight_dtype=weight_dtype and weight_dtype.value,
                                scale_dtype=scale_dtype and scale_dtype.value,
                                shard_bytes=int(shard_mb * 1e6) if shard_mb else None,
                                progress=progress, overwrite=overwrite)
        family = detect(config, preset.value)
        text, keys = family.text(config), family.keys
        err_console.print(f"wrote {out} ({family.title}: {text[keys['layers']]} layers + "
                          f"{text.get(keys['mtp_layers'], 0)} MTP, {text[keys['experts']]} experts, "
                          f"H={text[keys['hidden']]}"
                          f"{'' if keys['hidden'] == 'hidden_size' else ' (' + keys['hidden'] + ')'}, "
                          f"I={text[keys['intermediate']]})")
    run_command(body)


# --------------------------------------------------------------------------------------
# inspect / plan
# --------------------------------------------------------------------------------------

class Engine(str, Enum):
    vllm = "vllm"
    sglang = "sglang"


#: ``--engine``: whose per-layer expert placement to use (SGLang builds the MTP layer its own way).
EngineOption = Annotated[Engine, typer.Option(help="Serving engine whose expert placement the ranks follow: "
                                                   "SGLang builds the MTP layer without redundant experts.")]

#: ``--revision`` of the commands that read a source checkpoint.
RevisionOption = Annotated[Optional[str], typer.Option(help="SRC is a hub repo id: branch, tag or commit to "
                                                            "download (default: main).")]

@app.command()
def inspect(
    src: Annotated[str, typer.Argument(help="Checkpoint directory, or a store (what each rank reads of it).")],
    ep_size: Annotated[int, typer.Option(min=1, help="EP size used for the bytes-per-rank column.")] = 8,
    num_redundant_experts: Annotated[int, typer.Option(min=0, help="Redundant experts (EPLB).")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary on stdout.")] = False,
    revision: RevisionOption = None,
) -> None:
    """Show what a checkpoint holds: MoE layers (incl. MTP), experts, dims, dtypes, bytes per rank,
    and which engines can serve its shapes."""
    from megamoe_convert.engines import describe_engines, shape_refusals
    from megamoe_convert.placement import Placement
    from megamoe_convert.source.checkpoint import Checkpoint

    def body() -> None:
        if _store_reads(src, as_json, ep_size, num_redundant_experts):
            return
        ckpt = Checkpoint.open(resolve_source(src, revision))
        placement = Placement.default(ckpt.dims.n_routed_experts, ep_size, num_redundant_experts)
        per_expert = ckpt.dims.bytes_per_expert()
        first = ckpt.layers[0]
        dtypes = {f"{p}.{k}": ckpt.expert_entry(first, 0, p, k).dtype for p, k in ckpt.dims.expert_byte_shapes()}
        summary = {
            "path": str(ckpt.root), "model_type": ckpt.config.get("model_type"),
            "family": ckpt.family.name, "model_family": ckpt.family.title,
            "weight_format": ckpt.dims.weight_format, "shared_expert": ckpt.dims.shared_intermediate_size or None,
            "shared_expert_note": ckpt.shared_expert_note,
            "dims": ckpt.dims.__dict__, "moe_layers": [l.key for l in ckpt.layers],
            "mtp_layers": [l.key for l in ckpt.layers if l.is_mtp], "expert_dtypes": dtypes,
            "shards": len(ckpt.headers), "tensors": len(ckpt.tensors),
            "expert_bytes": ckpt.expert_bytes(), "non_expert_bytes": sum(e.nbytes for e in ckpt.non_expert_tensors()),
            "ep_size": ep_size, "experts_per_rank": placement.experts_per_rank,
            "expert_bytes_per_rank": per_expert * placement.experts_per_rank * len(ckpt.layers),
            "engines": shape_refusals(ckpt.dims.hidden_size, ckpt.dims.moe_intermediate_size, ckpt.family),
        }
        if as_json:
            print_json(summary)
            return
        table = Table(title=f"{ckpt.root}", show_header=False)
        table.add_column("", style="bold")
        table.add_column("")
        d = ckpt.dims
        table.add_row("model family / weight format", f"{ckpt.family.title} ({summary['model_type']}) / {d.weight_format}")
        table.add_row("fused shared expert", f"pre-baked (intermediate {d.shared_intermediate_size})"
                      if d.shared_intermediate_size else f"not pre-baked: {ckpt.shared_expert_note}")
        table.add_row("hidden / intermediate", f"{d.hidden_size} / {d.moe_intermediate_size}")
        table.add_row("routed experts", f"{d.n_routed_experts}" + (f" (MTP layers: {d.mtp_n_routed_experts})"
                                                                   if d.mtp_n_routed_experts else ""))
        decoder = [l for l in ckpt.layers if not l.is_mtp]
        table.add_row("MoE layers", f"{len(decoder)} decoder + {len(summary['mtp_layers'])} MTP")
        table.add_row("expert dtypes", ", ".join(f"{k}={v}" for k, v in dtypes.items()))
        table.add_row("shards / tensors", f"{summary['shards']} / {summary['tensors']}")
        table.add_row("expert bytes", human_bytes(summary["expert_bytes"]))
        table.add_row("non-expert bytes", human_bytes(summary["non_expert_bytes"]))
        table.add_row(f"expert bytes per rank (EP {ep_size})",
                      f"{human_bytes(summary['expert_bytes_per_rank'])} ({placement.experts_per_rank} slots/layer)")
        table.add_row("served by", describe_engines(d.hidden_size, d.moe_intermediate_size, ckpt.family))
        out_console.print(table)
    run_command(body)


@app.command()
def plan(
    src: Annotated[str, typer.Argument(help="Checkpoint directory, or a store (what each rank reads of it).")],
    ep_size: Annotated[int, typer.Option(min=1, help="Expert-parallel size (number of ranks).")],
    num_redundant_experts: Annotated[int, typer.Option(min=0, help="Redundant experts (EPLB).")] = 0,
    placement_file: Annotated[Optional[Path], typer.Option("--placement", help="JSON list: logical expert id of "
                                                                             "every physical slot.")] = None,
    engine: EngineOption = Engine.vllm,
    as_json: Annotated[bool, typer.Option("--json", help="Print the placement as JSON on stdout.")] = False,
    revision: RevisionOption = None,
) -> None:
    """Print which logical experts every rank's slots hold, per layer where the engine's rule
    differs (SGLang's MTP layer, DeepSeek-V4.1's DSpark MTP layers), and which engines can serve
    the checkpoint's shapes."""
    from megamoe_convert.convert.plan import ConvertOptions, make_placement
    from megamoe_convert.engines import describe_engines, shape_refusals
    from megamoe_convert.placement import layer_placement
    from megamoe_convert.source.checkpoint import Checkpoint

    def body() -> None:
        if _store_reads(src, as_json, ep_size, num_redundant_experts, placement_file, engine.value):
            return
        ckpt = Checkpoint.open(resolve_source(src, revision))
        placement = make_placement(ckpt, ConvertOptions(ep_size, num_redundant_experts, placement_file,
                                                        engine=engine.value))
        own = {l.key: p for l in ckpt.layers
               if (p := layer_placement(engine.value, placement, l.is_mtp, ckpt.dims.experts_of(l))) != placement}
        d = ckpt.dims
        if as_json:
            print_json({**placement.to_json(), "engine": engine.value,
                        "layer_placements": {key: p.to_json() for key, p in own.items()},
                        "engines": shape_refusals(d.hidden_size, d.moe_intermediate_size, ckpt.family)})
            return
        out_console.print(_placement_table(placement, "every MoE layer" if not own else "decoder layers"))
        for key, p in own.items():
            out_console.print(_placement_table(p, f"{key} ({engine.value})"))
        out_console.print(f"served by: {describe_engines(d.hidden_size, d.moe_intermediate_size, ckpt.family)}")
    run_command(body)


def _store_reads(src: str, as_json: bool, *args: Any) -> bool:
    """``inspect`` / ``plan`` of a store: what each rank reads of it (``cli/store.py``); False for anything else."""
    from megamoe_convert.cli.store import reads_table, store_manifest, store_reads

    manifest = store_manifest(src)
    if manifest is None:
        return False
    data = store_reads(src, manifest, *args)
    if as_json:
        print_json(data)
    else:
        out_console.print(reads_table(data))
    return True


def _placement_table(placement: "Placement", what: str) -> Table:
    table = Table(title=f"{what}, EP {placement.ep_size}: {placement.n_physical} physical slots for "
                        f"{placement.n_logical} logical experts ({placement.experts_per_rank} per rank)")
    for col in ("rank", "physical slots", "logical experts"):
        table.add_column(col)
    for rank in range(placement.ep_size):
        start = placement.experts_start(rank)
        table.add_row(str(rank), f"{start}..{start + placement.experts_per_rank - 1}",
                      _short_list(placement.rank_logical_ids(rank)))
    return table


def _short_list(ids: tuple[int, ...]) -> str:
    text = ", ".join(map(str, ids))
    return text if len(text) < 80 else text[:76] + " ..."


def resolve_source(src: str, revision: str | None = None) -> Path:
    """A local directory (hub repo ids are resolved by :mod:`.hub` where available)."""
    path = Path(src)
    if path.exists():
        return path
    try:
        from megamoe_convert.serve.hub import resolve_source as hub_resolve
    except ImportError:
        return path
    return hub_resolve(src, revision)


# --------------------------------------------------------------------------------------
# convert
# --------------------------------------------------------------------------------------

class ShardBy(str, Enum):
    layer = "layer"
    rank = "rank"


@app.command()
def convert(
    src: Annotated[str, typer.Argument(help="DeepSeek-V4, V4.1 or Kimi-K3 checkpoint directory (config.json + "
                                            "safetensors index), "
                                            "or a Hugging Face repo id (owner/name).")],
    out: Annotated[Path, typer.Argument(help="Output model directory (new, empty, or a previous run to resume).")],
    ep_size: Annotated[Optional[int], typer.Option(min=1, help="Expert-parallel size the model will be served with "
                                                               "(per-rank files). Without it: a store of every "
                                                               "logical expert once, served at any EP size.")] = None,
    num_redundant_experts: Annotated[int, typer.Option(min=0, help="Redundant experts (EPLB); n_routed + this must "
                                                            "divide by --ep-size.")] = 0,
    placement_file: Annotated[Optional[Path], typer.Option("--placement", help="JSON list: logical expert id of "
                                                                             "every physical slot.")] = None,
    device: Annotated[Device, typer.Option(help="Where the layout transform runs (same bytes either way).")] = Device.cpu,
    workers: Annotated[int, typer.Option(min=0, help="Parallel files in flight (0: one per core, at most 8).")] = 0,
    ranks: Annotated[Optional[str], typer.Option(help="Only these ranks, e.g. 0,3-5 (default: all).")] = None,
    layers: Annotated[Optional[str], typer.Option(help="Only these MoE layers, e.g. 0-3,mtp.0 (default: all).")] = None,
    experts_only: Annotated[bool, typer.Option(help="Skip copying the non-expert tensors.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an OUT made with different options.")] = False,
    chunk_mb: Annotated[int, typer.Option(min=1, help="Experts read and transformed per step, in MB (bounds memory).")] = 32,
    no_fsync: Annotated[bool, typer.Option("--no-fsync", help="Skip fsync before renames (faster; not "
                                                              "crash-durable on power loss).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary on stdout.")] = False,
    revision: RevisionOption = None,
    shard: Annotated[Optional[str], typer.Option(help="Convert only part I of N (0-based, e.g. 3/8), to run one "
                                                      "conversion on N machines; see `megamoe merge`.")] = None,
    shard_by: Annotated[ShardBy, typer.Option(help="What --shard splits the expert shards by.")] = ShardBy.layer,
    auto_merge: Annotated[bool, typer.Option(help="With --shard: the last part to finish in a shared OUT writes "
                                                  "the manifest (merges all parts).")] = True,
    engine: EngineOption = Engine.vllm,
) -> None:
    """Convert a checkpoint into per-rank MegaMoE shards (--ep-size) or a rank-agnostic store (experts/,
    every logical expert once), non-expert shards and manifest.json.

    Streaming (memory bounded by --workers x --chunk-mb), atomic (temp file + rename,
    manifest last) and resumable: rerun the same command after a crash or Ctrl-C.
    """
    from megamoe_convert.convert.plan import ConvertOptions, parse_shard
    from megamoe_convert.convert.run import convert as run_convert

    options = ConvertOptions(ep_size=ep_size, num_redundant_experts=num_redundant_experts,
                             placement_file=placement_file, device=device.value, workers=workers, ranks=ranks,
                             layers=layers, experts_only=experts_only, overwrite=overwrite,
                             chunk_bytes=chunk_mb << 20, fsync=not no_fsync, shard_by=shard_by.value,
                             auto_merge=auto_merge, engine=engine.value)

    def body() -> None:
        options.shard = parse_shard(shard) if shard is not None else None
        with ByteProgress("convert" if shard is None else f"convert part {shard}", quiet=False) as progress:
            summary = run_convert(resolve_source(src, revision), out, options, progress)
        data = summary.to_json()
        if as_json:
            print_json(data)
        elif shard is not None:
            err_console.print(f"[green]done[/green]: part {shard} in {out} ({data['files_written']} files written, "
                              f"{data['files_skipped']} already done, {human_bytes(data['bytes_written'])} in "
                              f"{data['seconds']:.1f} s); " + ("all parts present: merged, manifest.json written"
                                                               if data["merged"] else
                                                               "run `megamoe merge` once every part is done"))
        else:
            err_console.print(f"[green]done[/green]: {out} ({data['files_written']} files written, "
                              f"{data['files_skipped']} already done, {human_bytes(data['bytes_written'])} in "
                              f"{data['seconds']:.1f} s)")
    run_command(body)
