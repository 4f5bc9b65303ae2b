"""``--load-format megamoe`` for vLLM (0.30 and later: the model-loader API is the same).

A ``DefaultModelLoader`` subclass: the rank's experts go in first, straight from its own
shards (:func:`install`), then everything else loads through the model's own ``load_weights``
from the converted directory, minus the routed-expert tensors (there are none in it, and the
rank folders of a hub repo are never fetched). The non-expert shards vLLM would read (its own
choice of files) are read through the experts' staging ring in large chunks and handed to the
model on the device it is built on (:mod:`megamoe_convert.serve.tensor_stream`), as vLLM's
``fastsafetensors`` hands out device tensors: vLLM's weight loaders make of them what they make
of its own iterator's. A hub repo, a source whose files vLLM chooses by more than the folder
(:func:`staged_files`), or ``MEGAMOE_STAGED_REST=0`` reads them through vLLM's own iterator.
"""

from __future__ import annotations

import logging
import os
import time
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

        #: Where the model's weights live: where the non-expert tensors are handed to it.
        weights_device: torch.device | None = None

        def get_all_weights(self, model_config: Any, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
            self.weights_device = weights_device(model)
            return without_expert_tensors(super().get_all_weights(model_config, model), self.installed)

        def _get_weights_iterator(self, source: Any) -> Iterator[tuple[str, torch.Tensor]]:
            files = staged_files(self, source)
            if files is None:
                return super()._get_weights_iterator(source)
            from megamoe_convert.serve.tensor_stream import stream_tensors

            if getattr(self, "counter_before_loading_weights", 0.0) == 0.0:  # vLLM's "Loading weights took"
                self.counter_before_loading_weights = time.perf_counter()
            prefix = source.prefix
            return ((prefix + name, t) for name, t in stream_tensors(files, self.weights_device or "cpu"))

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


def weights_device(model: nn.Module) -> torch.device:
    """The device of the model's parameters (a CUDA one where any is there), the CPU otherwise."""
    devices = {p.device for p in model.parameters()}
    return next((d for d in devices if d.type == "cuda"), torch.device("cpu"))


def staged_files(loader: Any, source: Any) -> list[str] | None:
    """The safetensors files vLLM's own loader would read for ``source``, where they are to be read
    through the staging ring instead: a local folder's, unless switched off or vLLM chooses them
    by more than the folder (a subfolder, allow-patterns, an encoder-only filter, a torchao
    checkpoint); ``None`` (vLLM's own iterator reads them), said in a debug line. A source's
    unused-weight filter drops whole files here as vLLM's own iterator's caller does."""
    from megamoe_convert import settings
    from megamoe_convert.engines.vllm import private_hooks

    why = None
    if not settings.staged_rest():
        why = f"{settings.STAGED_REST}=0"
    elif not os.path.isdir(str(source.model_or_path)):
        why = "not a local folder"
    elif getattr(source, "subfolder", None) or getattr(source, "allow_patterns_overrides", None) \
            or getattr(loader, private_hooks.ENCODER_ONLY_PREFIXES, None) \
            or getattr(loader.load_config, private_hooks.LOAD_STRATEGY, None) == "torchao":
        why = "vLLM chooses its files or tensors by more than the folder"
    files = None if why else private_hooks.weight_files(loader, source)
    if why or files is None:
        log.debug("megamoe: %s's non-expert weights load through vLLM's own iterator (%s)", source.model_or_path,
                  why or "no safetensors")
        return None
    if (unused := getattr(source, "is_unused_weight", None)) is not None:  # as vLLM's whole-file readers drop shards
        from vllm.model_executor.model_loader.weight_utils import filter_safetensors_files_by_weight_name

        files = filter_safetensors_files_by_weight_name(files, unused)
    return sorted(files)


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
