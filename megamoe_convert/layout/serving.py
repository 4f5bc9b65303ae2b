"""What a model family and an engine can serve: the one check behind ``plan``, ``inspect``, ``pull``
and ``convert``, on a checkpoint as on a store.

Asked everywhere in the same words, so a store is refused exactly where its checkpoint would be:
an engine whose MegaMoE modules do not take the family's pre-baked experts, redundant or re-placed
experts for a family the engine builds without them, and an explicit placement for vLLM (which
serves MegaMoE experts only in its default one and refuses any other at load time).
"""

from __future__ import annotations

from pathlib import Path

from megamoe_convert.layout.placement import Placement
from megamoe_convert.source.families import ModelFamily


def serving_refusal(family: ModelFamily, engine: str | None, n_routed: int, *, num_redundant: int = 0,
                    placement_file: Path | None = None, placement: Placement | None = None) -> str | None:
    """Why ``engine`` cannot serve ``family``'s experts so placed, or ``None`` when it can.

    ``engine=None``: whichever engine serves the family (a store's conversion, before any engine is named).
    ``placement_file``: an explicit placement was asked for (refused for a family built without
    re-placed experts before the file is read); ``placement``: that file's placement, once read.
    The answer names what to drop; callers put the checkpoint's or the store's path before it."""
    if not family.engines:
        return f"{family.title} checkpoints are read (inspect, plan) but not converted: {family.engine_note}"
    if engine is not None and engine not in family.engines:
        return (f"{family.title} conversions are for {', '.join(family.engines)} only, not {engine} "
                f"({family.engine_note}); convert with --engine {family.engines[0]}")
    if not family.redundant_experts and (num_redundant or placement_file is not None):
        return (f"vLLM builds {family.title}'s MegaMoE layers with its {n_routed} experts and no redundant or "
                "re-placed ones; drop --num-redundant-experts / --placement")
    if engine == "vllm" and placement is not None and not placement.is_default():
        return (f"--placement {placement_file}: vLLM serves MegaMoE experts only in its default placement (slot p "
                f"holds logical expert p % {n_routed}) and refuses any other at load time; for vLLM use "
                "--num-redundant-experts R (EPLB re-balances while serving), or convert for SGLang with "
                "--engine sglang")
    return None
