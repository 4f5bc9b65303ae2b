"""``AROUND`` hooks on SGLang's names, applied as SGLang's ``HookRegistry`` applies them, at the cost
they need.

``HookRegistry.apply_hooks`` re-points, for each target, every stale ``from X import name`` binding by
walking every attribute of every module in ``sys.modules`` (thousands, once torch and SGLang are
imported), once per target, in every SGLang process that loads plugins. A method has no such
binding (it is reached through its class), so it is patched on its class alone; a module's function
is re-pointed in SGLang's own modules (the only ones that import SGLang's functions by name), in one
walk for all of them. The wrapper is the one ``HookRegistry`` builds (``functools.wraps``,
``__wrapped__``), so hooks other plugins register through ``HookRegistry`` wrap these as they would
wrap ours.

A target that does not resolve (another SGLang release) is logged and left: the hooks that see a
conversion refuse it where their partner is missing (:func:`hooked`), as a bare SGLang refuses a
conversion whose ``get_config`` hook is missing.
"""

from __future__ import annotations

import functools
import logging
import pkgutil
import sys
import types
from typing import Any, Callable, Iterable

log = logging.getLogger(__name__)

#: The attribute a wrapper carries: the hook it calls (so a second ``register`` wraps nothing twice).
HOOK_ATTR = "__megamoe_hook__"
#: Where SGLang's functions are bound by name.
SGLANG_PREFIX = "sglang."
#: Targets that did not resolve in this process, and why.
MISSING: dict[str, str] = {}


def wrap_around(original: Callable[..., Any], hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook(original, *args, **kwargs)`` in ``original``'s name, as ``HookRegistry`` wraps an ``AROUND`` hook."""
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return hook(original, *args, **kwargs)

    wrapper.__wrapped__ = original
    setattr(wrapper, HOOK_ATTR, hook)
    return wrapper


def hooked(fn: Any, hook: Callable[..., Any]) -> bool:
    """Whether ``fn`` (a function or method, as its owner gives it) is wrapped by ``hook``."""
    return getattr(fn, HOOK_ATTR, None) is hook


def around(hooks: Iterable[tuple[str, Callable[..., Any]]]) -> None:
    """Wrap each ``(target, hook)``'s target, a dotted ``module.function`` or ``module.Class.method``;
    then re-point the functions' bindings in SGLang's modules in one walk."""
    functions: dict[int, tuple[Any, Callable[..., Any]]] = {}
    for target, hook in hooks:
        try:
            owner_path, name = target.rsplit(".", 1)
            owner = pkgutil.resolve_name(owner_path)
            raw = vars(owner)[name] if name in vars(owner) else getattr(owner, name)
        except (ImportError, AttributeError, ValueError) as e:
            MISSING[target] = f"{type(e).__name__}: {e}"
            log.warning("megamoe: %s not found in this SGLang (%s); a conversion it serves is refused", target, e)
            continue
        if hooked(raw, hook) or hooked(getattr(raw, "__func__", None), hook):
            continue  # applied already in this process
        if isinstance(raw, (staticmethod, classmethod)):
            setattr(owner, name, type(raw)(wrap_around(raw.__func__, hook)))
            continue
        wrapped = wrap_around(raw, hook)
        setattr(owner, name, wrapped)
        if isinstance(owner, types.ModuleType):
            functions[id(raw)] = (raw, wrapped)
    repoint(functions)


def repoint(functions: dict[int, tuple[Any, Callable[..., Any]]]) -> None:
    """Every SGLang module's binding of an original function (``id`` -> (original, wrapper)) made the wrapper."""
    if not functions:
        return
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith(SGLANG_PREFIX) or not isinstance(module, types.ModuleType):
            continue
        for attr, value in list(vars(module).items()):
            found = functions.get(id(value))
            if found is not None and value is found[0]:
                setattr(module, attr, found[1])
