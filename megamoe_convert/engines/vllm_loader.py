"""``--load-format megamoe`` for vLLM (0.30 and later: the model-loader API is the same).

A ``DefaultModelLoader`` subclass: the rank's experts go in first, straight from its own
shards (:func:`install`), then everything else loads through vLLM's own safetensors path from
the converted directory, minus the routed-expert tensors (there are none in it, and the
rank folders of a hub repo are never fetched).
"""

from __future__ import annotations

import copy
import logging
import re
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from ..manifest import read_manifest
from . import InstallError

log = logging.getLogger(__name__)

LOAD_FORMAT = "megamoe"
#: What vLLM's own weight iterator must never fetch from a hub repo: the rank folders
#: (``install`` pulls just this rank's shards itself).
RANK_FILES_PATTERN = "rank-*-of-*/*"
#: Checkpoint tensor names of routed experts (what the megamoe load format never reads).
EXPERT_TENSOR_NAME = re.compile(r"\.experts\.(\d+\.)?w[123]")


def without_expert_tensors(weights: Iterable[tuple[str, torch.Tensor]], installed_shared: tuple[str, ...] = (),
                           ) -> Iterator[tuple[str, torch.Tensor]]:
    """The default safetensors iterator, minus routed-expert tensors and the shared experts of
    ``installed_shared`` layers (``layers.7``), both installed from the rank files."""
    shared = tuple(f"{key}.ffn.shared_experts." for key in installed_shared)
    return ((name, t) for name, t in weights
            if not EXPERT_TENSOR_NAME.search(name) and not (shared and name.startswith(shared)))


def installed_shared_layers(model: nn.Module, out: str) -> tuple[str, ...]:
    """Checkpoint keys of the layers whose pre-baked shared expert ``install`` put in place."""
    from ..vllm_integration import CONTRACTS
    from .vllm import takes_shared
    from .vllm_common import classify, layer_key
    from ..loader import open_converted

    converted = open_converted(out, [])
    return tuple(layer_key(m.prefix, converted.num_hidden_layers) for m, _ in classify(model, CONTRACTS)
                 if takes_shared(m, converted))


def as_safetensors_config(load_config: Any) -> Any:
    """A copy of vLLM's ``LoadConfig`` for the default loader underneath: ``DefaultModelLoader``
    knows only its own formats (``megamoe`` would be "Unknown load_format"), so the non-expert
    shards are read as plain safetensors, and the rank folders are never downloaded."""
    if load_config is None:
        return None
    config = copy.copy(load_config)
    config.load_format = "safetensors"
    ignore = config.ignore_patterns
    config.ignore_patterns = [*([ignore] if isinstance(ignore, str) else (ignore or [])), RANK_FILES_PATTERN]
    return config


def refuse_experts_only(out: str) -> None:
    """An ``--experts-only`` conversion has no non-expert weights for vLLM to load: say so,
    rather than vLLM's "Cannot find any model weights"."""
    path = Path(out)
    if path.is_dir() and read_manifest(path).experts_only:
        raise InstallError(f"{path}: converted with --experts-only, so it holds no non-expert weights to serve; "
                           "convert without --experts-only for --load-format megamoe")


def make_loader_class(default_loader: type) -> type:
    """A ``DefaultModelLoader`` subclass: experts from the shards, everything else as usual."""
    from ..vllm_integration import install

    class MegaMoEModelLoader(default_loader):  # type: ignore[misc, valid-type]
        """``--load-format megamoe``: ``vllm serve OUT`` where OUT is a ``megamoe convert`` output."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(as_safetensors_config(load_config))

        installed_shared: tuple[str, ...] = ()

        def get_all_weights(self, model_config: Any, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
            return without_expert_tensors(super().get_all_weights(model_config, model), self.installed_shared)

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            refuse_experts_only(model_config.model)
            install(model, model_config.model)  # before the model's own load_weights (0.32 finalizes there)
            self.installed_shared = installed_shared_layers(model, model_config.model)
            super().load_weights(model, model_config)

    return MegaMoEModelLoader


def register() -> None:
    """``vllm.general_plugins`` entry point: register ``--load-format megamoe`` (no-op without vLLM)."""
    try:
        from vllm.model_executor.model_loader import DefaultModelLoader, register_model_loader
    except ImportError:
        log.debug("megamoe: vllm not importable; --load-format megamoe not registered")
        return
    register_model_loader(LOAD_FORMAT)(make_loader_class(DefaultModelLoader))
