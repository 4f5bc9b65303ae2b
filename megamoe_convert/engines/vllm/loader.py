"""``--load-format megamoe`` for vLLM (0.30 and later: the model-loader API is the same).

A ``DefaultModelLoader`` subclass: the rank's experts go in first, straight from its own
shards (:func:`install`), then everything else loads through vLLM's own safetensors path from
the converted directory, minus the routed-expert tensors (there are none in it, and the
rank folders of a hub repo are never fetched).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterator

import torch
from torch import nn

from megamoe_convert.engines.load_formats import (
    INSTALLED_ATTR,
    LOAD_FORMAT,
    RANK_FILES_PATTERN,
    as_safetensors_config,
    without_expert_tensors,
)

if TYPE_CHECKING:
    from megamoe_convert.engines.driver import Installed

__all__ = ["LOAD_FORMAT", "RANK_FILES_PATTERN", "make_loader_class", "register"]

log = logging.getLogger(__name__)


def make_loader_class(default_loader: Any) -> type:
    """A ``DefaultModelLoader`` subclass: experts from the shards, everything else as usual."""
    class MegaMoEModelLoader(default_loader):
        """``--load-format megamoe``: ``vllm serve OUT`` where OUT is a ``megamoe convert`` output."""

        #: What ``install`` put in place: its shared experts are not loaded again.
        installed: Installed | None = None

        def __init__(self, load_config: Any) -> None:
            super().__init__(as_safetensors_config(load_config))
            from megamoe_convert.serve.staging import prepare_gpu_staging  # at first use: the plugin stays light

            prepare_gpu_staging()  # pin the read ring while the engine builds the model

        def get_all_weights(self, model_config: Any, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
            return without_expert_tensors(super().get_all_weights(model_config, model), self.installed)

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            # before the model's own load_weights (0.32 finalizes there)
            from megamoe_convert.engines.vllm.installing import install_layers

            self.installed = install_layers(model, model_config.model, serving=True)
            setattr(model, INSTALLED_ATTR, self.installed)  # the model's own load_weights must not install again
            super().load_weights(model, model_config)

        def track_weights_loading(self, model: nn.Module, loaded_weights: set[str] | None, *args: Any,
                                  **kwargs: Any) -> None:
            """vLLM's check that every parameter was loaded (by default where the model is unquantized):
            the experts ``install`` put in place count as loaded, as the model's ``load_weights`` never
            sees them."""
            if loaded_weights is not None and self.installed is not None and self.installed.layers:
                loaded_weights = set(loaded_weights) | installed_parameters(model)
            super().track_weights_loading(model, loaded_weights, *args, **kwargs)

    return MegaMoEModelLoader


def installed_parameters(model: nn.Module) -> set[str]:
    """The names of the MegaMoE experts modules' parameters (every one of them is installed, or the
    install refuses), as ``model.named_parameters`` gives them."""
    from megamoe_convert.engines.vllm.experts import looks_like_megamoe_experts

    return {f"{name}.{param}" if name else param for name, module in model.named_modules()
            if looks_like_megamoe_experts(module) for param, _ in module.named_parameters()}


def register() -> None:
    """Register ``--load-format megamoe`` with vLLM's ``register_model_loader``."""
    from vllm.model_executor.model_loader import DefaultModelLoader, register_model_loader

    register_model_loader(LOAD_FORMAT)(make_loader_class(DefaultModelLoader))
