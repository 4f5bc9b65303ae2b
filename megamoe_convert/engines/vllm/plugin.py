"""The ``vllm.general_plugins`` entry point: everything megamoe-convert registers in a vLLM process.

vLLM runs it in every process that loads plugins (the engine, its workers; a weight-cache daemon
through :func:`.preload.prepare_daemon`), before any config is read.
"""

from __future__ import annotations

import logging

from megamoe_convert.engines import hf_config
from megamoe_convert.engines.vllm import loader, model_classes, weight_cache

log = logging.getLogger(__name__)

_registered = False


def register() -> None:
    """Every registration, in order; once per process (a spawned daemon may run it twice); no-op
    without vLLM."""
    global _registered
    if _registered:
        return
    try:
        import vllm.model_executor.model_loader  # noqa: F401
    except ImportError:
        log.debug("megamoe: vllm not importable; nothing registered")
        return
    loader.register()  # --load-format megamoe (register_model_loader)
    hf_config.register()  # transformers reads a conversion's config.json with its original model_type
    model_classes.register_config_parser()  # vLLM's hf config parser puts the original architectures back
    model_classes.register_models()  # each MegaMoE model class installs a conversion's experts first
    weight_cache.register()  # the weight cache's key, and ipc_cache's fallback to --load-format megamoe
    _registered = True
