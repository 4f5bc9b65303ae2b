"""``megamoe plan``: which logical experts every rank's slots hold, before converting."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.table import Table

from megamoe_convert.cli._run import print_json, run_command
from megamoe_convert.cli.options import (
    Engine,
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
    src: Annotated[str, typer.Argument(help="Checkpoint directory.")],
    ep_size: Annotated[int, typer.Option(min=1, help="Expert-parallel size (number of ranks).")],
    num_redundant_experts: RedundantOption = 0,
    placement_file: PlacementOption = None,
    engine: EngineOption = Engine.vllm,
    layers: Annotated[Optional[str], typer.Option(help="Only these MoE layers, e.g. 0-3,mtp.0 (default: "
                                                       "all).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the placement as JSON on stdout.")] = False,
    revision: RevisionOption = None,
) -> None:
    """Print which logical experts every rank's slots hold, per layer where the engine's rule
    differs (SGLang's MTP layer, DeepSeek-V4.1's DSpark MTP layers), and which engines can serve
    the checkpoint's shapes.
    \f
    Examples::

        megamoe plan V4-Pro --ep-size 64
        megamoe plan V4-Flash --ep-size 8 --num-redundant-experts 32 \\
            --engine sglang
        megamoe plan V4-Flash --ep-size 8 --placement eplb.json --json
        # a store: what each rank of EP 16 reads of it
        megamoe plan V4-Flash-store --ep-size 16
    """
    from megamoe_convert.cli.describe import engines_json
    from megamoe_convert.cli.outputs import refuse_as_source
    from megamoe_convert.cli.store import print_store_reads
    from megamoe_convert.convert.plan import ConvertOptions, make_placement, select_layers
    from megamoe_convert.engines import describe_engines, shape_refusals
    from megamoe_convert.layout.placement import layer_placement
    from megamoe_convert.source.checkpoint import Checkpoint

    def body() -> None:
        if print_store_reads(src, as_json, ep_size, num_redundant_experts, placement_file, engine.value):
            return
        refuse_as_source(src, "plan", ep_size)  # a per-rank conversion's placement is fixed: inspect shows it
        ckpt = Checkpoint.open(resolve_source(src, revision))
        options = ConvertOptions(ep_size, num_redundant_experts, placement_file, engine=engine.value,
                                 layers=layers)
        placement = make_placement(ckpt, options)
        assert ckpt.family is not None
        own = {layer.key: p for layer in select_layers(ckpt, layers)
               if (p := layer_placement(engine.value, placement, layer.is_mtp, ckpt.dims.experts_of(layer),
                                        ckpt.family.sglang_mtp_like_decoder)) != placement}
        d = ckpt.dims
        if as_json:
            print_json({**placement.to_json(), "engine": engine.value,
                        "layer_placements": {key: p.to_json() for key, p in own.items()},
                        "engines": engines_json(shape_refusals(d.hidden_size, d.moe_intermediate_size,
                                                               ckpt.family))})
            return
        out_console.print(_placement_table(placement, "every MoE layer" if not own else "decoder layers"))
        for key, p in own.items():
            out_console.print(_placement_table(p, f"{key} ({engine.value})"))
        out_console.print(f"served by: {describe_engines(d.hidden_size, d.moe_intermediate_size, ckpt.family)}")
    run_command(body)


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
