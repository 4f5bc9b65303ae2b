"""Engine contracts: how a serving engine's MegaMoE modules take a rank's pre-baked experts.

One module per contract, each with the same three steps, so that nothing outside this package
knows an engine's attribute names:

- ``detect(module)``: is this module of my contract? (by what it has, never by class name)
- ``check(module, layer, converted, rank)``: is it built for exactly what was converted?
  Raises :class:`InstallError` naming the module and both values. Runs for every module
  before any module is changed.
- ``destinations(module, converted)`` + ``finish(module, layer)``: where the file bytes go (the engine's
  own storage, so no second copy exists), and what the engine needs set afterwards.
- ``shared_kinds(module, converted)``: which of the checkpoint's shared-expert tensors
  (``weight``, ``scale``) installing the module puts in place from the conversion's pre-baked
  fused shared expert, so the engine must not load them; empty: it loads as usual.

:mod:`.driver` runs these steps for every engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol
from megamoe_convert.errors import InstallError  # noqa: F401

from torch import nn

if TYPE_CHECKING:
    from megamoe_convert.serve.loader import ConvertedModel, Destinations, ExpertLayer
    from megamoe_convert.source.families import ModelFamily
    from megamoe_convert.source.layers import MoELayer


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
        if family is not None and engine not in family.engines:
            bad.insert(0, family.engine_note or f"no pre-baked {family.title} experts")
        refusals[engine] = ", ".join(bad) or None
    return refusals


def require_engine(converted: "ConvertedModel", engine: str) -> None:
    """A conversion holds one engine's per-layer placement (``convert --engine``); another
    engine would read the wrong experts in the layers where the rules differ."""
    if converted.manifest.engine != engine:
        raise InstallError(f"{converted.path}: converted for {converted.manifest.engine}'s expert placement, "
                           f"not {engine}'s; convert with --engine {engine}")


def describe_engines(hidden: int, intermediate: int, family: "ModelFamily | None" = None) -> str:
    """One line for ``inspect`` / ``plan``: which engines serve these shapes, and why not the others."""
    refusals = shape_refusals(hidden, intermediate, family)
    parts = [engine if why is None else f"not {engine} ({why})" for engine, why in refusals.items()]
    return "; ".join(parts)


class Contract(Protocol):
    """One engine's way of holding MegaMoE experts (see the package docstring)."""

    name: str

    def detect(self, module: nn.Module) -> bool: ...

    def missing(self, module: nn.Module) -> list[str]:
        """What a module that looks like MegaMoE experts lacks to be of this contract."""
        ...

    def check(self, module: nn.Module, layer: "MoELayer", converted: "ConvertedModel", rank: int) -> None: ...

    def shared_kinds(self, module: nn.Module, converted: "ConvertedModel") -> tuple[str, ...]: ...

    def destinations(self, module: nn.Module, converted: "ConvertedModel") -> "Destinations": ...

    def finish(self, module: nn.Module, layer: "ExpertLayer") -> None: ...
