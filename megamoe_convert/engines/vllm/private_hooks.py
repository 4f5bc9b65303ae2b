"""Every vLLM name megamoe-convert uses that is not vLLM's public extension API, in one place.

vLLM's public hooks do most of the work (``register_model_loader``, ``ModelRegistry.register_model``,
``register_config_parser``, in :mod:`.loader`, :mod:`.model_classes` and :mod:`.weight_cache`). What they
cannot do, only these can, each checked against every supported release by
``tests/engines/test_vllm_private_hooks.py`` (and exercised by the loader, model-class and weight-cache
tests):

- DeepGEMM as vLLM imports it (``vllm.utils.deep_gemm._import_deep_gemm``): 0.32's
  ``finalize_weights`` asks its backend whether it fuses shared experts with that module, and the
  finalize contract asks the same question.
- Where vLLM's registry finds an architecture's own class (``registry._VLLM_MODELS``) and which
  architectures its Transformers backend serves (``_TRANSFORMERS_BACKEND_MODELS``): the model
  classes register subclasses of those classes under the same names.
- Which files vLLM's ``DefaultModelLoader`` reads for a weights source (``_prepare_weights``), and
  its per-source iterator (``_get_weights_iterator``), which ``--load-format megamoe`` replaces for a
  local conversion's non-expert shards (read through the staging ring instead of vLLM's iterator).
- vLLM's weight cache: its key function (``protocol.hash_checkpoint``, extended so two
  conversions of one source never share a key), its ``IpcModelLoader``'s fetch and disk fallback
  (``_fetch_entries``, ``_fallback_load``, ``_fallback_load_config``), and the daemon's spawned
  target (``daemon._run_daemon``, replaced while ``megamoe preload`` runs vLLM's own command).

The experts modules' own attributes (``_transformed_l1_weights``, ``_check_runtime_supported``,
``_w2_input_scales``, ...) are the contracts' subject and stay in their contract modules.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Callable, Iterator

#: The vLLM package holding the weight cache (its daemon, key and ``ipc_cache`` loader).
WEIGHT_CACHE = "vllm.model_executor.model_loader.weight_cache"

#: vLLM's module of ``DefaultModelLoader``.
DEFAULT_LOADER = "vllm.model_executor.model_loader.default_loader"

#: Every private name used here, as ``module:attribute.path`` (the test resolves each in every release).
PRIVATE_NAMES = (
    f"{DEFAULT_LOADER}:DefaultModelLoader._prepare_weights",
    f"{DEFAULT_LOADER}:DefaultModelLoader._get_weights_iterator",
    "vllm.utils.deep_gemm:_import_deep_gemm",
    "vllm.model_executor.models.registry:_VLLM_MODELS",
    "vllm.model_executor.models.registry:_TRANSFORMERS_BACKEND_MODELS",
    f"{WEIGHT_CACHE}.protocol:hash_checkpoint",
    f"{WEIGHT_CACHE}.protocol:CacheConfigMismatchError",
    f"{WEIGHT_CACHE}.ipc_loader:IpcModelLoader._fetch_entries",
    f"{WEIGHT_CACHE}.ipc_loader:IpcModelLoader._fallback_load",
    f"{WEIGHT_CACHE}.ipc_loader:IpcModelLoader._fallback_load_config",
    f"{WEIGHT_CACHE}.daemon:_run_daemon",
)

#: What vLLM chooses a source's files or tensors by beyond its folder, read where set: a
#: ``DefaultModelLoader``'s encoder-only filter (vLLM 0.31 on) and its ``LoadConfig``'s load strategy.
ENCODER_ONLY_PREFIXES = "_encoder_only_lm_prefixes"
LOAD_STRATEGY = "safetensors_load_strategy"


def weight_files(loader: Any, source: Any) -> list[str] | None:
    """The safetensors files vLLM's ``DefaultModelLoader`` ``loader`` reads for the weights
    ``source`` (its own choice: the index's shards of the folder), ``None`` where they are no
    safetensors; downloads nothing for a local folder."""
    found = loader._prepare_weights(source.model_or_path, source.subfolder, source.revision,
                                    source.fall_back_to_pt, source.allow_patterns_overrides)
    return list(found[1]) if found[2] else None


def deep_gemm() -> Any:
    """The DeepGEMM module vLLM's MegaMoE backends run (its bundled or installed one)."""
    from vllm.utils.deep_gemm import _import_deep_gemm

    return _import_deep_gemm()


def model_class(arch: str) -> type:
    """vLLM's own class for the architecture ``arch``, as its registry would import it."""
    from vllm.model_executor.models import registry

    module, cls = registry._VLLM_MODELS[arch]
    module = module if module.startswith("vllm.") else f"vllm.model_executor.models.{module}"
    return getattr(importlib.import_module(module), cls)


def transformers_backend_architectures() -> tuple[str, ...]:
    """The architectures vLLM's Transformers backend (``--model-impl transformers``) serves."""
    from vllm.model_executor.models import registry

    return tuple(getattr(registry, "_TRANSFORMERS_BACKEND_MODELS", {}))


def weight_cache(part: str) -> ModuleType | None:
    """``vllm.model_executor.model_loader.weight_cache.<part>``, or None in a vLLM without it."""
    try:
        return importlib.import_module(f"{WEIGHT_CACHE}.{part}")
    except ImportError:
        return None


def extend_checkpoint_hash(extend: Callable[[Callable[[str], str | None]], Callable[[str], str | None]]) -> None:
    """Replace the weight cache's key function by ``extend(key function)``."""
    protocol: Any = importlib.import_module(f"{WEIGHT_CACHE}.protocol")  # vLLM's module, untyped here
    protocol.hash_checkpoint = extend(protocol.hash_checkpoint)


def ipc_loader_class(refusal: Callable[[str], str | None], fallback_format: Callable[[str], str | None]) -> type:
    """vLLM's ``IpcModelLoader`` (``--load-format ipc_cache``), except: before any daemon is asked,
    ``refusal(model)`` (a reason) makes the fetch fail as a cache mismatch does, so vLLM's disk
    fallback follows; and that fallback loads with ``fallback_format(model)`` where it names one."""
    protocol = importlib.import_module(f"{WEIGHT_CACHE}.protocol")
    base: Any = importlib.import_module(f"{WEIGHT_CACHE}.ipc_loader").IpcModelLoader
    mismatch = protocol.CacheConfigMismatchError

    class MegaMoEIpcModelLoader(base):
        megamoe = True

        def _fetch_entries(self, model_config: Any, *args: Any, **kwargs: Any) -> Any:
            why = refusal(model_config.model)
            if why:  # before asking any daemon: the fallback (or, without one, this error) follows
                raise mismatch(why)
            return super()._fetch_entries(model_config, *args, **kwargs)

        def _fallback_load(self, vllm_config: Any, model_config: Any, prefix: str) -> Any:
            load_format = fallback_format(model_config.model)
            if load_format is None:
                return super()._fallback_load(vllm_config, model_config, prefix)
            from vllm.model_executor.model_loader import get_model_loader

            config = self._fallback_load_config()
            config.load_format = load_format
            return get_model_loader(config).load_model(vllm_config=vllm_config, model_config=model_config,
                                                       prefix=prefix)

    return MegaMoEIpcModelLoader


def daemon_target() -> Callable[..., None]:
    """What vLLM's ``vllm preload`` spawns as each daemon (its ``_run_daemon``, unless replaced)."""
    return importlib.import_module(f"{WEIGHT_CACHE}.daemon")._run_daemon


@contextmanager
def replaced_daemon_target(entry: Callable[..., None]) -> Iterator[Callable[..., None]]:
    """While inside: vLLM's ``vllm preload`` spawns ``entry`` as each daemon; yields vLLM's own target."""
    daemon: Any = importlib.import_module(f"{WEIGHT_CACHE}.daemon")  # vLLM's module, untyped here
    own = daemon._run_daemon
    daemon._run_daemon = entry  # what vLLM's cmd imports
    try:
        yield own
    finally:
        daemon._run_daemon = own
