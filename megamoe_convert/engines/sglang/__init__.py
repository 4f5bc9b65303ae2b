"""SGLang (0.5.23): a rank's pre-baked MegaMoE experts into SGLang's own ``FusedMoE`` modules, and
every load format's way to them.

- :mod:`.mega_moe`: the MegaMoE build contract (``fp8.py`` / ``build_mega_moe_experts_weights``);
- :mod:`.sm90_fp8`: Hopper's FP8 MegaMoE build contract (``build_sm90_mega_moe_experts_weights``);
- :mod:`.experts`: module names, placement and logical experts of SGLang's experts modules;
- :mod:`.installing`: :func:`install` / :func:`install_layers` through the contract;
- :mod:`.loader`: ``--load-format megamoe``;
- :mod:`.model_classes`: every other load format serves a conversion's experts or refuses;
- :mod:`.presharded`: ``--load-format presharded`` over a conversion (its dump recorded, its reload probed);
- :mod:`.weight_cache`, :mod:`.preload`: the weight-cache daemons (``megamoe preload``) and their mapping;
- :mod:`.private_hooks`: the SGLang names used that are not its public extension API;
- :mod:`.hooks`: the hooks applied as SGLang's ``HookRegistry`` applies them, without its walk per target;
- :mod:`.plugin`: ``register()``, the ``sglang.srt.plugins`` entry point, every registration in order.
"""

from __future__ import annotations

from megamoe_convert.engines import INSTALL_NAMES, at_first_use

__all__ = list(INSTALL_NAMES)
__getattr__ = at_first_use(__name__, "megamoe_convert.engines.sglang.installing")
