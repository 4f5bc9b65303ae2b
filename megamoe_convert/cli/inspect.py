"""``megamoe inspect``: what a checkpoint, a conversion or a store holds, and how to serve it."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from megamoe_convert.cli._run import print_json, run_command
from megamoe_convert.cli.options import EngineOption, RedundantOption, RevisionOption, resolve_source
from megamoe_convert.ui import command, human_bytes, line, out_console, say


def inspect(
    src: Annotated[str, typer.Argument(help="A checkpoint directory (or hub repo id), a directory "
                                            "`megamoe convert` wrote (it has a manifest.json), or a store "
                                            "(what each rank reads of it).")],
    ep_size: Annotated[Optional[int], typer.Option(min=1, help="Size the conversion for this EP size: bytes "
                                                               "per rank and in all (default: list the EP "
                                                               "sizes that work).")] = None,
    num_redundant_experts: RedundantOption = 0,
    engine: EngineOption = None,
    experts_only: Annotated[bool, typer.Option(help="Size an --experts-only conversion.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON summary on stdout.")] = False,
    revision: RevisionOption = None,
) -> None:
    """Show what a checkpoint holds (MoE layers incl. MTP, experts, dims, dtypes, the EP sizes that
    work, bytes per rank and in all as convert will write them, which engines serve its shapes) or,
    for a conversion, what it is and the exact command that serves it.
    \f
    Examples::

        # the EP sizes that work, and the engines that serve its shapes
        megamoe inspect V4-Flash
        # the bytes per rank and in all, before converting
        megamoe inspect V4-Flash --ep-size 8
        # a conversion or a store: what it is, and the command that serves it
        megamoe inspect V4-Flash-ep8
        megamoe inspect V4-Flash-store --ep-size 16 --json
    """
    from megamoe_convert.cli.describe import is_conversion
    from megamoe_convert.cli.outputs import describe_unfinished
    from megamoe_convert.cli.store import store_manifest

    def body() -> None:
        if (manifest := store_manifest(src)) is not None:
            _inspect_store(src, manifest, ep_size, num_redundant_experts, engine and engine.value, as_json)
        elif is_conversion(Path(src)):
            _inspect_conversion(Path(src), as_json)
        elif (unfinished := describe_unfinished(Path(src))) is not None:
            if as_json:
                print_json(unfinished)
            else:
                say(f"{src}: {unfinished['what']}")
                line(f"next: {unfinished['next']}")
        else:
            _inspect_checkpoint(resolve_source(src, revision), ep_size, num_redundant_experts,
                                engine and engine.value, experts_only, as_json)
    run_command(body)


def _inspect_checkpoint(path: Path, ep_size: int | None, redundant: int, engine: str | None, experts_only: bool,
                        as_json: bool) -> None:
    from megamoe_convert.cli.describe import engines_json, ep_sizes, planned_sizes
    from megamoe_convert.convert.plan import ConvertOptions
    from megamoe_convert.layout.serving import describe_engines, shape_refusals
    from megamoe_convert.source.checkpoint import Checkpoint

    ckpt = Checkpoint.open(path)
    assert ckpt.family is not None
    d = ckpt.dims
    first = ckpt.layers[0]
    dtypes = {f"{p}.{k}": ckpt.expert_entry(first, 0, p, k).dtype for p, k in d.expert_byte_shapes()}
    refusals = shape_refusals(ckpt.family, d.weight_format, d.hidden_size, d.moe_intermediate_size)
    working = {name: sizes for name, sizes in ep_sizes(ckpt, redundant).items() if refusals.get(name) is None}
    summary: dict[str, Any] = {
        "next": "convert it: megamoe convert SRC OUT --ep-size N (or without --ep-size: a store, any EP size)",
        "kind": "checkpoint", "path": str(ckpt.root.resolve()), "model_type": ckpt.config.get("model_type"),
        "family": ckpt.family.name, "model_family": ckpt.family.title,
        "weight_format": d.weight_format, "shared_expert_prebaked": bool(d.shared_intermediate_size),
        "shared_intermediate_size": d.shared_intermediate_size, "shared_expert_note": ckpt.shared_expert_note or "",
        "dims": dict(d.__dict__), "moe_layers": [layer.key for layer in ckpt.layers],
        "mtp_layers": [layer.key for layer in ckpt.layers if layer.is_mtp], "expert_dtypes": dtypes,
        "shards": len(ckpt.headers), "tensors": len(ckpt.tensors),
        "expert_bytes": ckpt.expert_bytes(), "non_expert_bytes": sum(e.nbytes for e in ckpt.non_expert_tensors()),
        "num_redundant_experts": redundant, "working_ep_sizes": working,
        "engines": engines_json(refusals),
    }
    if ep_size is not None:
        options = ConvertOptions(ep_size, redundant, engine=engine, experts_only=experts_only)
        summary["conversion"] = {"experts_only": experts_only, **planned_sizes(ckpt.root, options)}
    if as_json:
        print_json(summary)
        return
    line(str(ckpt.root))  # a path to copy: above the table, where rich never breaks it
    table = Table(show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    table.add_row("model family / weight format", f"{ckpt.family.title} ({summary['model_type']}) / {d.weight_format}")
    table.add_row("fused shared expert", f"pre-baked (intermediate {d.shared_intermediate_size})"
                  if d.shared_intermediate_size else f"not pre-baked: {ckpt.shared_expert_note}")
    table.add_row("hidden / intermediate", f"{d.hidden_size} / {d.moe_intermediate_size}")
    table.add_row("routed experts", f"{d.n_routed_experts}" + (f" (MTP layers: {d.mtp_n_routed_experts})"
                                                               if d.mtp_n_routed_experts else ""))
    decoder = [layer for layer in ckpt.layers if not layer.is_mtp]
    table.add_row("MoE layers", f"{len(decoder)} decoder + {len(summary['mtp_layers'])} MTP")
    table.add_row("expert dtypes", ", ".join(f"{k}={v}" for k, v in dtypes.items()))
    table.add_row("shards / tensors", f"{summary['shards']} / {summary['tensors']}")
    table.add_row("expert bytes", human_bytes(summary["expert_bytes"]))
    table.add_row("non-expert bytes", human_bytes(summary["non_expert_bytes"]))
    redundant_text = f" with {redundant} redundant experts" if redundant else ""
    for name, sizes in working.items():
        table.add_row(f"EP sizes for {name}{redundant_text}", ", ".join(map(str, sizes)) or "none")
    if ep_size is not None:
        c = summary["conversion"]
        table.add_row(f"convert --ep-size {ep_size} ({c['engine']})",
                      f"{human_bytes(c['expert_bytes_per_rank'])} per rank ({c['experts_per_rank']} slots/layer, "
                      "shared expert and all extras included); "
                      f"{human_bytes(c['total_bytes'])} in all")
    else:
        table.add_row("bytes per rank", "pass --ep-size N to size a conversion")
    table.add_row("served by", describe_engines(ckpt.family, d.weight_format, d.hidden_size, d.moe_intermediate_size))
    out_console.print(table)


def _inspect_conversion(out: Path, as_json: bool) -> None:
    from megamoe_convert.cli.describe import describe_conversion, describe_ranks
    from megamoe_convert.output.manifest import read_manifest

    manifest = read_manifest(out)
    info = describe_conversion(out, manifest)
    if as_json:
        print_json(info)
        return
    sizes = info["sizes"]
    _print_output(info, "a megamoe conversion", [
        ("converted for", f"{info['engine']}, EP {info['ep_size']}"),
        ("ranks present", f"{describe_ranks(info['ranks'], info['ep_size'])} of {info['ep_size']}"),
        ("MoE layers", _describe_layers(info["layers"])),
        ("experts", f"{info['n_routed_experts']} routed + {info['num_redundant_experts']} redundant, "
                    f"{info['experts_per_rank']} per rank; placement {info['placement']}"),
    ], f"{human_bytes(sizes['expert_bytes_per_rank'])} per rank, {human_bytes(sizes['total_bytes'])} in all")


def _print_output(info: dict[str, Any], kind: str, rows: list[tuple[str, str]], size: str) -> None:
    """What a conversion or a store is (its family and format, then ``rows`` of its own kind, then what
    both record: shared expert, layout identity, coverage and ``size``), and the commands that serve it."""
    line(f"{info['path']} ({kind})")  # a path to copy: above the table, where rich never breaks it
    table = Table(show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    table.add_row("model family / weight format", f"{info['model_family']} / {info['weight_format']}")
    for row in rows:
        table.add_row(*row)
    table.add_row("fused shared expert", "pre-baked" if info["shared_expert_prebaked"] else "not pre-baked")
    table.add_row("layout identity", _describe_layout(info["layout"], info["family"]))
    table.add_row("partial", f"yes: {info['coverage']['note']}" if info["partial"] else "no")
    table.add_row("size", size)
    out_console.print(table)
    _print_serve(info["serve"])


def _describe_layers(layers: list[str]) -> str:
    """The MoE layers, each named up to eight, else their count and the first and last."""
    return ", ".join(layers) if len(layers) <= 8 else f"{len(layers)} ({layers[0]} .. {layers[-1]})"


def _print_serve(serve: dict[str, dict[str, Any]]) -> None:
    for engine, how in serve.items():
        if how["servable"]:
            say(f"serve with {engine}:")
            command(how["command"])
            for note in how["notes"]:
                say(f"  ({note})")
        else:
            say(f"not servable with {engine}: {how['reason']}")


def _inspect_store(src: str, manifest: Any, ep_size: int | None, redundant: int, engine: str | None,
                   as_json: bool) -> None:
    """A store: what it is, the EP sizes and the command each engine that serves it takes; with ``--ep-size``,
    what each rank reads of it (``engine=None``: under the rule of the engine that serves its family)."""
    from megamoe_convert.cli.outputs import describe_store
    from megamoe_convert.cli.store import reads_table, store_reads

    reads = store_reads(src, manifest, ep_size, redundant, None, engine) if ep_size is not None else None
    info = describe_store(src, manifest, ep_size, redundant, reads)
    if as_json:
        print_json(info)
        return
    sizes = info["sizes"]
    _print_output(info, "a megamoe store: every logical expert once, for any EP size", [
        ("MoE layers", _describe_layers(info["layers"])),
        ("experts", f"{info['n_routed_experts']} routed, each once (slots, redundant experts and the placement "
                    "are the server's choice)"),
        *((f"EP sizes for {name}" + (f" with {redundant} redundant" if redundant else ""),
           ", ".join(map(str, how["ep_sizes"]))) for name, how in info["serve"].items() if how["ep_sizes"]),
    ], f"{human_bytes(sizes['expert_bytes_total'])} of experts, {human_bytes(sizes['total_bytes'])} in all")
    if reads is not None:
        out_console.print(reads_table(reads))
    else:
        line(f"what each rank reads of it: megamoe inspect {shlex.quote(src)} --ep-size N")


def _describe_layout(record: dict[str, Any], family: str) -> str:
    """The recorded transform, its fingerprints and the releases it is proven against, in one cell: of
    the engines, those that serve the family (the serving table's)."""
    from megamoe_convert.source.engines_table import ENGINE_NAMES, engines_for
    from megamoe_convert.source.families import by_name

    prints = ", ".join(f"{part} {value}" for part, value in record["fingerprints"].items())
    served = engines_for(by_name(family))
    proven = "; ".join(f"{name} {', '.join(versions)}" for name, versions in record["proven"].items()
                       if name in served or name not in ENGINE_NAMES)
    return f"{record['transform']} ({prints}); proven with {proven}"

