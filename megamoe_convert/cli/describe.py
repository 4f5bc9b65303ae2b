"""What ``megamoe inspect`` says: the sizes a conversion will have (from the very units ``convert``
writes), what a finished conversion is, and the serve command that matches it for each engine."""

from __future__ import annotations

import shlex
import threading
from pathlib import Path
from typing import Any

from megamoe_convert.convert.plan import ConvertOptions, index_text, non_expert_index, working_ep_sizes
from megamoe_convert.convert.run import build_plan
from megamoe_convert.output.manifest import Manifest
from megamoe_convert.output.naming import MANIFEST_NAME, format_ranges, rank_dir_name
from megamoe_convert.source import engines_table
from megamoe_convert.source.checkpoint import Checkpoint
from megamoe_convert.source.families import ModelFamily, by_name
from megamoe_convert.source.safetensors_io import FileCache

# --------------------------------------------------------------------------------------
# Sizes, before converting
# --------------------------------------------------------------------------------------

def planned_sizes(src: Path, options: ConvertOptions) -> dict[str, Any]:
    """Every file ``convert SRC OUT`` with ``options`` writes, sized exactly as it will be written:
    rank files (routed experts, pre-baked shared expert, NVFP4 extras, logical ids, header), the
    non-expert shards and their index, and the copied small files. ``manifest.json`` (a few KB,
    written last) is not counted."""
    with FileCache() as files:
        plan = build_plan(src, Path("/nonexistent-out"), options, files, threading.Event())
    per_rank: dict[int, int] = {r: 0 for r in plan.ranks}
    kinds = {"small": 0, "non_expert": 0}
    for unit in plan.units:
        if unit.kind == "experts":
            assert unit.rank is not None
            per_rank[unit.rank] += unit.file_size
        else:
            kinds[unit.kind] += unit.file_size
    index = non_expert_index(plan)
    index_bytes = len(index_text(index).encode()) if index is not None else 0
    rank_total = sum(per_rank.values())
    return {"engine": plan.engine, "ep_size": plan.placement.ep_size, "ranks": plan.ranks,
            "layers": [layer.key for layer in plan.layers],
            "rank_bytes": {str(r): b for r, b in per_rank.items()},
            "expert_bytes_per_rank": max(per_rank.values(), default=0),
            "expert_bytes_total": rank_total, "non_expert_bytes": kinds["non_expert"] + index_bytes,
            "small_file_bytes": kinds["small"],
            "total_bytes": rank_total + kinds["non_expert"] + index_bytes + kinds["small"],
            "experts_per_rank": plan.placement.experts_per_rank}


def ep_sizes(ckpt: Checkpoint, num_redundant: int = 0) -> dict[str, list[int]]:
    """Per engine that serves this family: the EP sizes for which every MoE layer (MTP layers with
    their own expert count included) divides over the ranks."""
    assert ckpt.family is not None
    return {engine: working_ep_sizes(ckpt, num_redundant, engine, ckpt.layers)
            for engine in engines_table.engines_for(ckpt.family)}


def engines_json(refusals: dict[str, str | None]) -> dict[str, dict[str, Any]]:
    """Per engine: ``{"supported": bool, "reason": str}`` (never null meaning "supported")."""
    return {engine: {"supported": why is None, "reason": why or ""} for engine, why in refusals.items()}


# --------------------------------------------------------------------------------------
# A finished conversion
# --------------------------------------------------------------------------------------

def is_conversion(path: Path) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()


def conversion_sizes(out: Path, manifest: Manifest) -> dict[str, Any]:
    """Sizes by the manifest's own records (every file convert wrote), ``manifest.json`` included."""
    per_rank = {str(r): 0 for r in manifest.ranks}
    non_expert = small = 0
    for record in manifest.files:
        if "/" in record.path:
            rank = int(record.path.split("/")[0].split("-")[1])
            per_rank[str(rank)] = per_rank.get(str(rank), 0) + record.size
        elif record.path.endswith(".safetensors") or record.path.endswith(".safetensors.index.json"):
            non_expert += record.size
        else:
            small += record.size
    manifest_bytes = (out / MANIFEST_NAME).stat().st_size
    return {"rank_bytes": per_rank, "expert_bytes_per_rank": max(per_rank.values(), default=0),
            "expert_bytes_total": sum(per_rank.values()), "non_expert_bytes": non_expert,
            "small_file_bytes": small + manifest_bytes,
            "total_bytes": sum(per_rank.values()) + non_expert + small + manifest_bytes}


def serve_commands(out: str, manifest: Manifest) -> dict[str, dict[str, Any]]:
    """Per engine: whether it can serve this conversion, the exact command when it can, and why not
    when it cannot (family, weight format, shapes, engine the placement was built for, placement, partial)."""
    coverage = manifest.coverage()
    placement = manifest.placement
    result: dict[str, dict[str, Any]] = {}
    for engine in engines_table.ENGINE_NAMES:
        why = engine_problems(engine, manifest)
        if manifest.engine != engine and not engines_table.family_refusal(_family(manifest), engine):
            why.append(f"converted for {manifest.engine}'s expert placement (convert with --engine {engine})")
        if not engines_table.engine(engine).explicit_placement and not placement.is_default():
            why.append(f"an explicit placement: {engines_table.engine(engine).title} serves only its default one")
        if not coverage["servable"]:
            why.append(coverage["note"])
        command, notes = serve_command(engine, shlex.quote(out), str(manifest.ep_size), placement.num_redundant,
                                       manifest, placement.is_default())
        rows = engines_table.serving_rows(engine, _family(manifest), manifest.dims.weight_format,
                                          manifest.dims.hidden_size, manifest.dims.moe_intermediate_size)
        gpus = sorted({row.gpu for row in rows})
        result[engine] = {"servable": not why, "command": command if not why else "", "reason": "; ".join(why),
                          "notes": notes if not why else [], "gpus": gpus if not why else []}
    return result


def _family(manifest: Manifest) -> ModelFamily:
    return by_name(manifest.family, MANIFEST_NAME)


def engine_problems(engine: str, manifest: Manifest) -> list[str]:
    """Why no release of ``engine`` serves what the manifest holds, whatever its placement: the family,
    the weight format, the shapes (empty: one does)."""
    d = manifest.dims
    return engines_table.problems(engine, _family(manifest), d.weight_format, d.hidden_size, d.moe_intermediate_size)


def serve_command(engine: str, path: str, n: str, num_redundant: int, manifest: Manifest,
                  default_placement: bool = True) -> tuple[str, list[str]]:
    """The command that serves ``path`` (shell-quoted) with ``engine`` at EP size ``n`` (a number, or
    ``N`` for a store's any), and the notes that go with it: the releases and GPUs that serve it first."""
    d = manifest.dims
    family = _family(manifest)
    command = engines_table.serve_command(engine, path, n, num_redundant, family.name)
    served = engines_table.served_by(engine, family, d.weight_format, d.hidden_size, d.moe_intermediate_size)
    notes = [f"{served}; {note}" if (note := engines_table.engine(engine).note) else served]
    if not default_placement:
        notes.append("add --init-expert-location with this placement (manifest.json: placement.physical_to_logical) "
                     "for every layer")
    return command, notes


def describe_conversion(out: Path, manifest: Manifest) -> dict[str, Any]:
    """What ``inspect OUT`` prints (``--json``: the same keys)."""
    placement, coverage = manifest.placement, manifest.coverage()
    absolute = str(Path(out).resolve())
    return {
        "kind": "conversion", "path": absolute, "family": manifest.family,
        "model_family": by_name(manifest.family, MANIFEST_NAME).title, "weight_format": manifest.dims.weight_format,
        "engine": manifest.engine, "ep_size": manifest.ep_size, "ranks": sorted(set(manifest.ranks)),
        "rank_dirs": [rank_dir_name(r, manifest.ep_size) for r in sorted(set(manifest.ranks))],
        "layers": [layer.key for layer in manifest.layers], "experts_only": manifest.experts_only,
        "n_routed_experts": manifest.dims.n_routed_experts, "num_redundant_experts": placement.num_redundant,
        "experts_per_rank": placement.experts_per_rank,
        "placement": "default" if placement.is_default() else "explicit",
        "shared_expert_prebaked": bool(manifest.dims.shared_intermediate_size),
        "layout": manifest.layout,
        "partial": coverage["partial"], "servable": coverage["servable"], "coverage": coverage,
        "sizes": conversion_sizes(Path(out), manifest),
        "serve": (serve := serve_commands(absolute, manifest)),
        "source": {k: manifest.source.get(k) for k in ("path", "repo_id", "revision") if k in manifest.source},
        "next": ("serve it (the command above)" if any(e["servable"] for e in serve.values()) else
                 coverage["note"] if coverage["partial"] else "no engine serves it: see serve.*.reason"),
    }


def describe_ranks(ranks: list[int], ep_size: int) -> str:
    return "all" if sorted(set(ranks)) == list(range(ep_size)) else format_ranges(sorted(set(ranks)))
