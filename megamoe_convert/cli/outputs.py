"""What the tool's own output is, and what to do next with it, whichever command meets it.

A folder ``megamoe convert`` (or ``pull``) wrote is one of: a finished per-rank conversion
(``describe.describe_conversion``), a store (:func:`describe_store`: every logical expert once, served
at any EP size), the parts of a split conversion not merged yet, or an unfinished conversion
(:func:`describe_unfinished`). ``inspect`` prints each with the same ``--json`` keys (``kind``, ``path``,
``serve``, ``next``, ...); ``plan`` and ``convert`` refuse them as sources in one line saying which it is.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from megamoe_convert.cli.describe import engine_problems, serve_command
from megamoe_convert.errors import ManifestError, MegamoeError, PlacementError, UsageError
from megamoe_convert.output.manifest import Manifest, is_tool_output
from megamoe_convert.output.naming import MANIFEST_NAME, PART_GLOB, STATE_DIR
from megamoe_convert.output.resume import read_state_json, recorded_source
from megamoe_convert.serve import store
from megamoe_convert.source.engines_table import ENGINE_NAMES as ENGINES
from megamoe_convert.source.families import by_name


def store_ep_sizes(manifest: Manifest, num_redundant: int, engine: str) -> list[int]:
    """The EP sizes at which ``engine`` serves the store with ``num_redundant`` slots: those whose
    placement every layer (MTP layers with their own expert count included) accepts."""
    slots = manifest.dims.n_routed_experts + num_redundant
    sizes = []
    for ep_size in (d for d in range(1, slots + 1) if slots % d == 0):
        try:
            store.store_placements(manifest, ep_size, num_redundant, None, engine)
        except MegamoeError:
            continue
        sizes.append(ep_size)
    return sizes


def describe_store(src: str, manifest: Manifest, ep_size: int | None, num_redundant: int,
                   reads: dict[str, Any] | None) -> dict[str, Any]:
    """What ``inspect STORE`` prints (``--json``: the same keys as for a conversion, ``kind`` "store"),
    with the serve command of every engine that serves it and the EP sizes it serves at."""
    absolute = str(Path(src).resolve())
    coverage = manifest.coverage()
    if not coverage["partial"]:
        coverage["note"] = "every MoE layer's experts and the non-expert weights: servable at any EP size listed"
    expert_bytes = sum(manifest.file(manifest.expert_file(layer)).size for layer in manifest.layers)
    non_expert = sum(r.size for r in manifest.files if "/" not in r.path)
    manifest_bytes = (Path(src) / MANIFEST_NAME).stat().st_size
    serve: dict[str, dict[str, Any]] = {}
    for engine in ENGINES:
        why = engine_problems(engine, manifest)
        sizes = [] if why else store_ep_sizes(manifest, num_redundant, engine)
        if not why and not sizes:
            why.append(f"no EP size places {manifest.dims.n_routed_experts} experts + {num_redundant} redundant")
        if not why and ep_size is not None and ep_size not in sizes:
            why.append(f"not at EP {ep_size} (it serves EP {', '.join(map(str, sizes))})")
        if not coverage["servable"]:
            why.append(coverage["note"])
        n = str(ep_size) if ep_size is not None else "N"
        command, notes = serve_command(engine, shlex.quote(absolute), n, num_redundant, manifest)
        if ep_size is None and sizes:
            notes = [f"N: any of {', '.join(map(str, sizes))}", *notes]
        serve[engine] = {"servable": not why, "command": "" if why else command, "reason": "; ".join(why),
                         "notes": [] if why else notes, "ep_sizes": sizes}
    servable = [e for e in ENGINES if serve[e]["servable"]]
    return {
        "kind": "store", "path": absolute, "family": manifest.family,
        "model_family": by_name(manifest.family, MANIFEST_NAME).title,
        "weight_format": manifest.dims.weight_format, "engine": manifest.engine, "ep_size": ep_size,
        "layers": [layer.key for layer in manifest.layers], "experts_only": manifest.experts_only,
        "n_routed_experts": manifest.dims.n_routed_experts, "num_redundant_experts": num_redundant,
        "shared_expert_prebaked": bool(manifest.dims.shared_intermediate_size), "layout": manifest.layout,
        "partial": coverage["partial"], "servable": bool(servable), "coverage": coverage,
        "sizes": {"expert_bytes_total": expert_bytes, "non_expert_bytes": non_expert,
                  "total_bytes": sum(r.size for r in manifest.files) + manifest_bytes},
        "serve": serve, "reads": reads,
        "source": {k: manifest.source.get(k) for k in ("path", "repo_id", "revision") if k in manifest.source},
        "next": (f"serve it (the command above); what each rank reads: megamoe inspect {shlex.quote(src)} "
                 "--ep-size N" if servable else coverage["note"] if coverage["partial"] else
                 "no engine serves it: see serve.*.reason"),
    }


def describe_unfinished(path: Path) -> dict[str, Any] | None:
    """A folder the tool was writing and did not finish (no ``manifest.json``): an interrupted or
    running ``convert``, or the parts of a split one not merged yet; ``None`` for anything else."""
    if (path / MANIFEST_NAME).is_file() or not path.is_dir() or not is_tool_output(path):
        return None
    absolute = str(path.resolve())
    parts = sorted(p.name for p in path.glob(PART_GLOB))
    common = {"path": absolute, "partial": True, "servable": False, "serve": {}}
    if parts:
        return {**common, "kind": "parts", "parts": parts,
                "what": f"the parts of a split megamoe conversion ({len(parts)} done), not merged yet",
                "next": f"once every part is done: megamoe merge {shlex.quote(str(path))}"}
    plan = read_state_json(path / STATE_DIR / "plan.json") or {}
    options = ("" if plan.get("store") or not isinstance(plan.get("ep_size"), int) else
               f" --ep-size {plan['ep_size']}")
    if isinstance(plan.get("placement"), list) and not plan.get("store"):
        redundant = len(plan["placement"]) - len(set(plan["placement"]))
        options += f" --num-redundant-experts {redundant}" if redundant else ""
    if plan.get("engine") == "sglang":
        options += " --engine sglang"
    recorded = recorded_source(path)
    source = shlex.quote(recorded) if recorded is not None else "SRC"
    what = ("an unfinished megamoe store" if plan.get("store") else
            f"an unfinished megamoe conversion for EP {plan['ep_size']}" if "ep_size" in plan else
            "an unfinished megamoe conversion")
    return {**common, "kind": "unfinished", "what": f"{what} (its convert was interrupted, or is still running)",
            "next": f"rerun the convert that made it to finish it, from where it stopped: megamoe convert {source} "
                    f"{shlex.quote(str(path))}{options}"}


def refuse_as_source(src: str, command: str, ep_size: int | None = None) -> None:
    """``plan`` / ``convert`` were given the tool's own output where a source checkpoint goes:
    one line saying what it is and what to run instead."""
    path = Path(src)
    if not path.is_dir() or not is_tool_output(path):
        return
    if not ((path / STATE_DIR).is_dir() or (path / MANIFEST_NAME).is_file()):
        return  # only a marked config.json, no conversion's state: the marker's own check names it
    unfinished = describe_unfinished(path)
    if unfinished is not None:
        raise UsageError(f"{src}: {unfinished['what']}, not a source checkpoint; {unfinished['next']}")
    from megamoe_convert.output.manifest import read_manifest

    try:
        manifest = read_manifest(path)
    except (ManifestError, PlacementError):  # a manifest.json that is no megamoe manifest: the source's own
        return
    what = (f"a megamoe store of {manifest.family}" if manifest.store else
            f"a megamoe conversion of {manifest.family} for EP {manifest.ep_size} ({manifest.engine})")
    recorded = manifest.source.get("repo_id") or manifest.source.get("path")
    source = shlex.quote(recorded) if isinstance(recorded, str) and recorded else "SRC"
    instead = {"plan": f"`megamoe inspect {shlex.quote(src)}` shows its placement and serve command; to plan another "
                       f"EP size, plan its source: megamoe plan {source} --ep-size {ep_size or 'N'} "
                       "(or convert without --ep-size: a store serves every EP size)",
               "convert": f"convert its source instead: megamoe convert {source} OUT ..."}[command]
    raise UsageError(f"{src}: {what}, not a source checkpoint; {instead}")
