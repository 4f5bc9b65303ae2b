"""``--load-format megamoe`` through vLLM's own plugin loading and model-loader registry."""

from __future__ import annotations

import json
import types

import pytest
import torch
import vllm_harness as h

from megamoe_convert.errors import InstallError


def model_config(out) -> types.SimpleNamespace:
    """The fields of vLLM's ``ModelConfig`` that ``DefaultModelLoader`` reads (a real one needs the
    model's HF config class, which vLLM builds on a GPU platform)."""
    return types.SimpleNamespace(model=str(out), revision=None, quantization="fp8", is_moe=True,
                                 multimodal_config=None)


def megamoe_loader():
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # finds megamoe-convert's vllm.general_plugins entry point
    return get_model_loader(LoadConfig(load_format="megamoe"))


def load(loader, model, out) -> None:
    """What ``BaseModelLoader.load_model`` does around ``load_weights``: a current vLLM config."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        loader.load_weights(model, model_config(out))


def recording(model):
    """The model's own ``load_weights`` is fed what vLLM's default iterator reads; record it
    (the tree holds only the MoE layers, so non-expert tensors have no parameter to go to)."""
    seen: list[str] = []

    def load_weights(weights):
        seen.extend(name for name, _ in weights)
        if not h.KERNEL_LAYOUT:  # what 0.30-0.32's load_weights / process_weights_after_loading end with
            for moe in (m for m in model.modules() if isinstance(m, h.model_py.DeepseekV4MoE)):
                moe.finalize_mega_moe_weights()
        return set()

    model.load_weights = load_weights
    return seen


@pytest.mark.parametrize("rank", [0, 3])
def test_load_format_installs_every_layer_and_feeds_vllm_the_rest(engine_ckpt, engine_converted, rank):
    config = h.hf_config(engine_ckpt)
    loader = megamoe_loader()
    assert type(loader).__name__ == "MegaMoEModelLoader" and loader.load_config.load_format == "safetensors"
    with h.patched(rank, 4):
        reference = h.build_main_model(config, rank, 4, 4)
        h.vllm_load(reference, h.build_mtp_model(config, rank, 4, 4), engine_ckpt)
        model = h.build_main_model(config, rank, 4, 4)
        seen = recording(model)
        load(loader, model, engine_converted)
        for prefix, module in h.experts_of(model).items():
            want = h.experts_of(reference)[prefix]
            h.assert_same_tensors(h.kernel_view(module), h.kernel_view(want), prefix)
    assert seen and not any(".experts." in name and ".shared_experts." not in name for name in seen)
    assert any(name.startswith("layers.0.attn.") for name in seen)
    assert len(seen) == len(set(seen))


def test_load_format_installs_the_mtp_draft_models_experts(engine_ckpt, engine_converted):
    """vLLM loads the MTP draft model with the same loader: its layers are numbered after the
    decoder layers (``model.layers.{N+i}.mtp_block``) and map to the checkpoint's ``mtp.{i}``."""
    config = h.hf_config(engine_ckpt)
    with h.patched(2, 4):
        reference = h.build_mtp_model(config, 2, 4, 4)
        h.vllm_load(h.build_main_model(config, 2, 4, 4), reference, engine_ckpt)
        mtp = h.build_mtp_model(config, 2, 4, 4)
        recording(mtp)
        load(megamoe_loader(), mtp, engine_converted)
        (prefix, module), = h.experts_of(mtp).items()
        assert prefix == f"model.layers.{config.num_hidden_layers}.mtp_block.ffn.experts"
        h.assert_same_tensors(h.kernel_view(module), h.kernel_view(h.experts_of(reference)[prefix]), prefix)


def test_load_format_refuses_a_model_of_another_ep_size(engine_ckpt, engine_converted):
    config = h.hf_config(engine_ckpt)
    loader = megamoe_loader()
    with h.patched(0, 2):
        model = h.build_main_model(config, 0, 2, 0)
        seen = recording(model)
        with pytest.raises(InstallError, match="num_local_experts is 4 in the model but 3"):
            load(loader, model, engine_converted)
        assert not seen and all(torch.count_nonzero(p) == 0 for p in model.parameters())


def test_load_format_refuses_an_experts_only_conversion(engine_ckpt, engine_experts_only):
    out = engine_experts_only
    with h.patched(0, 4):
        model = h.build_main_model(h.hf_config(engine_ckpt), 0, 4, 4)
        with pytest.raises(InstallError, match="converted with --experts-only"):
            load(megamoe_loader(), model, out)


@pytest.mark.only_kernel_layout  # 0.30-0.32's finalize_weights leaves the experts no parameters to count
def test_load_format_counts_the_installed_experts_as_loaded(engine_ckpt, engine_converted):
    """vLLM checks, by default for an unquantized model, that every parameter was loaded from the
    checkpoint: the experts ``install`` put in place count, as vLLM's own loader would not know them."""
    from vllm.model_executor.model_loader import DefaultModelLoader

    loader = megamoe_loader()
    with h.patched(0, 4):
        model = h.build_main_model(h.hf_config(engine_ckpt), 0, 4, 4)
        recording(model)
        load(loader, model, engine_converted)
    experts = {id(m) for m in h.experts_of(model).values()}
    installed = {f"{name}.{param}" for name, module in model.named_modules() if id(module) in experts
                 for param, _ in module.named_parameters()}
    rest = {name for name, _ in model.named_parameters()} - installed
    assert installed
    loader.track_weights_loading(model, set(rest))  # every parameter accounted for
    with pytest.raises(ValueError, match="not initialized from checkpoint"):
        DefaultModelLoader.track_weights_loading(loader, model, set(rest))  # vLLM's own check, unaided



def fed(model) -> dict[str, tuple[torch.dtype, tuple[int, ...], bytes]]:
    """What the model's own ``load_weights`` is fed, by name: dtype, shape and bytes."""
    got: dict[str, tuple[torch.dtype, tuple[int, ...], bytes]] = {}

    def load_weights(weights):
        for name, t in weights:
            assert name not in got, name
            got[name] = (t.dtype, tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return set()

    model.load_weights = load_weights
    return got


def test_load_format_feeds_the_rest_through_the_staging_ring_as_vllms_own_iterator(engine_ckpt, engine_converted,
                                                                                  monkeypatch):
    """The conversion's non-expert shards, read in chunks through the staging ring, feed the model
    every tensor vLLM's own safetensors iterator feeds it (``MEGAMOE_STAGED_REST=0``), byte for byte."""
    from megamoe_convert.serve import tensor_stream

    streamed = []
    real = tensor_stream.stream_tensors
    monkeypatch.setattr(tensor_stream, "stream_tensors", lambda files, *a, **k: streamed.append(files) or real(
        files, *a, **k))
    config = h.hf_config(engine_ckpt)
    fed_by = {}
    for staged in ("1", "0"):
        monkeypatch.setenv("MEGAMOE_STAGED_REST", staged)
        with h.patched(1, 4):
            model = h.build_main_model(config, 1, 4, 4)
            fed_by[staged] = fed(model)
            load(megamoe_loader(), model, engine_converted)
        assert len(streamed) == 1, staged  # the staged load streamed; vLLM's own path did not
    (files,) = streamed
    index = json.loads((engine_converted / "model.safetensors.index.json").read_text())
    assert sorted(map(str, files)) == sorted(str(engine_converted / f) for f in set(index["weight_map"].values()))
    assert fed_by["1"] and fed_by["1"] == fed_by["0"]
    assert any(name.startswith("layers.0.attn.") for name in fed_by["1"])


def test_load_format_leaves_a_hub_repos_rest_to_vllms_own_iterator(caplog):
    """Only a local folder's shards go through the staging ring: a repo id is vLLM's to fetch and read."""
    import logging

    from vllm.model_executor.model_loader import DefaultModelLoader

    from megamoe_convert.engines.vllm.loader import staged_files

    loader = megamoe_loader()
    with caplog.at_level(logging.DEBUG, logger="megamoe_convert.engines.vllm.loader"):
        assert staged_files(loader, DefaultModelLoader.Source("owner/conversion", None)) is None
    assert "owner/conversion's non-expert weights load through vLLM's own iterator (not a local folder)" in caplog.text
