"""vLLM (0.30-0.33): a rank's pre-baked MegaMoE experts into vLLM's own modules, and every load
format's way to them.

- :mod:`.kernel_layout`: the >= 0.33 contract (``DeepGemmMegaMoEExperts``, parameters in the kernel layout);
- :mod:`.finalize`: the 0.30-0.32 contract (``DeepseekV4MegaMoEExperts``, ``finalize_weights`` transforms);
- :mod:`.experts`: what both contracts share (module prefixes, EP numbers, tensor checks);
- :mod:`.installing`: :func:`install` / :func:`install_layers` through the contracts;
- :mod:`.loader`: ``--load-format megamoe``;
- :mod:`.model_classes`: every other load format serves a conversion's experts or refuses;
- :mod:`.weight_cache`, :mod:`.preload`: the weight cache's key and ``ipc_cache`` loader; ``megamoe preload``;
- :mod:`.private_hooks`: the vLLM names used that are not its public extension API;
- :mod:`.plugin`: ``register()``, the ``vllm.general_plugins`` entry point, every registration in order.
"""

from __future__ import annotations

from megamoe_convert.engines import INSTALL_NAMES, at_first_use

__all__ = list(INSTALL_NAMES)
__getattr__ = at_first_use(__name__, "megamoe_convert.engines.vllm.installing")
