"""SGLang's weight cache serving a conversion (SGLang 0.5.23, ``sglang/srt/weight_cache/``).

SGLang's daemon (``python -m sglang.srt.weight_cache.daemon``; ``megamoe preload``: :mod:`.preload`)
loads one rank's model with ``DefaultModelLoader``, post-processes it and exports every parameter
and buffer over CUDA IPC; an engine started with ``--weight-cache-mode client`` builds the model on
``meta`` (``IpcModelLoader._load_zero_copy_mode``), replaces every tensor the daemon exports and
skips post-processing. Three things stand between that and a conversion's MegaMoE experts, each
handled by a hook :func:`register` adds (names in :mod:`.private_hooks`):

- **the meta model**: a MegaMoE module built on ``meta`` still has the loader-side FP32 scales,
  while the daemon exports the kernel layout's int32 ones (SM100), which SGLang's shape check
  refuses. Before mapping, the layout probe runs on the fresh modules (a daemon started by another
  SGLang release is caught as an install catches it) and each module's scale parameters take the
  installed shapes (:func:`shape_as_installed`).
- **the Python-side state**: post-processing leaves ``mega_l1_weights`` / ``mega_l2_weights`` (the
  kernel's tensors), ``_mega_moe_weights_built`` and the scales' ``format_ue8m0``, which no export
  carries; after mapping they are set on the mapped tensors (:func:`rebuild_state`), as the
  contract's ``finish`` sets them, with no copy.
- **the cache key**: SGLang's ``CacheConfig`` names the model path, not what it holds; a daemon
  records the conversion it loaded, and answers an engine as a mismatched config once the
  conversion at its path is another (converted again since), so it is never mapped.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from megamoe_convert.engines.contract import Contract, EngineModule
from megamoe_convert.engines.sglang import mega_moe, private_hooks, sm90_fp8
from megamoe_convert.engines.sglang.installing import CONTRACTS, ENGINE
from megamoe_convert.engines.sglang.presharded import conversion_path, conversion_seal, probe_model
from megamoe_convert.errors import InstallError
from megamoe_convert.hub.resolve import open_converted
from megamoe_convert.output.naming import MANIFEST_NAME

log = logging.getLogger(__name__)

#: Set on a daemon once it loaded a conversion: the conversion's identity (its manifest's seal).
LOADED_ATTR = "megamoe_conversion_seal"


def _installed_scales(module: EngineModule, converted: Any) -> dict[str, torch.Tensor]:
    """SM100: the int32 scales an install leaves in ``w13/w2_weight_scale_inv`` (shapes, on meta)."""
    dest = mega_moe.CONTRACT.destinations(module, converted)
    return {"w13_weight_scale_inv": dest["l1_sf"].transpose(1, 2), "w2_weight_scale_inv": dest["l2_sf"].transpose(1, 2)}


def shape_as_installed(model: nn.Module, path: str) -> None:
    """The meta model's MegaMoE scale parameters with the shapes and dtypes the daemon exports."""
    converted = open_converted(path, ())
    for module, contract in ENGINE.classify(model):
        if contract is not mega_moe.CONTRACT:
            continue  # SM90: post-processing keeps every shape and dtype
        for name, like in _installed_scales(module, converted).items():
            getattr(module, name).data = torch.empty_like(like, device="meta")


def _sm100_state(module: EngineModule) -> None:
    for gemm, scale in (("l1", "w13"), ("l2", "w2")):
        getattr(module, f"{scale}_weight_scale_inv").format_ue8m0 = True
        setattr(module, f"mega_{gemm}_weights", (getattr(module, f"{scale}_weight").data,
                                                  getattr(module, f"mega_{scale}_weight_scale_utccp").data))


def _sm90_state(module: EngineModule) -> None:
    module.mega_l1_weights = (module.w13_weight.data, module.w13_weight_scale_inv.data)
    module.mega_l2_weights = (module.w2_weight.data, module.w2_weight_scale_inv.data)
    module._mega_moe_sm90_fp8_weights = True


#: Each contract's Python-side state, set on the tensors mapped from the daemon.
STATE: dict[Contract | None, Callable[[EngineModule], None]] = {mega_moe.CONTRACT: _sm100_state,
                                                        sm90_fp8.CONTRACT: _sm90_state}


def rebuild_state(model: nn.Module) -> int:
    """Every MegaMoE module's Python-side state on its mapped tensors; refuses one the daemon left
    on ``meta`` (SGLang's own check lists them first)."""
    found = ((m, next((c for c in CONTRACTS if c.detect(m)), None)) for m in model.modules())
    modules: list[tuple[Any, Contract | None]] = [(m, c) for m, c in found if c in STATE]
    for module, contract in modules:
        if module.w13_weight.is_meta:
            raise InstallError(f"{module.layer_name}: the weight-cache daemon exported no experts for it")
        STATE[contract](module)
        module._mega_moe_weights_built = True
    return len(modules)


def map_around(original: Callable[..., Any], loader: Any, model_config: Any, *args: Any, **kwargs: Any) -> Any:
    """``AROUND`` hook of ``IpcModelLoader._load_zero_copy_mode`` (see the module docstring)."""
    path = conversion_path(model_config)
    if path is None:
        return original(loader, model_config, *args, **kwargs)

    def prepare(model: nn.Module) -> None:
        probe_model(model, path)
        shape_as_installed(model, path)

    with private_hooks.after_model_built(prepare, private_hooks.IPC_LOADER_MODULE):
        model = original(loader, model_config, *args, **kwargs)
    log.info("megamoe: mapped %d MegaMoE layers of %s from the weight-cache daemon", rebuild_state(model), path)
    return model


def daemon_load_around(original: Callable[..., Any], daemon: Any, *args: Any, **kwargs: Any) -> Any:
    """``AROUND`` hook of ``WeightCacheDaemon.load``: a daemon of a conversion records which one it
    read (before the first read: a conversion replaced meanwhile never passes for this one)."""
    seal = conversion_seal(str(daemon.model_path)) if _is_conversion(daemon.model_path) else None
    result = original(daemon, *args, **kwargs)
    if seal is not None:
        setattr(daemon, LOADED_ATTR, seal)
    return result


def daemon_answer_around(original: Callable[..., Any], daemon: Any, conn: Any, *args: Any, **kwargs: Any) -> Any:
    """``AROUND`` hook of ``WeightCacheDaemon._handle_connection``: once the conversion at the
    daemon's path is another than it loaded, its config names that, so SGLang's own comparison
    answers the engine as a mismatch and its tensors are never mapped."""
    loaded = getattr(daemon, LOADED_ATTR, None)
    if loaded is None or _current_seal(daemon.model_path) == loaded:
        return original(daemon, conn, *args, **kwargs)
    config = daemon.config
    daemon.config = type(config).from_dict({**config.to_dict(), "model_path": f"{config.model_path} (converted "
                                            "again since this daemon loaded it: restart the daemon)"})
    try:
        return original(daemon, conn, *args, **kwargs)
    finally:
        daemon.config = config


def _is_conversion(path: Any) -> bool:
    """A local conversion (a hub repo id served by a daemon is not checked again: nothing is fetched here)."""
    return (Path(str(path)) / MANIFEST_NAME).is_file()


def _current_seal(path: Any) -> str | None:
    if not _is_conversion(path):
        return None
    try:
        return conversion_seal(str(path))
    except InstallError:
        return None
