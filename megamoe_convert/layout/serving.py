"""What a model family and an engine can serve, asked of the serving table (``source/engines_table.py``):
the one check behind ``plan``, ``inspect``, ``pull`` and ``convert``, on a checkpoint as on a store.

Asked everywhere in the same words, so a store is refused exactly where its checkpoint would be:
an engine whose MegaMoE modules do not take the family's pre-baked experts, redundant or re-placed
experts for a family the engine builds without them, an explicit placement for an engine that
serves only its default one (vLLM refuses any other at load time), and dims no release takes.
"""

from __future__ import annotations

from pathlib import Path

from megamoe_convert.layout.placement import Placement
from megamoe_convert.source import engines_table as table
from megamoe_convert.source.families import ModelFamily


def serving_refusal(family: ModelFamily, engine: str | None, n_routed: int, *, num_redundant: int = 0,
                    placement_file: Path | None = None, placement: Placement | None = None) -> str | None:
    """Why ``engine`` cannot serve ``family``'s experts so placed, or ``None`` when it can.

    ``engine=None``: the engine that serves the family (its default, or a store's before any engine is
    named). ``placement_file``: an explicit placement was asked for (refused for a family built without
    re-placed experts before the file is read); ``placement``: that file's placement, once read.
    The answer names what to drop; callers put the checkpoint's or the store's path before it."""
    served = table.engines_for(family)
    if not served:
        return f"{family.title} checkpoints are read (inspect, plan) but not converted: {table.unserved_note(family)}"
    if engine is not None and engine not in served:
        return (f"{family.title} conversions are for {', '.join(served)} only, not {engine} "
                f"({table.family_refusal(family, engine)}); drop --engine {engine}: {family.title} "
                f"defaults to {served[0]}")
    server = table.engine(engine or served[0])
    if family.name in server.fixed_experts and (num_redundant or placement_file is not None):
        return (f"{server.title} builds {family.title}'s MegaMoE layers with its {n_routed} experts and no "
                "redundant or re-placed ones; drop --num-redundant-experts / --placement")
    if not server.explicit_placement and placement is not None and not placement.is_default():
        others = [e for e in served if table.engine(e).explicit_placement]
        instead = f", or convert for {table.engine(others[0]).title} with --engine {others[0]}" if others else ""
        return (f"--placement {placement_file}: {server.title} serves MegaMoE experts only in its default placement "
                f"(slot p holds logical expert p % {n_routed}) and refuses any other at load time; for "
                f"{server.title} use --num-redundant-experts R (EPLB re-balances while serving){instead}")
    return None


def shape_refusals(family: ModelFamily, weight_format: str, hidden: int, intermediate: int) -> dict[str, str | None]:
    """Per engine: why no release of it serves these dims of ``family`` in ``weight_format`` with
    MegaMoE, or ``None`` when one does."""
    return {name: "; ".join(problems) or None
            for name in table.ENGINE_NAMES
            for problems in [table.problems(name, family, weight_format, hidden, intermediate)]}


def describe_engines(family: ModelFamily, weight_format: str, hidden: int, intermediate: int) -> str:
    """One line for ``inspect`` / ``plan``: the releases and GPUs that serve these shapes, and why not the
    other engines: ``vLLM 0.31-0.33 on Blackwell; not SGLang (hidden_size=256 is not a multiple of 512)``."""
    parts = []
    for name, why in shape_refusals(family, weight_format, hidden, intermediate).items():
        title = table.served_by(name, family, weight_format, hidden, intermediate)
        parts.append(title if why is None else f"not {title} ({why})")
    return "; ".join(parts)
