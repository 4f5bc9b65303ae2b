"""``megamoe plan``: which logical experts every rank's slots hold, before converting."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.table import Table

from megamoe_convert.cli._run import print_json, run_command
from megamoe_convert.cli.options import (
    EngineOption,
    PlacementOption,
    RedundantOption,
    RevisionOption,
    resolve_source,
)
from megamoe_convert.ui import out_console

if TYPE_CHECKING:
    from megamoe_convert.layout.placement import Placement


def plan(
    src: Annotated[str, typer.Argument(help="Checkpoint directory (or a store).")],
    ep_size: Annotated[Optional[int], typer.Option(min=1, help="Expert-parallel size (number of ranks; "
                                                               "default: list the EP sizes that work).")] = None,
    num_redundant_experts: RedundantOption = 0,
    placement_file: PlacementOption = None,
    engine: EngineOption = None,
    layers: Annotated[Optional[str], typer.Option(help="Only these MoE layers, e.g. 0-3,mtp.0 (default: "
                                                       "all).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the placement as JSON on stdout.")] = False,
    revision: RevisionOption = None,
) -> None:
    """Print which logical experts every rank's slots hold, per layer where the engine's rule
    differs (SGLang's MTP layer, DeepSeek-V4.1's DSpark MTP layers), and which engines can serve
    the checkpoint's shapes; without --ep-size, the EP sizes that work.
    \f
    Examples::

        megamoe plan V4-Pro --ep-size 64
        megamoe plan V4-Flash --ep-size 8 --num-redundant-experts 32 \\
            --engine sglang
        megamoe plan V4-Flash --ep-size 8 --placement eplb.json --json
        # the EP sizes that work
        megamoe plan V4-Flash --num-redundant-experts 32
        # a store: what each rank of EP 16 reads of it
        megamoe plan V4-Flash-store --ep-size 16
    """
    from megamoe_convert.cli.outputs import refuse_as_source
    from megamoe_convert.cli.store import print_store_reads

    name = engine and engine.value

    def body() -> None:
        if ep_size is None:
            _print_ep_sizes(src, num_redundant_experts, name, revision, as_json)
        elif not print_store_reads(src, as_json, ep_size, num_redundant_experts, placement_file, name):
            refuse_as_source(src, "plan", ep_size)  # a per-rank conversion's placement is fixed: inspect shows it
            _print_placement(resolve_source(src, revision), ep_size, num_redundant_experts, placement_file, name,
                             layers, as_json)
    run_command(body)


def _print_placement(src: Path, ep_size: int, redundant: int, placement_file: Path | None, engine: str | None,
                     layers: str | None, as_json: bool) -> None:
    """A checkpoint's plan: the decoder layers' placement, each layer the engine builds its own way, and
    the releases that serve its shapes."""
    from megamoe_convert.cli.describe import engines_json
    from megamoe_convert.convert.plan import ConvertOptions, make_placement, select_layers
    from megamoe_convert.layout.placement import layer_placement
    from megamoe_convert.layout.serving import describe_engines, shape_refusals
    from megamoe_convert.source.checkpoint import Checkpoint
    from megamoe_convert.source.engines_table import resolve_engine

    ckpt = Checkpoint.open(src)
    assert ckpt.family is not None
    placement = make_placement(ckpt, ConvertOptions(ep_size, redundant, placement_file, engine=engine, layers=layers))
    engine = resolve_engine(ckpt.family, engine)
    own = {layer.key: p for layer in select_layers(ckpt, layers)
           if (p := layer_placement(engine, placement, layer.is_mtp, ckpt.dims.experts_of(layer),
                                    ckpt.family.sglang_mtp_like_decoder)) != placement}
    d = ckpt.dims
    if as_json:
        print_json({**placement.to_json(), "engine": engine,
                    "layer_placements": {key: p.to_json() for key, p in own.items()},
                    "engines": engines_json(shape_refusals(ckpt.family, d.weight_format, d.hidden_size,
                                                           d.moe_intermediate_size))})
        return
    out_console.print(_placement_table(placement, "every MoE layer" if not own else "decoder layers"))
    for key, p in own.items():
        out_console.print(_placement_table(p, f"{key} ({engine})"))
    served = describe_engines(ckpt.family, d.weight_format, d.hidden_size, d.moe_intermediate_size)
    out_console.print(f"served by: {served}", markup=False, highlight=False)


def _print_ep_sizes(src: str, redundant: int, engine: str | None, revision: str | None, as_json: bool) -> None:
    """``plan`` without ``--ep-size``: the EP sizes that work per engine that serves the checkpoint or
    store (``engine``: that one only), as ``inspect`` lists them."""
    from megamoe_convert.cli.describe import ep_sizes
    from megamoe_convert.cli.outputs import refuse_as_source, store_ep_sizes
    from megamoe_convert.cli.store import store_manifest
    from megamoe_convert.layout.serving import shape_refusals
    from megamoe_convert.source.checkpoint import Checkpoint
    from megamoe_convert.source.engines_table import engines_for
    from megamoe_convert.source.families import by_name

    if (manifest := store_manifest(src)) is not None:
        sizes = {e: store_ep_sizes(manifest, redundant, e) for e in engines_for(by_name(manifest.family))}
    else:
        refuse_as_source(src, "plan")
        ckpt = Checkpoint.open(resolve_source(src, revision))
        assert ckpt.family is not None
        d = ckpt.dims
        refusals = shape_refusals(ckpt.family, d.weight_format, d.hidden_size, d.moe_intermediate_size)
        sizes = {e: s for e, s in ep_sizes(ckpt, redundant).items() if refusals.get(e) is None}
    sizes = {e: s for e, s in sizes.items() if engine in (None, e)}
    if as_json:
        print_json({"working_ep_sizes": sizes, "num_redundant_experts": redundant})
        return
    with_redundant = f" with {redundant} redundant experts" if redundant else ""
    for name, found in sizes.items():
        out_console.print(f"EP sizes for {name}{with_redundant}: {', '.join(map(str, found)) or 'none'}",
                          markup=False, highlight=False)
    if not sizes:
        out_console.print("no engine serves it: megamoe inspect says why", markup=False, highlight=False)
    out_console.print(f"which experts each rank holds: megamoe plan {shlex.quote(src)} --ep-size N", markup=False,
                      highlight=False)


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
