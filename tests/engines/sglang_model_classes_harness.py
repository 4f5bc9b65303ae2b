"""SGLang's model-class hooks as their tests drive them (``test_sglang_model_classes.py``, ``test_sglang_sm90_fp8.py``):
megamoe-convert's plugin loaded by SGLang's own ``load_plugins``, SGLang's (hooked) ``get_config``,
a model class's hooked ``load_weights`` recording what it is fed, and SGLang's own loaders."""

from __future__ import annotations

import types
from contextlib import contextmanager
from typing import Iterator
from unittest import mock

import sglang_harness as h
import torch

from megamoe_convert.engines.sglang import hooks, model_classes
from megamoe_convert.output import marker


def plugins() -> None:
    from sglang.srt.plugins import load_plugins

    load_plugins()  # finds megamoe-convert's sglang.srt.plugins entry point; applies its hooks


def parsed(path):
    """SGLang's own (hooked) ``get_config`` on ``path``."""
    from sglang.srt.utils.hf_transformers import config as config_py

    plugins()
    return config_py.get_config(str(path), trust_remote_code=False)


def tree_config(ckpt, out):
    """The harness's config of the source, carrying what SGLang's ``get_config`` read off ``out``."""
    config = h.hf_config(ckpt)
    section = getattr(parsed(out), marker.SECTION, None)
    if section is not None:
        setattr(config, marker.SECTION, section)
    return config


@contextmanager
def hooked_load_weights(cls, seen: list[str]) -> Iterator[None]:
    """``cls.load_weights`` as the plugin leaves it (the hook around SGLang's function, wrapped as the
    plugin wraps it), with SGLang's function recording what it is fed: the tree holds only the MoE
    layers, so non-expert tensors have nowhere to go."""
    plugins()
    assert getattr(cls.__dict__["load_weights"], "__wrapped__", None) is not None  # hooked by load_plugins

    def load_weights(self, weights, *args, **kwargs):
        seen.extend(name for name, _ in weights)

    with mock.patch.object(cls, "load_weights", hooks.wrap_around(load_weights, model_classes.load_weights_around)):
        yield


def load(load_format, model, out, config) -> None:
    """SGLang's own loader for ``--load-format load_format``, as ``DefaultModelLoader.load_model`` runs it."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import get_model_loader

    plugins()
    loader = get_model_loader(LoadConfig(load_format=load_format))
    model_config = types.SimpleNamespace(model_path=str(out), revision=None, hf_config=config)
    loader.load_weights_and_postprocess(model, loader._get_all_weights(model_config, model), torch.device("cpu"))
