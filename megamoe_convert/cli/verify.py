"""``megamoe verify``: check a conversion against its manifest and, optionally, its source."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from megamoe_convert.cli._run import print_json, run_command
from megamoe_convert.devices import Device
from megamoe_convert.ui import ByteProgress, human_bytes, line, out_console, status

if TYPE_CHECKING:
    from megamoe_convert.output.manifest import Manifest
    from megamoe_convert.source.layers import MoELayer


def verify(
    out: Annotated[Path, typer.Argument(help="Converted directory (output of `megamoe convert`).")],
    source: Annotated[Optional[Path], typer.Option(help="Source checkpoint: re-derive expert slots and "
                                                        "compare bytes; compare non-expert tensors.")] = None,
    ranks: Annotated[Optional[str], typer.Option(help="Only these ranks, e.g. 0,3-5 (default: all).")] = None,
    sample: Annotated[Optional[int], typer.Option(min=1, help="With --source: compare K random expert slots "
                                                       "instead of all.")] = None,
    numerics: Annotated[bool, typer.Option(help="With --source: reference SwiGLU MoE from the pre-baked "
                                                "layout must equal the one from the source, exactly (every MoE "
                                                "layer once, the ranks in turn).")] = False,
    numerics_every_rank: Annotated[bool, typer.Option(help="With --numerics: run it on every rank x layer (the "
                                                           "layout code is the same for every rank).")] = False,
    deep_gemm: Annotated[bool, typer.Option(help="With --source: compare with DeepGEMM's own transform "
                                                 "(needs deep_gemm on an SM100 GPU; skipped otherwise).")] = False,
    device: Annotated[Device, typer.Option(help="Device for --numerics.")] = Device.cpu,
    seed: Annotated[int, typer.Option(min=0, help="Seed for --sample and --numerics.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
) -> None:
    """Check a converted directory: files and checksums, shard tensors, placement; optionally
    bytes and numerics against the source. Exit 0 if all is well (a partial conversion says so),
    1 if problems were found, 2 if OUT is not a conversion (e.g. a source checkpoint).
    \f
    Examples::

        # sizes and checksums
        megamoe verify V4-Flash-ep8
        # only what this node serves
        megamoe verify V4-Flash-ep8 --ranks 0-3
        # bytes and numerics against the source (numerics: --device cuda
        # on a GPU; --ranks or --sample to shorten it on a CPU)
        megamoe verify V4-Flash-ep8 --source V4-Flash --numerics
        megamoe verify V4-Flash-ep8 --source V4-Flash --sample 64 --json
    """
    from megamoe_convert.verify import verify as run_verify

    if source is None:
        for flag, given in (("--numerics", numerics), ("--deep-gemm", deep_gemm), ("--sample", sample is not None)):
            if given:
                raise typer.BadParameter(f"{flag} compares against the source checkpoint: pass --source too",
                                         param_hint=flag)

    def body() -> Any:
        def say_cost() -> None:  # said when numerics starts: after every check that could refuse the source
            if cost := numerics_cost(out, ranks, numerics_every_rank, device.value):
                progress.finish()  # the comparison with the source it follows says it finished first
                status(cost)

        with ByteProgress("verify") as progress:
            report = run_verify(out, source=source, ranks=ranks, sample=sample, numerics=numerics,
                                deep_gemm=deep_gemm, device=device.value, seed=seed, progress=progress,
                                numerics_every_rank=numerics_every_rank, before_numerics=say_cost)
        if as_json:
            print_json(report.to_json())
        else:
            print_report(report)
        return report

    report = run_command(body)
    if not report.ok:
        raise typer.Exit(1)


def numerics_cost(out: Path, ranks: str | None, every_rank: bool, device: str) -> str | None:
    """What ``--numerics`` will cost, said before it starts: its checks, the weights it dequantises and
    the memory one check holds at once (``None`` where OUT is no finished conversion: verify then says so)."""
    from megamoe_convert.devices import usable_device
    from megamoe_convert.errors import MegamoeError
    from megamoe_convert.layout.placement import parse_ranks
    from megamoe_convert.output.manifest import read_manifest
    from megamoe_convert.verify import numerics_checks

    try:
        usable_device(device, "--device")  # an unusable device is refused by verify itself, before any cost is told
        manifest = read_manifest(out)
        chosen = manifest.ranks if ranks is None else parse_ranks(ranks, manifest.ep_size)
    except MegamoeError:
        return None
    checks = numerics_checks([r for r in chosen if r in manifest.ranks], manifest.layers, every_rank)
    weights = sum(2 * _routed_bytes(manifest, layer) for _, layer in checks)  # layout and source
    peak = max((_check_peak(manifest, rank, layer) for rank, layer in checks), default=0)
    which = "every rank x layer" if every_rank else "every MoE layer once, the ranks in turn"
    hint = "; --device cuda runs it on a GPU" if device == "cpu" else ""
    count = f"{len(checks)} check{'s' if len(checks) != 1 else ''}"
    return (f"numerics: {count} ({which}), {human_bytes(weights)} of weights dequantised and multiplied on {device}, "
            f"holding up to about {human_bytes(peak)} at once: the progress lines say the time left{hint}")


def _routed_bytes(manifest: "Manifest", layer: "MoELayer") -> int:
    """The float32 routed experts one side of a numerics check dequantises for ``layer``."""
    from megamoe_convert.verify import NUMERICS_MAX_EXPERTS

    d = manifest.dims
    experts = min(NUMERICS_MAX_EXPERTS, manifest.placement_for(layer).experts_per_rank)
    return experts * 3 * d.hidden_size * d.moe_intermediate_size * 4


def _check_peak(manifest: "Manifest", rank: int, layer: "MoELayer") -> int:
    """Memory one numerics check holds at once: the rank's layer file as loaded, the dequantised routed
    experts of both sides and one more side's worth for dequantising, and both sides' shared expert."""
    d = manifest.dims
    shared = 3 * d.hidden_size * d.shared_intermediate_size * 4
    return manifest.file(manifest.expert_file(layer, rank)).size + 3 * _routed_bytes(manifest, layer) + 2 * shared


def print_report(report: Any) -> None:
    """The report as a table, then OK or every problem found, one per line."""
    line(f"megamoe verify {shlex.quote(report.out)}")
    table = Table()
    table.add_column("check")
    table.add_column("result")
    for check, count in report.checks.items():
        table.add_row(check, f"{count} checked")
    for what, reason in report.skipped.items():
        table.add_row(what, f"[yellow]skipped[/yellow]: {reason}")
    if report.numerics:
        n = report.numerics
        table.add_row("numerics", f"{n['layers']} layers, {n['tokens']} tokens, top-{n['top_k']}: max abs err "
                                  f"{n['max_abs_err']:.3g}, max rel err {n['max_rel_err']:.3g}")
    for name, phase in report.phases.items():
        amount = (human_bytes(phase["bytes"]) if phase["bytes"] is not None else f"{phase['count']} {phase['unit']}")
        label = {"hash": "hashed", "compare_source": "compared with the source"}.get(name, name.replace("_", " "))
        table.add_row(f"time: {label}", f"{amount} in {phase['seconds']:.2f} s")
    out_console.print(table)
    if report.ok:
        coverage = report.coverage or {}
        if coverage.get("partial"):
            out_console.print(f"[green]OK[/green]: no problems found; [yellow]partial conversion[/yellow], not "
                              f"servable as it is: {escape(coverage['note'])}", soft_wrap=True)
        else:
            out_console.print("[green]OK[/green]: no problems found; a complete conversion "
                              f"(serve it: megamoe inspect {escape(shlex.quote(report.out))})", soft_wrap=True)
        return
    out_console.print(f"[red]{len(report.problems)} problem(s)[/red]:")
    for problem in report.problems:
        out_console.print(f"  - {problem}", markup=False, highlight=False, soft_wrap=True)
