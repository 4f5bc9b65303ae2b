"""``AROUND`` hooks on SGLang's names, applied as SGLang's ``HookRegistry`` applies them, at the cost
they need.

``HookRegistry.apply_hooks`` imports every target's module, and re-points, for each target, every
stale ``from X import name`` binding by walking every attribute of every module in ``sys.modules``
(thousands, once torch and SGLang are imported), in every SGLang process that loads plugins: the
launcher's too, before it starts the schedulers. Here a target's module already imported is hooked at
once; any other is hooked the moment it is imported (:class:`AfterImport`), so a process that never
imports a model's module never pays for it. A method is patched on its class alone (it is reached
through its class); a module's function is re-pointed in SGLang's own modules (the only ones that
import SGLang's functions by name), in one walk for all the functions hooked together. The wrapper is
the one ``HookRegistry`` builds (``functools.wraps``, ``__wrapped__``), so hooks other plugins register
through ``HookRegistry`` wrap these as they would wrap ours.

A target that does not resolve (another SGLang release) is logged and left unhooked (:data:`MISSING`);
``model_classes`` refuses a conversion where that leaves its experts uninstalled, or where another
plugin replaces a target outright.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import types
import weakref
from typing import Any, Callable, Iterable, Sequence

log = logging.getLogger(__name__)

#: Where SGLang's functions are bound by name.
SGLANG_PREFIX = "sglang."
#: Targets that did not resolve in this process, and why.
MISSING: dict[str, str] = {}
#: Every target given to :func:`around` in this process.
TARGETS: set[str] = set()
#: The wrappers made here, and the hook each calls (an outer wrapper copies a wrapper's attributes,
#: so only identity says which is ours).
_OURS: weakref.WeakKeyDictionary[Any, Callable[..., Any]] = weakref.WeakKeyDictionary()

Hook = tuple[str, Callable[..., Any]]


def wrap_around(original: Callable[..., Any], hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook(original, *args, **kwargs)`` in ``original``'s name, as ``HookRegistry`` wraps an ``AROUND`` hook."""
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return hook(original, *args, **kwargs)

    wrapper.__wrapped__ = original
    _OURS[wrapper] = hook
    return wrapper


def hooked(fn: Any, hook: Callable[..., Any]) -> bool:
    """Whether ``fn`` (a function or method, as its owner gives it) is ``hook``'s wrapper, or wraps it
    (another plugin's hook around ours: ``__wrapped__`` leads to it)."""
    for _ in range(64):
        fn = getattr(fn, "__func__", fn)
        if fn is None:
            return False
        try:
            if _OURS.get(fn) is hook:
                return True
        except TypeError:  # not weakly referable: no wrapper of ours, but it may wrap one
            pass
        fn = getattr(fn, "__wrapped__", None)
    return False


def in_place(target: str, hook: Callable[..., Any]) -> bool:
    """Whether ``target`` is ``hook``'s wrapper in its module as it stands (a module not imported yet
    is hooked when it is: in place too)."""
    module, path = split_target(target)
    owner: Any = sys.modules.get(module)
    if owner is None:
        return True
    for part in path:
        owner = getattr(owner, part, None)
    return hooked(owner, hook)


def module_of(target: str) -> str:
    """The module a dotted target lives in: ``pkg.mod.func`` -> ``pkg.mod``, ``pkg.mod.Class.method`` ->
    ``pkg.mod`` (a capitalised second-to-last part names a class)."""
    parts = target.split(".")
    return ".".join(parts[:-2] if parts[-2][:1].isupper() else parts[:-1])


def split_target(target: str) -> tuple[str, list[str]]:
    """The target's module and the attributes that lead from it to the target (``["Class", "method"]``)."""
    module = module_of(target)
    return module, target[len(module) + 1:].split(".")


def around(hooks: Iterable[Hook]) -> None:
    """Wrap each ``(target, hook)``'s target, a dotted ``module.function`` or ``module.Class.method``:
    now where its module is imported, else when it is."""
    now: list[Hook] = []
    for target, hook in hooks:
        TARGETS.add(target)
        if module_of(target) in sys.modules:
            now.append((target, hook))
        else:
            AfterImport.install().add(module_of(target), (target, hook))
    apply(now)


def apply(hooks: Sequence[Hook]) -> None:
    """Wrap each target of an imported module; then re-point the functions' bindings in one walk."""
    functions: dict[int, tuple[Any, Callable[..., Any]]] = {}
    for target, hook in hooks:
        try:
            module, (*path, name) = split_target(target)
            owner = sys.modules[module]
            for part in path:
                owner = getattr(owner, part)
            raw = vars(owner)[name] if name in vars(owner) else getattr(owner, name)
        except Exception as e:  # this target left unhooked, every other one still hooked
            MISSING[target] = f"{type(e).__name__}: {e}"
            log.warning("megamoe: %s not found in this SGLang (%s): left unhooked", target, e)
            continue
        if hooked(raw, hook):
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
    wanted = functions.keys()
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith(SGLANG_PREFIX) or not isinstance(module, types.ModuleType):
            continue
        bindings = vars(module)
        if wanted.isdisjoint(map(id, list(bindings.values()))):  # most modules: one pass in C
            continue
        for attr, value in list(bindings.items()):
            found = functions.get(id(value))
            if found is not None and value is found[0]:
                setattr(module, attr, found[1])


class AfterImport(importlib.abc.MetaPathFinder):
    """On ``sys.meta_path`` once a module's hooks wait for its import: that module's loader runs it,
    then :func:`apply` hooks it, before whatever imported it binds a name from it. It stays there,
    answering nothing once nothing waits (removing it could make another thread's import, iterating
    ``sys.meta_path`` meanwhile, skip a finder)."""

    _instance: AfterImport | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.pending: dict[str, list[Hook]] = {}
        self._finding = threading.local()  # the names this thread is finding (another finder may ask back)

    @classmethod
    def install(cls) -> AfterImport:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            if cls._instance not in sys.meta_path:
                sys.meta_path.insert(0, cls._instance)
            return cls._instance

    def add(self, module: str, hook: Hook) -> None:
        with self._lock:
            self.pending.setdefault(module, []).append(hook)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.pending:  # every import of the process asks: answered at once
            return None
        finding = self._finding.__dict__.setdefault("names", set())
        if fullname in finding:
            return None
        finding.add(fullname)
        try:
            spec = next((found for finder in list(sys.meta_path) if finder is not self and hasattr(finder, "find_spec")
                         and (found := finder.find_spec(fullname, path, target)) is not None), None)
        finally:
            finding.discard(fullname)
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        if getattr(loader.exec_module, "_megamoe_after", None) is not self:  # one wrapper a loader, shared or not
            run = loader.exec_module

            def exec_module(module: types.ModuleType) -> None:
                run(module)
                self.imported(module)

            exec_module._megamoe_after = self  # type: ignore[attr-defined]
            loader.exec_module = exec_module
        return spec

    def imported(self, module: types.ModuleType) -> None:
        """``module`` ran: its hooks applied, where the import system put it in ``sys.modules`` (a copy run
        apart from it is not the one to hook)."""
        name = getattr(module.__spec__, "name", None) or module.__name__
        if sys.modules.get(name) is not module:
            return
        with self._lock:
            hooks = self.pending.pop(name, [])
        apply(hooks)
