"""The vLLM names megamoe-convert uses outside vLLM's public extension API
(``engines/vllm/private_hooks.py``) and the transformers names both engines use
(``engines/private_hooks.py``), against each release's real code: every one resolves, and
each hook does what the loader, model classes and weight cache rely on."""

from __future__ import annotations

import types

import pytest
from private_names import resolve, transformers_reads_through_the_replaced_reader

from megamoe_convert.engines import private_hooks as transformers_hooks
from megamoe_convert.engines.vllm import private_hooks
from megamoe_convert.engines.vllm.model_classes import DRAFTS, TARGETS
from megamoe_convert.engines.vllm.weight_cache import with_conversion


@pytest.mark.parametrize("dotted", private_hooks.PRIVATE_NAMES)
def test_every_private_name_resolves_in_this_release(dotted):
    resolve(dotted)


@pytest.mark.parametrize("dotted", transformers_hooks.PRIVATE_NAMES)
def test_every_transformers_private_name_resolves_in_this_release(dotted):
    resolve(dotted)


def test_the_file_choices_the_staged_rest_defers_to_vllm_are_named_as_this_release_names_them():
    """Where vLLM chooses a source's files or tensors by more than its folder, the non-expert weights
    load through vLLM's own iterator (``loader.staged_files``); a renamed knob would stream what vLLM
    filters, so each is read under this release's name."""
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import DefaultModelLoader, default_loader

    assert hasattr(LoadConfig(), private_hooks.LOAD_STRATEGY)
    if hasattr(default_loader, "resolve_mm_encoder_only_lm_prefixes"):  # the encoder-only filter (0.31 on)
        assert hasattr(DefaultModelLoader(LoadConfig()), private_hooks.ENCODER_ONLY_PREFIXES)


def test_transformers_reads_every_config_json_through_the_replaced_reader(tmp_path):
    transformers_reads_through_the_replaced_reader(tmp_path)


def test_model_class_is_vllms_own_class_of_each_megamoe_architecture():
    """DeepSeek-V4's classes, which every release has and imports here (Kimi-K3's need its
    quantization package, which only 0.33's environment holds)."""
    from vllm.model_executor.models import registry

    archs = [arch for arch in ("DeepseekV4ForCausalLM", "DeepSeekV4MTPModel") if arch in registry._VLLM_MODELS]
    assert "DeepseekV4ForCausalLM" in archs and set(archs) <= set(TARGETS + DRAFTS)
    for arch in archs:
        cls = private_hooks.model_class(arch)  # vLLM's own class, never the subclass registered over it
        assert cls.__module__.startswith("vllm.") and cls.__name__ == registry._VLLM_MODELS[arch][1], arch


def test_transformers_backend_architectures_are_vllms_transformers_classes():
    archs = private_hooks.transformers_backend_architectures()
    assert archs and all(arch.startswith("Transformers") for arch in archs)


def test_deep_gemm_is_what_vllm_imports():
    from vllm.utils import deep_gemm

    assert private_hooks.deep_gemm() is deep_gemm._import_deep_gemm()


def test_the_extended_cache_key_tells_a_conversion_from_its_source(engine_ckpt, engine_converted, monkeypatch):
    protocol = private_hooks.weight_cache("protocol")
    assert protocol is not None
    plain = getattr(protocol.hash_checkpoint, "__wrapped__", protocol.hash_checkpoint)  # unextended by the plugin
    monkeypatch.setattr(protocol, "hash_checkpoint", plain)  # as it was after the test
    private_hooks.extend_checkpoint_hash(with_conversion)
    extended = protocol.hash_checkpoint
    assert extended is not plain and getattr(extended, "megamoe", False)
    assert extended(str(engine_ckpt)) == plain(str(engine_ckpt))
    assert extended(str(engine_converted)) != plain(str(engine_converted))


def test_the_ipc_loader_refuses_before_asking_a_daemon():
    mismatch = private_hooks.weight_cache("protocol").CacheConfigMismatchError
    cls = private_hooks.ipc_loader_class(lambda model: f"{model}: refused", lambda model: None)
    assert cls.__name__ == "MegaMoEIpcModelLoader" and issubclass(cls, resolve(
        f"{private_hooks.WEIGHT_CACHE}.ipc_loader:IpcModelLoader"))
    with pytest.raises(mismatch, match="OUT: refused"):
        cls._fetch_entries(object.__new__(cls), types.SimpleNamespace(model="OUT"))


def test_the_daemon_target_is_replaced_only_inside():
    own = private_hooks.daemon_target()
    assert own.__module__ == f"{private_hooks.WEIGHT_CACHE}.daemon"

    def entry() -> None:
        pass

    with private_hooks.replaced_daemon_target(entry) as kept:
        assert kept is own and private_hooks.daemon_target() is entry
    assert private_hooks.daemon_target() is own
