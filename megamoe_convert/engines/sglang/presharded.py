"""SGLang's ``--load-format presharded`` over a conversion (SGLang 0.5.23).

``PreshardedModelLoader``'s first run loads as ``auto`` does (so the model classes' hooked
``load_weights`` installs the rank's pre-baked experts: :mod:`.model_classes`) and dumps every
rank's post-processed tensors under ``OUT/presharded/<signature>/``; a later run reads only its own
rank's files and never calls ``load_weights``. Its signature covers tensor names, shapes, dtypes
and the parallel set-up, not the byte layout nor which conversion was dumped. So :func:`register`
adds two hooks around SGLang's own methods (names in :mod:`.private_hooks`):

- the first run records the conversion it dumped (:data:`STAMP_NAME` beside SGLang's files: the
  manifest's checksum of itself);
- a reload of a conversion refuses a dump recorded for another conversion (OUT converted again
  since), or none, and runs the layout probe on the model SGLang builds before any dumped byte
  lands in it, exactly as an install does: a newer SGLang laying experts out differently is
  refused in one line, though the dump's signature is unchanged.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

from torch import nn

from megamoe_convert.engines import driver
from megamoe_convert.engines.load_formats import conversion_manifest
from megamoe_convert.engines.sglang import private_hooks
from megamoe_convert.engines.sglang.installing import ENGINE
from megamoe_convert.engines.sglang.model_classes import PATH_KEY
from megamoe_convert.errors import InstallError
from megamoe_convert.hub.resolve import open_converted
from megamoe_convert.output import marker
from megamoe_convert.output.seal import SEAL_KEY

log = logging.getLogger(__name__)

#: What megamoe-convert writes beside SGLang's dump: the conversion it was dumped from.
STAMP_NAME = "megamoe-conversion.json"


def conversion_path(model_config: Any) -> str | None:
    """The conversion SGLang's (hooked) ``get_config`` recorded on ``model_config``, or None."""
    section = getattr(getattr(model_config, "hf_config", None), marker.SECTION, None)
    if isinstance(section, dict) and section.get("converted_by") == marker.TOOL and section.get(PATH_KEY):
        return str(section[PATH_KEY])
    return None


def conversion_seal(path: str) -> str:
    """The conversion's identity: its manifest's checksum of itself."""
    data = conversion_manifest(path)
    if data is None or not isinstance(data.get(SEAL_KEY), str):
        raise InstallError(f"{path}: no readable manifest.json with its {SEAL_KEY}; rerun the megamoe convert "
                           "that made it")
    return str(data[SEAL_KEY])


def write_stamp(presharded_dir: str, path: str) -> None:
    """Record, beside SGLang's dump, the conversion it holds (every rank writes the same bytes)."""
    stamp = Path(presharded_dir) / STAMP_NAME
    partial = stamp.with_name(f".{STAMP_NAME}.{os.getpid()}.tmp")
    partial.write_text(json.dumps({"conversion": path, SEAL_KEY: conversion_seal(path)}) + "\n")
    os.replace(partial, stamp)


def check_stamp(presharded_dir: str, path: str) -> None:
    """Refuse a dump that records no conversion, or another one than ``path`` holds now."""
    stamp = Path(presharded_dir) / STAMP_NAME
    try:
        recorded = json.loads(stamp.read_text()).get(SEAL_KEY)
    except (OSError, ValueError, AttributeError):
        recorded = None
    if recorded is None:
        raise InstallError(f"{presharded_dir}: SGLang's presharded dump records no conversion ({STAMP_NAME} missing "
                           "or unreadable); remove that folder so the next start dumps it again")
    if recorded != conversion_seal(path):
        raise InstallError(f"{presharded_dir}: SGLang's presharded dump was made from another conversion than "
                           f"{path} holds now (converted again since?); remove that folder so the next start "
                           "dumps it again")


def probe_model(model: nn.Module, path: str) -> None:
    """The layout probe on every MegaMoE module of a freshly built ``model`` (nothing loaded yet)."""
    converted = open_converted(path, ())
    layers = {layer.key: layer for layer in converted.manifest.layers}
    planned = []
    for module, contract in ENGINE.classify(model):
        key = ENGINE.layer_key(module, converted)
        if key not in layers:
            raise InstallError(f"{ENGINE.prefix(module)}: layer {key} is not in {converted.path}")
        planned.append((module, contract, layers[key]))
    driver.probe_layouts(planned, converted)


def first_time_around(original: Callable[..., Any], loader: Any, model_config: Any, device_config: Any,
                      presharded_dir: str, *args: Any, **kwargs: Any) -> Any:
    """``AROUND`` hook of the first run's load and dump: a conversion's dump records it."""
    model = original(loader, model_config, device_config, presharded_dir, *args, **kwargs)
    path = conversion_path(model_config)
    if path is not None:
        write_stamp(presharded_dir, path)
    return model


def reload_around(original: Callable[..., Any], loader: Any, model_config: Any, device_config: Any,
                  presharded_dir: str, *args: Any, **kwargs: Any) -> Any:
    """``AROUND`` hook of the reload: a conversion's dump is its own, and the engine's layout is probed
    on the model SGLang builds, before its post-processing and before any dumped byte lands."""
    path = conversion_path(model_config)
    if path is None:
        return original(loader, model_config, device_config, presharded_dir, *args, **kwargs)
    check_stamp(presharded_dir, path)
    with private_hooks.after_model_built(lambda model: probe_model(model, path)):
        model = original(loader, model_config, device_config, presharded_dir, *args, **kwargs)
    log.info("megamoe: %s reloaded from SGLang's presharded dump %s (layout probed)", path, presharded_dir)
    return model
