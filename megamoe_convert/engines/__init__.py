"""Engine contracts: how a serving engine's MegaMoE modules take a rank's pre-baked experts.

One package per engine (:mod:`.vllm`, :mod:`.sglang`), each with one module per contract, its
install, its ``--load-format megamoe`` loader, its doors (every other load format serves a
conversion's experts or refuses), the code that reaches into the engine's private names
(``private_hooks``) and one ``plugin.py`` whose ``register()`` is the engine's entry point. What
they share sits here: the :class:`~.contract.Contract` every contract implements, the install
:mod:`.driver`, the engines' shape rules (:mod:`.shapes`), the doors' common parts
(:mod:`.shared_doors`) and transformers' config reading (:mod:`.hf_config`). Nothing outside this
package knows an engine's attribute names.
"""

from __future__ import annotations

from megamoe_convert.engines.shapes import SHAPE_RULES, describe_engines, shape_refusals

__all__ = ["SHAPE_RULES", "describe_engines", "shape_refusals"]
