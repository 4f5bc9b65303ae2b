"""``--load-format megamoe`` for SGLang (0.5.23): ``python -m sglang.launch_server --model-path OUT
--load-format megamoe --moe-a2a-backend megamoe ...`` where OUT is a ``megamoe convert --engine sglang`` output.

:func:`register` adds the choice (``add_load_format_choices``) and, through
:mod:`.private_hooks`, makes ``megamoe`` the loader class itself. That class is SGLang's
``DefaultModelLoader`` on plain safetensors: before the first weight is read the rank's experts
are installed from its own shards (so post-processing skips their transform), then everything
else loads from the converted directory, minus the routed-expert tensors; the rank folders are
never fetched. The other load formats: :mod:`.model_classes`.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterator

import torch
from torch import nn

from megamoe_convert.engines.load_formats import (
    LOAD_FORMAT,
    as_safetensors_config,
    install_once,
    without_expert_tensors,
)
from megamoe_convert.engines.sglang import private_hooks

log = logging.getLogger(__name__)


def loader_config(load_config: Any) -> Any:
    """The default loader's config underneath (plain safetensors, rank folders ignored)."""
    return as_safetensors_config(load_config)


def experts_first(model_config: Any, model: nn.Module,
                  own: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> Iterator[tuple[str, torch.Tensor]]:
    """At the first weight asked for, before any is loaded: the rank's experts (unless the model's
    own ``load_weights`` hook installed the conversion already: :mod:`.model_classes`); then SGLang's
    weights minus the experts."""
    from megamoe_convert.engines.sglang.installing import install_layers  # at first use

    installed = install_once(model, model_config.model_path, install_layers)
    yield from without_expert_tensors(own(), installed)


@functools.cache
def loader_class() -> type:
    """SGLang's ``DefaultModelLoader``, installing the experts before the other weights load."""
    return private_hooks.default_loader_class("MegaMoEModelLoader", loader_config, experts_first)


def register() -> tuple[str, Callable[..., None]]:
    """Add ``--load-format megamoe`` to SGLang's choices; the hook (target, ``AROUND`` hook) that loads
    it with :func:`loader_class`."""
    from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES, add_load_format_choices

    if LOAD_FORMAT not in LOAD_FORMAT_CHOICES:
        add_load_format_choices([LOAD_FORMAT])
    return private_hooks.route_load_format(LOAD_FORMAT, loader_class)
