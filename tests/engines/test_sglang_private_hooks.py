"""The SGLang names megamoe-convert uses outside SGLang's public plugin API
(``engines/sglang/private_hooks.py``) and the transformers names both engines use
(``engines/private_hooks.py``), against SGLang's real code: every one resolves, the load
format reaches ``get_model_loader`` through the hooked ``_verify_load_format``, and the loader
class feeds the model what it is given instead of SGLang's own iterator."""

from __future__ import annotations

import types

import pytest
import torch
from private_names import resolve, transformers_reads_through_the_replaced_reader

from megamoe_convert.engines import private_hooks as transformers_hooks
from megamoe_convert.engines.sglang import loader, private_hooks


@pytest.mark.parametrize("dotted", private_hooks.PRIVATE_NAMES)
def test_every_private_name_resolves_in_this_release(dotted):
    resolve(dotted)


@pytest.mark.parametrize("dotted", transformers_hooks.PRIVATE_NAMES)
def test_every_transformers_private_name_resolves_in_this_release(dotted):
    resolve(dotted)


def test_transformers_reads_every_config_json_through_the_replaced_reader(tmp_path):
    transformers_reads_through_the_replaced_reader(tmp_path)


def test_the_hooked_verify_turns_megamoe_into_the_loader_class_and_leaves_the_rest():
    from sglang.srt.configs.load_config import LoadConfig, LoadFormat
    from sglang.srt.plugins import load_plugins

    load_plugins()  # megamoe-convert's entry point registers the hook; load_plugins applies it
    assert LoadConfig(load_format="megamoe").load_format is loader.loader_class()
    assert LoadConfig(load_format="safetensors").load_format == LoadFormat.SAFETENSORS


def test_the_loader_class_feeds_the_model_what_it_is_given():
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader

    seen = []

    def weights(model_config, model, own):
        seen.append((model_config, model, own.func is DefaultModelLoader._get_all_weights))
        yield "given", torch.zeros(1)

    cls = private_hooks.default_loader_class("Probe", lambda config: config, weights)
    probe = cls(LoadConfig(load_format="safetensors"))
    model_config, model = types.SimpleNamespace(), torch.nn.Module()
    assert isinstance(probe, DefaultModelLoader) and type(probe).__name__ == "Probe"
    assert [name for name, _ in probe._get_all_weights(model_config, model)] == ["given"]
    assert seen == [(model_config, model, True)]
