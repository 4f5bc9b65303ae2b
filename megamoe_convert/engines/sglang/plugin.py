"""The ``sglang.srt.plugins`` entry point: everything megamoe-convert registers in an SGLang process.

SGLang's ``load_plugins()`` runs it in every SGLang process before server args are built, then
applies the hooks registered here.
"""

from __future__ import annotations

import logging

from megamoe_convert.engines import hf_config
from megamoe_convert.engines.sglang import loader, model_classes, presharded, recovery, weight_cache

log = logging.getLogger(__name__)


def register() -> None:
    """Every registration, in order; no-op without SGLang."""
    try:
        import sglang.srt.plugins.hook_registry  # noqa: F401
    except ImportError:
        log.debug("megamoe: sglang not importable; nothing registered")
        return
    loader.register()  # --load-format megamoe
    hf_config.register()  # transformers reads a conversion's config.json with its original model_type
    model_classes.register()  # every other load format installs a conversion's experts, or refuses
    presharded.register()  # --load-format presharded: a reload of a conversion's dump is probed
    weight_cache.register()  # --weight-cache-mode client maps a conversion's daemon (megamoe preload)
    recovery.register()  # EPLB recovery writes experts lost with failed ranks from the store
