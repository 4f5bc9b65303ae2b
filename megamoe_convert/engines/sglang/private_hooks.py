"""Every SGLang name megamoe-convert uses that is not SGLang's public extension API, in one place.

SGLang's plugin API does most of the work: ``sglang.srt.plugins`` entry points, ``AROUND`` hooks
around its public functions (``get_config``, ``get_model_architecture``, the models'
``load_weights``: :mod:`.model_classes`, applied as its ``HookRegistry`` applies them: :mod:`.hooks`)
and ``add_load_format_choices`` (:mod:`.loader`). What it cannot
do is make a new ``--load-format`` load: SGLang has no loader registry, so only these can, each
checked against the supported release by ``tests/engines/test_sglang_private_hooks.py`` (and
exercised by the load-format tests):

- ``LoadConfig._verify_load_format`` turns ``--load-format`` into its ``LoadFormat`` enum and
  refuses any other name: hooked, the name becomes the loader class itself, which
  ``get_model_loader`` instantiates.
- ``DefaultModelLoader._get_all_weights`` is the one iterator of every weight the model's
  ``load_weights`` is fed: the loader class wraps it.
- ``eplb_manager.update_expert_location_with_recovery`` is where SGLang's EPLB moves experts and
  restores those lost with failed ranks; :mod:`.recovery` hooks it, wraps its
  ``ExpertLocationUpdater.update`` and reads the failed ranks off ``ElasticEPStateManager.instance()``
  (exercised by ``tests/engines/test_sglang_recovery.py``).
- ``PreshardedModelLoader._first_time_load_and_dump`` / ``._load_from_presharded`` (``--load-format
  presharded``'s two paths) and the loader module's ``_initialize_model``, which builds the model a
  reload fills: :mod:`.presharded` hooks around them.
- The weight cache's ``IpcModelLoader._load_zero_copy_mode`` (and the ``_initialize_model`` its
  module imported), ``WeightCacheDaemon.load`` / ``._handle_connection``: :mod:`.weight_cache`
  hooks around them; ``run_weight_cache_daemon``, the daemons' spawned target, which
  :mod:`.preload` hands SGLang's launcher in its place.

The experts modules' own attributes (``_mega_moe_weights_built``, ...) are the contract's subject
and stay in :mod:`.mega_moe`.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

#: The method SGLang calls to turn ``--load-format`` into its ``LoadFormat`` enum.
VERIFY_LOAD_FORMAT = "sglang.srt.configs.load_config.LoadConfig._verify_load_format"

#: ``--load-format presharded``'s first run (load, then dump) and its reload of a dump.
PRESHARDED_FIRST_TIME = "sglang.srt.model_loader.loader.PreshardedModelLoader._first_time_load_and_dump"
PRESHARDED_RELOAD = "sglang.srt.model_loader.loader.PreshardedModelLoader._load_from_presharded"

#: The weight cache: the engine's mapping of a daemon's tensors, the daemon's load and its answer.
IPC_LOADER_MODULE = "sglang.srt.weight_cache.ipc_loader"
IPC_MAP = f"{IPC_LOADER_MODULE}.IpcModelLoader._load_zero_copy_mode"
DAEMON_MODULE = "sglang.srt.weight_cache.daemon"
DAEMON_LOAD = f"{DAEMON_MODULE}.WeightCacheDaemon.load"
DAEMON_ANSWER = f"{DAEMON_MODULE}.WeightCacheDaemon._handle_connection"
#: EPLB's recovery of experts lost with failed ranks (``recovery.py`` writes them from the store).
UPDATE_WITH_RECOVERY = "sglang.srt.eplb.eplb_manager.update_expert_location_with_recovery"
#: The loader module whose ``_initialize_model`` builds the model a presharded reload fills.
LOADER_MODULE = "sglang.srt.model_loader.loader"

#: Every private name used here, as ``module:attribute.path`` (the test resolves each).
PRIVATE_NAMES = (
    "sglang.srt.configs.load_config:LoadConfig._verify_load_format",
    "sglang.srt.model_loader.loader:DefaultModelLoader._get_all_weights",
    "sglang.srt.model_loader.loader:PreshardedModelLoader._first_time_load_and_dump",
    "sglang.srt.model_loader.loader:PreshardedModelLoader._load_from_presharded",
    "sglang.srt.model_loader.loader:_initialize_model",
    "sglang.srt.eplb.eplb_manager:update_expert_location_with_recovery",
    "sglang.srt.eplb.expert_location_updater:ExpertLocationUpdater.update",
    "sglang.srt.elastic_ep.elastic_ep:ElasticEPStateManager.instance",
    "sglang.srt.weight_cache.ipc_loader:IpcModelLoader._load_zero_copy_mode",
    "sglang.srt.weight_cache.ipc_loader:_initialize_model",
    "sglang.srt.weight_cache.daemon:WeightCacheDaemon.load",
    "sglang.srt.weight_cache.daemon:WeightCacheDaemon._handle_connection",
    "sglang.srt.weight_cache.daemon:run_weight_cache_daemon",
    "sglang.srt.plugins.hook_registry:HookRegistry._hooks",
)

#: ``weights(model_config, model, own)``: the weights fed to ``load_weights``, given SGLang's own iterator ``own()``.
Weights = Callable[[Any, nn.Module, Callable[[], Iterator[tuple[str, torch.Tensor]]]],
                   Iterator[tuple[str, torch.Tensor]]]


def default_loader_class(name: str, load_config: Callable[[Any], Any], weights: Weights) -> type:
    """SGLang's ``DefaultModelLoader`` (named ``name``) built with ``load_config(config)`` and
    feeding the model ``weights(...)`` instead of its own iterator."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    def __init__(self: Any, config: Any) -> None:
        DefaultModelLoader.__init__(self, load_config(config))

    def _get_all_weights(self: Any, model_config: Any, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        own = functools.partial(DefaultModelLoader._get_all_weights, self, model_config, model)
        yield from weights(model_config, model, own)

    return type(name, (DefaultModelLoader,), {"__init__": __init__, "_get_all_weights": _get_all_weights,
                                              "__doc__": f"``--load-format``'s {name}."})


def replaced_elsewhere(targets: Iterable[str]) -> list[str]:
    """Those of ``targets`` another plugin replaces outright through SGLang's ``HookRegistry``
    (``HookType.REPLACE``, applied around our hook: what it replaces, our hook included, never runs)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    registered = HookRegistry._hooks
    return sorted(t for t in targets if any(kind == HookType.REPLACE for kind, _, _ in registered.get(t, ())))


@functools.cache  # one hook per name: a second registration finds it applied
def route_load_format(name: str, loader_class: Callable[[], type]) -> tuple[str, Callable[..., None]]:
    """``--load-format NAME`` loads with ``loader_class()``: the ``AROUND`` hook of ``_verify_load_format``
    and its target."""
    def as_loader_class(verify: Callable[[Any], None], config: Any) -> None:
        if isinstance(config.load_format, str) and config.load_format.lower() == name:
            config.load_format = loader_class()
            return
        verify(config)

    return VERIFY_LOAD_FORMAT, as_loader_class


@contextmanager
def after_model_built(then: Callable[[nn.Module], None], module: str = LOADER_MODULE) -> Iterator[None]:
    """Inside: every model ``module`` builds (its ``_initialize_model``: SGLang's loader module, or
    the weight cache's IPC loader, which imported it) goes through ``then`` before the loader sees it."""
    import importlib

    loader = importlib.import_module(module)
    built = getattr(loader, "_initialize_model")  # noqa: B009 (a module's private function)

    def initialize(*args: Any, **kwargs: Any) -> Any:
        model = built(*args, **kwargs)
        then(model)
        return model

    setattr(loader, "_initialize_model", initialize)  # noqa: B010
    try:
        yield
    finally:
        setattr(loader, "_initialize_model", built)  # noqa: B010
