"""``--load-format megamoe`` for SGLang (0.5.23): ``python -m sglang.launch_server --model-path OUT
--load-format megamoe --moe-a2a-backend megamoe ...`` where OUT is a ``megamoe convert --engine sglang`` output.

:func:`register` is the ``sglang.srt.plugins`` entry point (``load_plugins()`` runs it in every
SGLang process before server args are built). It adds the choice (``add_load_format_choices``)
and hooks ``LoadConfig._verify_load_format`` (SGLang's ``HookRegistry``), which would refuse a
name outside its ``LoadFormat`` enum: ``megamoe`` becomes the loader class itself, which
``get_model_loader`` instantiates. That class is SGLang's ``DefaultModelLoader`` on plain
safetensors: before the first weight is read the rank's experts are installed from its own
shards (so post-processing skips their transform), then everything else loads from the
converted directory, minus the routed-expert tensors; the rank folders are never fetched.
The other load formats: :mod:`.sglang_models`.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterator

import torch
from torch import nn

from megamoe_convert.engines.load_format import INSTALLED_ATTR, LOAD_FORMAT, as_safetensors_config, \
    without_expert_tensors
from megamoe_convert.engines.sglang_models import register_hooks
from megamoe_convert.serve.loader import prepare_gpu_staging

log = logging.getLogger(__name__)

#: The method SGLang calls to turn ``--load-format`` into its ``LoadFormat`` enum.
VERIFY_LOAD_FORMAT = "sglang.srt.configs.load_config.LoadConfig._verify_load_format"


@functools.cache
def loader_class() -> type:
    """SGLang's ``DefaultModelLoader``, installing the experts before the other weights load."""
    from sglang.srt.model_loader.loader import DefaultModelLoader

    from megamoe_convert.engines.sglang import install_layers

    class MegaMoEModelLoader(DefaultModelLoader):
        """``--load-format megamoe``: experts from the rank's shards, everything else as usual."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(as_safetensors_config(load_config))
            prepare_gpu_staging()  # pin the read ring while the engine builds the model

        def _get_all_weights(self, model_config: Any, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
            # runs at the first weight asked for: before any is loaded (unless the model's own
            # load_weights hook installed the conversion already: sglang_models.py)
            installed = getattr(model, INSTALLED_ATTR, None)
            if installed is None:
                installed = install_layers(model, model_config.model_path, serving=True)
                setattr(model, INSTALLED_ATTR, installed)
            yield from without_expert_tensors(super()._get_all_weights(model_config, model), installed)

    return MegaMoEModelLoader


def megamoe_as_loader_class(verify: Callable[[Any], None], load_config: Any) -> None:
    """``AROUND`` hook of ``LoadConfig._verify_load_format``: ``megamoe`` is the loader class."""
    if isinstance(load_config.load_format, str) and load_config.load_format.lower() == LOAD_FORMAT:
        load_config.load_format = loader_class()
        return
    verify(load_config)


def register() -> None:
    """``sglang.srt.plugins`` entry point: add ``--load-format megamoe`` (no-op without SGLang)."""
    try:
        from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES, add_load_format_choices
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    except ImportError:
        log.debug("megamoe: sglang not importable; --load-format megamoe not registered")
        return
    if LOAD_FORMAT not in LOAD_FORMAT_CHOICES:
        add_load_format_choices([LOAD_FORMAT])
    HookRegistry.register(VERIFY_LOAD_FORMAT, megamoe_as_loader_class, HookType.AROUND)
    register_hooks()  # every other load format serves a conversion's experts too, or refuses
