"""Every SGLang load format on a converted directory: the pre-baked experts, exactly as SGLang's own
loading of the source leaves them, or a refusal before serving; never the construction zeros.

- with megamoe-convert installed (its ``sglang.srt.plugins`` entry point, loaded by SGLang's own
  ``load_plugins``, hooks applied as SGLang's ``HookRegistry`` applies them): SGLang's real ``get_config`` and
  ``get_model_architecture``, and SGLang's own loaders for ``auto`` (what ``launch_server
  --model-path OUT`` uses), ``safetensors`` and ``megamoe``, each calling the model's ``load_weights``;
- without it (``bare_env``): SGLang's real ``ModelConfig`` + ``get_model_architecture`` refuse the
  marker architecture.
"""

from __future__ import annotations

import json
import shutil
import types

import bare_env
import pytest
import sglang_harness as h
from model_classes_common import hub_repos, without_marker
from sglang_model_classes_harness import hooked_load_weights, load, parsed, tree_config

from megamoe_convert.engines.sglang import model_classes
from megamoe_convert.errors import InstallError
from megamoe_convert.output import marker

EP_SIZE, REDUNDANT = 4, 4


def reference(ckpt, rank):
    config = h.hf_config(ckpt)
    main, nextn = h.build_main_model(config, rank, REDUNDANT), h.build_nextn_model(config)
    h.sglang_load(main, ckpt)
    nextn.load_weights(h.checkpoint_weights(ckpt))
    h.post_process(nextn)
    return {**h.experts_of(main), **h.experts_of(nextn)}


def assert_experts(model, want) -> None:
    got = h.experts_of(model)
    assert got and set(got) <= set(want)
    for prefix, module in got.items():
        for name, tensor in h.state(module).items():
            h.assert_same_tensor(tensor, h.state(want[prefix])[name], f"{prefix}.{name}")


def test_sglang_reads_the_original_architecture_of_a_conversion(sglang_converted, sglang_ckpt):
    config = parsed(sglang_converted)
    assert config.architectures == ["DeepseekV4ForCausalLM"]
    assert getattr(config, marker.SECTION)[model_classes.PATH_KEY] == str(sglang_converted)
    assert not hasattr(parsed(sglang_ckpt), marker.SECTION)


def test_sglang_reads_the_source_s_model_type_and_config(sglang_converted, sglang_ckpt):
    """OUT's ``config.json`` names a marker model type; with the plugin loaded, transformers' own
    reading (SGLang's ``get_config``, its tokenizer's ``AutoConfig``) gives back the source's, so
    SGLang's config is the source's but for the ``megamoe`` section."""
    from transformers import AutoConfig

    assert json.loads((sglang_converted / "config.json").read_bytes())["model_type"] == \
        marker.marker_model_type("deepseek_v4")
    out, src = parsed(sglang_converted), parsed(sglang_ckpt)
    assert type(out) is type(src) and out.model_type == src.model_type == "deepseek_v4"
    strip = lambda c: {k: v for k, v in c.to_dict().items() if k not in (marker.SECTION, "_name_or_path")}  # noqa: E731
    assert strip(out) == strip(src)
    auto = [AutoConfig.from_pretrained(str(path)) for path in (sglang_converted, sglang_ckpt)]
    assert type(auto[0]) is type(auto[1]) and auto[0].model_type == auto[1].model_type


@pytest.mark.parametrize("load_format", ["auto", "safetensors", "megamoe"])
def test_every_load_format_serves_the_pre_baked_experts(sglang_ckpt, sglang_converted, load_format):
    seen: list[str] = []
    with h.patched(3, EP_SIZE, REDUNDANT):
        want = reference(sglang_ckpt, 3)
        config = tree_config(sglang_ckpt, sglang_converted)
        model = h.build_main_model(config, 3, REDUNDANT)
        with hooked_load_weights(h.DeepseekV4ForCausalLM, seen):
            load(load_format, model, sglang_converted, config)  # SGLang's post-processing runs here too
        assert_experts(model, want)
    assert any(name.startswith("layers.0.attn.") for name in seen)
    assert not any(".experts." in n and ".shared_experts." not in n for n in seen) and len(seen) == len(set(seen))


def test_the_nextn_draft_serves_its_experts_through_the_default_loader(sglang_ckpt, sglang_converted):
    with h.patched(1, EP_SIZE, REDUNDANT):
        want = reference(sglang_ckpt, 1)
        config = tree_config(sglang_ckpt, sglang_converted)
        draft = h.build_nextn_model(config)
        with hooked_load_weights(h.DeepseekV4ForCausalLMNextN, []):
            load("auto", draft, sglang_converted, config)
        assert list(h.experts_of(draft)) == ["model.decoder.mlp.experts"]
        assert_experts(draft, want)


def test_the_default_loader_refuses_a_model_of_another_ep_size_before_reading(sglang_ckpt, sglang_converted):
    seen: list[str] = []
    with h.patched(0, 2, 0):
        model = h.build_main_model(tree_config(sglang_ckpt, sglang_converted), 0, 0)
        with hooked_load_weights(h.DeepseekV4ForCausalLM, seen), \
                pytest.raises(InstallError, match="moe_ep_size is 2 in the model but 4"):
            load("auto", model, sglang_converted, model.config)
        assert not seen


def test_a_conversion_for_vllms_placement_is_refused_when_sglang_reads_its_config(engine_converted):
    """Every DeepSeek-V4.1 / Kimi-K3 conversion, and a DeepSeek-V4 one made without --engine sglang."""
    with pytest.raises(InstallError, match="converted for vllm's expert placement.*--engine sglang"):
        parsed(engine_converted)


def test_the_default_loader_refuses_an_experts_only_conversion(sglang_ckpt, tmp_path):
    from megamoe_convert.convert import ConvertOptions, convert

    out = tmp_path / "experts-only"
    convert(sglang_ckpt, out, ConvertOptions(ep_size=4, num_redundant_experts=4, engine="sglang", experts_only=True))
    with h.patched(0, EP_SIZE, REDUNDANT):
        model = h.build_main_model(tree_config(sglang_ckpt, out), 0, REDUNDANT)
        with hooked_load_weights(h.DeepseekV4ForCausalLM, []), \
                pytest.raises(InstallError, match="converted with --experts-only"):
            load("auto", model, out, model.config)


def test_a_hub_repo_is_served_by_repo_id(sglang_ckpt, sglang_converted, tmp_path, monkeypatch):
    """``launch_server --model-path owner/sg``: SGLang's own (hooked) ``get_config`` reads the cached
    ``config.json``, whose marker says it is a conversion, and the plugin fetches the repo's
    ``manifest.json`` to check the engine it was made for; SGLang's default loader reads the cached
    weights and the hooked ``load_weights`` installs the experts from the repo's rank."""
    with hub_repos(tmp_path, monkeypatch, **{"owner/sg": sglang_converted, "owner/sg-src": sglang_ckpt}) as hub:
        config = parsed("owner/sg")
        assert config.architectures == ["DeepseekV4ForCausalLM"]
        assert getattr(config, marker.SECTION)[model_classes.PATH_KEY] == "owner/sg"
        assert "manifest.json" in hub.downloaded
        assert not hasattr(parsed("owner/sg-src"), marker.SECTION)
        seen: list[str] = []
        with h.patched(2, EP_SIZE, REDUNDANT):
            want = reference(sglang_ckpt, 2)
            tree = tree_config(sglang_ckpt, sglang_converted)
            setattr(tree, marker.SECTION, getattr(config, marker.SECTION))
            model = h.build_main_model(tree, 2, REDUNDANT)
            with hooked_load_weights(h.DeepseekV4ForCausalLM, seen):
                load("auto", model, "owner/sg", tree)
            assert_experts(model, want)
        assert any(name.startswith("layers.0.attn.") for name in seen)


def test_a_checkpoint_without_routed_experts_that_no_marker_names_is_refused(sglang_ckpt, sglang_converted,
                                                                              tmp_path):
    """A conversion whose ``config.json`` lost its marker: nothing says it is one, and the hooked
    ``load_weights`` refuses once SGLang's default loader fed it a checkpoint without one
    routed-expert tensor: never the zeros."""
    lost = without_marker(sglang_ckpt, sglang_converted, tmp_path)
    assert not hasattr(parsed(lost), marker.SECTION)
    with h.patched(0, EP_SIZE, REDUNDANT):
        model = h.build_main_model(h.hf_config(sglang_ckpt), 0, REDUNDANT)
        with hooked_load_weights(h.DeepseekV4ForCausalLM, []), \
                pytest.raises(InstallError, match=r"SGLang read \d+ tensors and not one routed expert.*"
                                                  r"--load-format megamoe"):
            load("auto", model, lost, model.config)


def test_the_transformers_backend_is_refused_for_a_conversion(sglang_converted):
    """``--model-impl transformers``: SGLang's real ``get_model_architecture`` would build Hugging
    Face's DeepSeek-V4 modeling (its transformers backend); the plugin refuses it. (The fields of
    SGLang's ``ModelConfig`` it reads: a real one derives DeepSeek-V4's attention shapes, which the
    tiny checkpoint leaves out.)"""
    from sglang.srt.configs.model_config import ModelImpl
    from sglang.srt.model_loader import utils

    hf_config = parsed(sglang_converted)
    config = types.SimpleNamespace(model_path=str(sglang_converted), revision=None, hf_config=hf_config,
                                   hf_text_config=hf_config, quantization=None, is_generation=True,
                                   is_multimodal=False, model_impl=ModelImpl.TRANSFORMERS)
    with pytest.raises(InstallError, match="SGLang would build Transformers.*drop --model-impl transformers"):
        utils.get_model_architecture(config)
    config.model_impl = ModelImpl.AUTO  # SGLang's own class: served
    assert utils.get_model_architecture(config)[0] is h.DeepseekV4ForCausalLM


BARE_SGLANG = """
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader.utils import get_model_architecture
for label, out in {dirs!r}:
    for impl in ("auto", "transformers"):
        try:
            print(f"ACCEPTED {{label}} {{impl}}", get_model_architecture(ModelConfig(out, model_impl=impl)))
        except Exception as e:
            print(f"REFUSED {{label}} {{impl}}:", " ".join(str(e).split()))
"""


def test_sglang_without_megamoe_convert_refuses_the_converted_directory(sglang_converted, tmp_path):
    """The serving image never installed megamoe-convert: SGLang's own ``ModelConfig`` refuses the
    converted directory when it reads its config, through transformers' ``AutoConfig``, which knows
    no marker model type: with SGLang's own implementation and with ``--model-impl transformers``
    (which would otherwise build Hugging Face's modeling from ``model_type``, past any architecture
    check), and the model type it prints says what to install. The marker architecture alone
    refuses SGLang's own implementation too."""
    arch_only = tmp_path / "architecture-marker-only"
    shutil.copytree(sglang_converted, arch_only)
    config = json.loads((arch_only / "config.json").read_bytes())
    (arch_only / "config.json").write_text(json.dumps(marker.restore_model_type(config)))
    dirs = [("out", str(sglang_converted)), ("arch", str(arch_only))]
    proc = bare_env.run_bare(h.TORCHVISION_STAND_IN + BARE_SGLANG.format(dirs=dirs), tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = {line.split(":", 1)[0]: line for line in proc.stdout.splitlines() if line.startswith(("REFUSED", "ACC"))}
    model_type = marker.marker_model_type("deepseek_v4")
    for impl in ("auto", "transformers"):
        assert f"REFUSED out {impl}" in lines, proc.stdout
        assert f"has model type `{model_type}`" in lines[f"REFUSED out {impl}"]
        assert "does not recognize this architecture" in lines[f"REFUSED out {impl}"]
    assert "REFUSED arch auto" in lines, proc.stdout
    assert marker.marker_name("DeepseekV4ForCausalLM") in lines["REFUSED arch auto"]
    assert "is not a registered model" in lines["REFUSED arch auto"]
