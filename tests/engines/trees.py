"""What the engine harnesses share: instances of an engine's own classes without their heavy
``__init__`` (GPU attention, tensor-parallel linears), holding only the MoE parts under test."""

from __future__ import annotations

from torch import nn


def bare(cls: type, **attributes) -> nn.Module:
    """An instance of the engine's class whose ``__init__`` is skipped, with ``attributes`` set."""
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    for name, value in attributes.items():
        setattr(module, name, value)
    return module
