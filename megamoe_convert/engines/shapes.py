"""Which engines can serve a model's MegaMoE dims (``inspect`` / ``plan`` ask before converting)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megamoe_convert.layout.serving import serving_refusal

if TYPE_CHECKING:
    from megamoe_convert.source.families import ModelFamily

#: Each engine's MegaMoE shape rule: (hidden_size multiple, moe_intermediate_size multiple).
#: vLLM checks DeepGEMM's own 128; SGLang's pre-dispatch needs 16-byte input scale rows
#: (``mega_moe.py: check_mega_moe_shapes``, fp8 x fp4: hidden % 512).
SHAPE_RULES = {"vllm": (128, 128), "sglang": (512, 128)}


def shape_refusals(hidden: int, intermediate: int, family: "ModelFamily | None" = None) -> dict[str, str | None]:
    """Per engine: why it cannot serve these dims (and this model family) with MegaMoE, or None when it can."""
    refusals: dict[str, str | None] = {}
    for engine, (h, i) in SHAPE_RULES.items():
        bad = [f"{name}={value} is not a multiple of {m}" for name, value, m in
               (("hidden_size", hidden, h), ("moe_intermediate_size", intermediate, i)) if value % m]
        if family is not None and serving_refusal(family, engine, 0) is not None:  # the one family/engine check
            bad.insert(0, family.engine_note or f"no pre-baked {family.title} experts")
        refusals[engine] = ", ".join(bad) or None
    return refusals


def describe_engines(hidden: int, intermediate: int, family: "ModelFamily | None" = None) -> str:
    """One line for ``inspect`` / ``plan``: which engines serve these shapes, and why not the others."""
    refusals = shape_refusals(hidden, intermediate, family)
    parts = [engine if why is None else f"not {engine} ({why})" for engine, why in refusals.items()]
    return "; ".join(parts)
