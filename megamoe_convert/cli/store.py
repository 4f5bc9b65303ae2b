"""``inspect`` / ``plan`` on a store (``convert`` without ``--ep-size``): for an EP size, redundant
count (or explicit placement) and engine, what each rank reads of it: bytes, reads and distinct file ranges."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from megamoe_convert.cli._run import print_json
from megamoe_convert.errors import PlacementError
from megamoe_convert.layout.placement import Placement, default_problem, layer_placement_problem
from megamoe_convert.output.manifest import Manifest, read_manifest
from megamoe_convert.output.naming import MANIFEST_NAME
from megamoe_convert.serve import store
from megamoe_convert.source import families
from megamoe_convert.source.engines_table import resolve_engine
from megamoe_convert.ui import human_bytes, out_console


def store_manifest(src: str) -> Manifest | None:
    """The manifest of ``src`` if it is a store, else ``None`` (a checkpoint, a per-rank conversion)."""
    path = Path(src)
    if not (path / MANIFEST_NAME).is_file():
        return None
    manifest = read_manifest(path)
    return manifest if manifest.store else None


def store_reads(src: str, manifest: Manifest, ep_size: int, num_redundant: int = 0,
                placement_file: Path | None = None, engine: str | None = None) -> dict[str, Any]:
    """Every rank's reads of the store at ``ep_size`` (the engine's per-layer placement rule; ``None``:
    the engine that serves the store's family), refused where the store's family and the engine cannot
    serve it, as on the checkpoint, and at an EP size that places none of its layers, naming those that
    do. Worked out once per group of layers read alike, so its size and cost grow with the ranks, not
    the layers."""
    engine = resolve_engine(families.by_name(manifest.family, MANIFEST_NAME), engine)
    if placement_file is None:
        check_ep_size(src, manifest, ep_size, num_redundant, engine)
    placements = store.store_placements(manifest, ep_size, num_redundant, placement_file, engine, where=src)
    expert_bytes = sum(manifest.file(manifest.expert_file(layer)).size for layer in manifest.layers)
    ranks, groups = store.rank_reads(manifest, placements, range(ep_size))
    return {"store": src, "ep_size": ep_size, "num_redundant": next(iter(placements.values())).num_redundant,
            "engine": engine, "placement": "explicit" if placement_file is not None else "default",
            "store_expert_bytes": expert_bytes, "layers": [layer.key for layer in manifest.layers],
            "layer_groups": groups, "ranks": ranks}


def check_ep_size(src: str, manifest: Manifest, ep_size: int, num_redundant: int, engine: str) -> None:
    """An EP size at which the engine places no layer of the store is refused with the sizes that
    work (a store every size refuses is left to :func:`store.store_placements`, which says why)."""
    from megamoe_convert.cli.outputs import store_ep_sizes

    if _places(manifest, ep_size, num_redundant, engine):
        return
    sizes = store_ep_sizes(manifest, num_redundant, engine)
    if sizes:
        redundant = f" with {num_redundant} redundant experts" if num_redundant else ""
        raise PlacementError(f"{src}: {engine} cannot place the store's {manifest.dims.n_routed_experts} experts"
                             f"{redundant} over EP {ep_size}; EP sizes that work for every MoE layer: "
                             f"{', '.join(map(str, sizes))}")


def _places(manifest: Manifest, ep_size: int, num_redundant: int, engine: str) -> bool:
    """Whether the engine's default placement at ``ep_size`` builds every layer of the store (one
    placement built, each kind of layer asked once), before the sizes that work are looked for."""
    n, family = manifest.dims.n_routed_experts, families.by_name(manifest.family, MANIFEST_NAME)
    if default_problem(n, ep_size, num_redundant) is not None:
        return False
    placement = Placement.default(n, ep_size, num_redundant)
    kinds = {(layer.is_mtp, manifest.dims.experts_of(layer)) for layer in manifest.layers}
    return all(layer_placement_problem(engine, placement, is_mtp, experts, family.sglang_mtp_like_decoder) is None
               for is_mtp, experts in kinds)


def reads_table(data: dict[str, Any]) -> Table:
    table = Table(title=f"{data['store']}: what each rank of EP {data['ep_size']} ({data['num_redundant']} redundant, "
                        f"{data['engine']}, {data['placement']} placement) reads of "
                        f"{human_bytes(data['store_expert_bytes'])} of experts stored once")
    for col in ("rank", "bytes read", "reads", "distinct ranges", "range bytes"):
        table.add_column(col)
    for r in data["ranks"]:
        table.add_row(str(r["rank"]), human_bytes(r["read_bytes"]), str(r["reads"]), str(r["ranges"]),
                      human_bytes(r["range_bytes"]))
    return table


def print_store_reads(src: str, as_json: bool, *args: Any) -> bool:
    """``inspect`` / ``plan`` of a store: print what each rank reads of it (``args``: those of
    :func:`store_reads`); False, printing nothing, for anything that is no store."""
    manifest = store_manifest(src)
    if manifest is None:
        return False
    data = store_reads(src, manifest, *args)
    if as_json:
        print_json(data)
    else:
        out_console.print(reads_table(data))
    return True
