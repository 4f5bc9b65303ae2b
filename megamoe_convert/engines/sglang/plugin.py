"""The ``sglang.srt.plugins`` entry point: everything megamoe-convert registers in an SGLang process.

SGLang's ``load_plugins()`` runs it in every SGLang process before server args are built; it wraps
SGLang's functions as SGLang's ``HookRegistry`` would, at a fraction of its cost (:mod:`.hooks`). Most
of those processes never load a conversion: the hooks that only a conversion's load, dump or recovery
runs are named here, and their modules (which import the install driver) are imported at their first
call (:data:`AT_FIRST_CALL`).
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any, Callable

from megamoe_convert.engines import hf_config
from megamoe_convert.engines.sglang import hooks, loader, model_classes, private_hooks

log = logging.getLogger(__name__)

#: (SGLang's target, this package's module, its ``AROUND`` hook): imported at the hook's first call.
AT_FIRST_CALL = (
    # --load-format presharded: a conversion's dump is recorded, its reload probed
    (private_hooks.PRESHARDED_FIRST_TIME, "presharded", "first_time_around"),
    (private_hooks.PRESHARDED_RELOAD, "presharded", "reload_around"),
    # EPLB recovery writes experts lost with failed ranks from the store
    (private_hooks.UPDATE_WITH_RECOVERY, "recovery", "recovery_around"),
)
#: The same for the weight cache's daemon and its mapping (megamoe preload), where SGLang has one.
WEIGHT_CACHE = (
    (private_hooks.IPC_MAP, "weight_cache", "map_around"),
    (private_hooks.DAEMON_LOAD, "weight_cache", "daemon_load_around"),
    (private_hooks.DAEMON_ANSWER, "weight_cache", "daemon_answer_around"),
)


@functools.cache  # one hook per name: a second register finds it applied
def at_first_call(module: str, name: str) -> Callable[..., Any]:
    """``megamoe_convert.engines.sglang.<module>.<name>``, its module imported when it is first called."""
    def hook(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(f"{__package__}.{module}"), name)(*args, **kwargs)

    hook.__name__ = hook.__qualname__ = name
    return hook


def register() -> None:
    """Every registration, in order; no-op without SGLang."""
    try:
        import sglang.srt  # noqa: F401
    except ImportError:
        log.debug("megamoe: sglang not importable; nothing registered")
        return
    from importlib.util import find_spec

    route = loader.register()  # --load-format megamoe
    hf_config.register()  # transformers reads a conversion's config.json with its original model_type
    weight_cache = WEIGHT_CACHE if find_spec(private_hooks.IPC_LOADER_MODULE) is not None else ()
    # every other load format installs a conversion's experts, or refuses; the rest's modules at first call
    hooks.around([route, *model_classes.HOOKS,
                  *((target, at_first_call(module, name)) for target, module, name in AT_FIRST_CALL + weight_cache)])
