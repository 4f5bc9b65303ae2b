"""``megamoe verify``: check a conversion against its manifest and, optionally, its source."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from megamoe_convert.cli._run import print_json, run_command
from megamoe_convert.devices import Device
from megamoe_convert.ui import ByteProgress, human_bytes, out_console, status


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
    """What ``--numerics`` will cost, said before it starts: its checks and the weights it dequantises
    (``None`` where OUT is no finished conversion: verify then says so)."""
    from megamoe_convert.devices import usable_device
    from megamoe_convert.errors import MegamoeError
    from megamoe_convert.layout.placement import parse_ranks
    from megamoe_convert.output.manifest import read_manifest
    from megamoe_convert.verify import NUMERICS_MAX_EXPERTS, numerics_checks

    try:
        usable_device(device)  # an unusable device is refused by verify itself, before any cost is told
        manifest = read_manifest(out)
        chosen = manifest.ranks if ranks is None else parse_ranks(ranks, manifest.ep_size)
    except MegamoeError:
        return None
    checks = numerics_checks(chosen, manifest.layers, every_rank)
    d = manifest.dims
    experts = sum(min(NUMERICS_MAX_EXPERTS, manifest.placement_for(layer).experts_per_rank) for _, layer in checks)
    weights = 2 * experts * 3 * d.hidden_size * d.moe_intermediate_size * 4  # float32, layout and source
    which = "every rank x layer" if every_rank else "every MoE layer once, the ranks in turn"
    hint = "; --device cuda runs it on a GPU" if device == "cpu" else ""
    return (f"numerics: {len(checks)} checks ({which}), {human_bytes(weights)} of weights dequantised and multiplied "
            f"on {device}: the progress lines say the time left{hint}")


def print_report(report: Any) -> None:
    """The report as a table, then OK or every problem found, one per line."""
    table = Table(title=f"megamoe verify {report.out}")
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
                              f"servable as it is: {coverage['note']}")
        else:
            out_console.print("[green]OK[/green]: no problems found; a complete conversion "
                              f"(serve it: megamoe inspect {report.out})")
        return
    out_console.print(f"[red]{len(report.problems)} problem(s)[/red]:")
    for problem in report.problems:
        out_console.print(f"  - {problem}", markup=False, highlight=False, soft_wrap=True)
