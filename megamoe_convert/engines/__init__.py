"""Engine contracts: how a serving engine's MegaMoE modules take a rank's pre-baked experts.

One package per engine (:mod:`.vllm`, :mod:`.sglang`), each with one module per contract, its
install, its ``--load-format megamoe`` loader, its ``model_classes`` (every other load format serves
a conversion's experts or refuses), the code that reaches into the engine's private names
(``private_hooks``) and one ``plugin.py`` whose ``register()`` is the engine's entry point. What
they share sits here: the :class:`~.contract.Contract` every contract implements, the install
:mod:`.driver`, what every load format shares (:mod:`.load_formats`), transformers' config
reading (:mod:`.hf_config`) and the transformers names it reaches (:mod:`.private_hooks`). Nothing
outside this package knows an engine's attribute names; which releases serve which families,
formats and shapes is the serving table's (``source/engines_table.py``), which the contracts read
too.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

#: What each engine package gives from its install module: its contracts and the install functions.
INSTALL_NAMES = ("CONTRACTS", "install", "install_layers")


def at_first_use(package: str, installing: str) -> Callable[[str], Any]:
    """An engine package's ``__getattr__``: :data:`INSTALL_NAMES` from its module ``installing``, imported
    when one is first asked for (the engine runs the package's plugin in every process, before any
    load, and the install driver's modules cost it nothing until a conversion is loaded)."""
    def __getattr__(name: str) -> Any:
        if name in INSTALL_NAMES:
            return getattr(importlib.import_module(installing), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
