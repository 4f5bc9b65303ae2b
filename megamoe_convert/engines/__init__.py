"""Engine contracts: how a serving engine's MegaMoE modules take a rank's pre-baked experts.

One module per contract, each with the same three steps, so that nothing outside this package
knows an engine's attribute names:

- ``detect(module)``: is this module of my contract? (by what it has, never by class name)
- ``check(module, layer, converted, rank)``: is it built for exactly what was converted?
  Raises :class:`InstallError` naming the module and both values. Runs for every module
  before any module is changed.
- ``destinations(module, converted)`` + ``finish(module, layer)``: where the file bytes go (the engine's
  own storage, so no second copy exists), and what the engine needs set afterwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from torch import nn

if TYPE_CHECKING:
    from ..checkpoint import MoELayer
    from ..loader import ConvertedModel, Destinations, ExpertLayer


class InstallError(ValueError):
    """A model whose MegaMoE modules do not match the converted directory (or no known contract)."""


class Contract(Protocol):
    """One engine's way of holding MegaMoE experts (see the package docstring)."""

    name: str

    def detect(self, module: nn.Module) -> bool: ...

    def missing(self, module: nn.Module) -> list[str]:
        """What a module that looks like MegaMoE experts lacks to be of this contract."""
        ...

    def check(self, module: nn.Module, layer: "MoELayer", converted: "ConvertedModel", rank: int) -> None: ...

    def destinations(self, module: nn.Module, converted: "ConvertedModel") -> "Destinations": ...

    def finish(self, module: nn.Module, layer: "ExpertLayer") -> None: ...
