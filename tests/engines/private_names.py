"""What both engines' private-hooks tests share: a name of the engine's code as its
``private_hooks.PRIVATE_NAMES`` writes it (``package.module:Class.attribute``), looked up in the
release at hand."""

from __future__ import annotations

import importlib


def resolve(dotted: str) -> object:
    """The object ``dotted`` names; an ``ImportError`` or ``AttributeError`` where this release has none."""
    module, _, path = dotted.partition(":")
    found: object = importlib.import_module(module)
    for part in path.split("."):
        found = getattr(found, part)
    return found
