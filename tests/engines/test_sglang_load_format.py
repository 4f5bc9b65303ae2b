"""``--load-format megamoe`` through SGLang's own plugin loading, ``LoadConfig`` and ``get_model_loader``."""

from __future__ import annotations

import types

import pytest
import sglang_harness as h
import torch

from megamoe_convert.errors import InstallError

EP_SIZE, REDUNDANT = 4, 4


def megamoe_loader():
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import get_model_loader
    from sglang.srt.plugins import load_plugins

    load_plugins()  # finds megamoe-convert's sglang.srt.plugins entry point
    return get_model_loader(LoadConfig(load_format="megamoe"))


def model_config(out, ckpt) -> types.SimpleNamespace:
    """The fields of SGLang's ``ModelConfig`` that ``DefaultModelLoader`` reads (a real one resolves
    the model's whole architecture, attention included)."""
    return types.SimpleNamespace(model_path=str(out), revision=None, hf_config=h.hf_config(ckpt))


def recording(model):
    """The model's own ``load_weights`` is fed what SGLang's default iterator reads; record it
    (the tree holds only the MoE layers, so non-expert tensors have no parameter to go to)."""
    seen: list[str] = []
    model.load_weights = lambda weights: seen.extend(name for name, _ in weights)
    return seen


def load(loader, model, out, ckpt) -> None:
    """What ``DefaultModelLoader.load_model`` does once the model is built."""
    loader.load_weights_and_postprocess(model, loader._get_all_weights(model_config(out, ckpt), model),
                                        torch.device("cpu"))


def test_the_plugin_adds_the_choice_and_the_loader():
    from sglang.srt.arg_groups.choices import LOAD_FORMAT_CHOICES

    loader = megamoe_loader()
    assert "megamoe" in LOAD_FORMAT_CHOICES
    assert type(loader).__name__ == "MegaMoEModelLoader" and loader.load_config.load_format == "safetensors"
    assert "rank-*-of-*/*" in loader.load_config.ignore_patterns


@pytest.mark.parametrize("rank", [0, 3])
def test_load_format_installs_every_layer_and_feeds_sglang_the_rest(sglang_ckpt, sglang_converted, rank):
    config = h.hf_config(sglang_ckpt)
    loader = megamoe_loader()
    with h.patched(rank, EP_SIZE, REDUNDANT):
        reference = h.build_main_model(config, rank, REDUNDANT)
        h.sglang_load(reference, sglang_ckpt)
        model = h.build_main_model(config, rank, REDUNDANT)
        seen = recording(model)
        load(loader, model, sglang_converted, sglang_ckpt)  # SGLang's post-processing runs here too
        for prefix, module in h.experts_of(model).items():
            want = h.experts_of(reference)[prefix]
            for name, tensor in h.state(module).items():
                h.assert_same_tensor(tensor, h.state(want)[name], f"{prefix}.{name}")
    assert seen and not any(".experts." in name and ".shared_experts." not in name for name in seen)
    assert any(name.startswith("layers.0.attn.") for name in seen) and len(seen) == len(set(seen))


def test_load_format_installs_the_draft_models_mtp_layer(sglang_ckpt, sglang_converted):
    config = h.hf_config(sglang_ckpt)
    with h.patched(1, EP_SIZE, REDUNDANT):
        reference = h.build_nextn_model(config)
        h.sglang_load(reference, sglang_ckpt)
        draft = h.build_nextn_model(config)
        recording(draft)
        load(megamoe_loader(), draft, sglang_converted, sglang_ckpt)
        got, want = (h.experts_of(m)["model.decoder.mlp.experts"] for m in (draft, reference))
        for name, tensor in h.state(got).items():
            h.assert_same_tensor(tensor, h.state(want)[name], name)


def test_load_format_refuses_a_model_of_another_ep_size_before_reading_a_weight(sglang_ckpt, sglang_converted):
    config = h.hf_config(sglang_ckpt)
    with h.patched(0, 2, 0):
        model = h.build_main_model(config, 0, 0)
        seen = recording(model)
        with pytest.raises(InstallError, match="moe_ep_size is 2 in the model but 4"):
            load(megamoe_loader(), model, sglang_converted, sglang_ckpt)
        assert not seen


def test_load_format_refuses_an_experts_only_conversion(sglang_ckpt, tmp_path):
    from megamoe_convert.convert.plan import ConvertOptions
    from megamoe_convert.convert.run import convert

    out = tmp_path / "experts-only"
    convert(sglang_ckpt, out, ConvertOptions(ep_size=4, num_redundant_experts=4, engine="sglang", experts_only=True))
    with h.patched(0, EP_SIZE, REDUNDANT):
        model = h.build_main_model(h.hf_config(sglang_ckpt), 0, REDUNDANT)
        with pytest.raises(InstallError, match="converted with --experts-only"):
            load(megamoe_loader(), model, out, sglang_ckpt)
