"""The interface every engine contract implements: how one kind of engine module holds MegaMoE experts.

A contract is found by what a module has, never by class name, and installing through it takes
the steps :mod:`.driver` runs for every engine, in this order:

- :meth:`Contract.detect` / :meth:`Contract.missing`: is this module of my contract (and if not,
  what does it lack)?
- :meth:`Contract.bind`: the contract for one module, given the module that holds it (its owner
  may hold what the contract also fills, e.g. vLLM 0.32's shared MLP).
- :meth:`Contract.check`: is the module built for exactly what was converted? Raises
  :class:`~megamoe_convert.errors.InstallError` naming the module and both values. Runs for every module before any
  module is changed.
- :meth:`Contract.shared_kinds`: which of the checkpoint's shared-expert tensors (``weight``,
  ``scale``) the install puts in place from the conversion's pre-baked fused shared expert, so
  the engine must not load them; empty: it loads them as usual.
- :meth:`Contract.layout_probe`: the engine's own loading code, run on one synthetic expert
  (:mod:`.probe`) after every check and before any module is changed: its bytes must be the
  conversion's layout.
- :meth:`Contract.destinations` + :meth:`Contract.finish`: where the file bytes go (the engine's
  own storage, so no second copy exists), and what the engine needs set afterwards.

A new contract (another engine release, another kernel) subclasses :class:`Contract` in its
engine's package; a new step every contract must take is a new method here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias

from megamoe_convert.errors import InstallError

if TYPE_CHECKING:
    from megamoe_convert.engines.probe import LayoutProbe
    from megamoe_convert.serve.converted import ConvertedModel, Destinations, ExpertLayer
    from megamoe_convert.source.layers import MoELayer

__all__ = ["Contract", "EngineModule"]

#: An engine's MoE layer (a ``torch.nn.Module`` of vLLM's or SGLang's, whose classes import only in the
#: engine's own environment). Its attributes are the engine's, which a contract's :meth:`Contract.missing`
#: checks before any other method reads them; they have no types here.
EngineModule: TypeAlias = Any


class Contract(ABC):
    """One engine's way of holding MegaMoE experts (see the module docstring)."""

    #: Named in refusals: the engine release and module class this contract is for.
    name: ClassVar[str]

    @abstractmethod
    def missing(self, module: EngineModule) -> list[str]:
        """What a module that looks like MegaMoE experts lacks to be of this contract."""

    def detect(self, module: EngineModule) -> bool:
        """The module is of this contract: it lacks nothing."""
        return not self.missing(module)

    def bind(self, owner: EngineModule | None) -> "Contract":
        """This contract for a module held by ``owner``; by default the owner changes nothing."""
        return self

    @abstractmethod
    def check(self, module: EngineModule, layer: "MoELayer", converted: "ConvertedModel", rank: int) -> None:
        """Refuse (``InstallError``) a module not built for exactly what ``converted`` holds."""

    @abstractmethod
    def shared_kinds(self, module: EngineModule, converted: "ConvertedModel") -> tuple[str, ...]:
        """The shared-expert tensor kinds the install puts in place (the engine must skip them)."""

    def layout_probe(self, module: EngineModule, converted: "ConvertedModel") -> "LayoutProbe":
        """The engine's own loading code on the layout probe's synthetic expert, for ``module``; a
        contract without one cannot prove its byte layout, so it is refused unless the caller opts out."""
        raise InstallError(f"{self.name}: megamoe-convert has no layout probe for this contract, so it cannot check "
                           "the engine's byte layout; pass probe=False or set MEGAMOE_LAYOUT_PROBE=0 to serve "
                           "unchecked")

    @abstractmethod
    def destinations(self, module: EngineModule, converted: "ConvertedModel") -> "Destinations":
        """Rank-file key -> the tensor in the engine's own storage its bytes go into."""

    @abstractmethod
    def finish(self, module: EngineModule, layer: "ExpertLayer") -> None:
        """What the engine needs set once the bytes are in place."""
