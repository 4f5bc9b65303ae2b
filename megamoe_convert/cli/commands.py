"""The ``megamoe`` command line: the app, its shared error handling and output, and the core commands
(synth, convert). ``cli/__init__.py`` adds the commands kept in modules of their own (inspect and plan,
verify, fleet) and applies the conventions of ``cli/conventions.py``."""

from __future__ import annotations

import errno
import json
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from megamoe_convert import __version__
from megamoe_convert.devices import Device
from megamoe_convert.jsonio import one_line
from megamoe_convert.cli import conventions
from megamoe_convert.ui import ByteProgress, human_bytes, status

app = typer.Typer(
    name="megamoe", context_settings={"help_option_names": conventions.HELP_OPTIONS},
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
    from megamoe_convert.output.manifest import VerifyUsageError
    return (VerifyUsageError, CheckpointError, ConvertError, DeviceError, FormatError, HubError, LayoutError, LoadError, ManifestError,
            PlacementError, SafetensorsError, SynthError, FamilyError, OSError)


def run_command(body: Callable[[], Any]) -> Any:
    """Run a command body; expected failures become one line on stderr (and a JSON object on stdout
    under ``--json``) and exit code 2. Ctrl-C and SIGTERM stop cleanly with a resume hint: 130 / 143."""
    try:
        return body()
    except KeyboardInterrupt as e:
        code = getattr(e, "exit_code", 130)
        what = "terminated (SIGTERM)" if code == 143 else "interrupted"
        hint = ("rerun the same command to resume" if _state["command"] in RESUMABLE_COMMANDS else
                "nothing was changed" if _state["command"] in ("inspect", "plan", "verify") else
                "rerun the same command")
        print(f"{what}: {hint}", file=sys.stderr)
        if conventions.state["json"]:
            conventions.print_json_error(f"{what}: {hint}", code)
        raise typer.Exit(code) from None
    except _known_errors() as e:
        if _state["debug"]:
            raise
        message = f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename and e.strerror else str(e)
        disk_full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
        if disk_full and _state["command"] in RESUMABLE_COMMANDS:
            message += " (nothing partial was kept: free space and rerun the same command to resume)"
        print(f"error: {one_line(message)}", file=sys.stderr)
        if conventions.state["json"]:
            conventions.print_json_error(one_line(message), 2)
        raise typer.Exit(2) from None


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


def done_line(out: Path, data: dict[str, Any], shard: str | None) -> str:
    """The ``done:`` line of ``convert``: what was written, how fast, and whether it is partial."""
    rate = (f", {human_bytes(data['bytes_written'] / data['write_seconds'])}/s"
            if data["write_seconds"] > 0 and data["bytes_written"] else "")
    work = (f"{data['files_written']} files written, {data['files_skipped']} already done, "
            f"{human_bytes(data['bytes_written'])} in {data['seconds']:.1f} s{rate}")
    if shard is not None:
        return (f"[green]done[/green]: part {shard} in {out} ({work}); " + (
            "all parts present: merged, manifest.json written" if data["merged"] else
            "run `megamoe merge` once every part is done"))
    coverage = data["coverage"]
    tail = (f"; [yellow]partial[/yellow]: {coverage['note']}" if coverage["partial"] else
            f"; serve it: megamoe inspect {out}")
    return f"[green]done[/green]: {out} ({work}){tail}"


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
        status(f"wrote {out} ({family.title}: {text[keys['layers']]} layers + "
                          f"{text.get(keys['mtp_layers'], 0)} MTP, {text[keys['experts']]} experts, "
                          f"H={text[keys['hidden']]}"
                          f"{'' if keys['hidden'] == 'hidden_size' else ' (' + keys['hidden'] + ')'}, "
                          f"I={text[keys['intermediate']]})")
    run_command(body)


from megamoe_convert.cli.inspect import Engine, EngineOption, RevisionOption, resolve_source  # noqa: E402


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
        else:
            status(done_line(out, data, shard))
    run_command(body)
