"""Every vLLM load format on a converted directory: the pre-baked experts, byte-exact with vLLM's own
loading of the source, or a refusal before serving; never the construction zeros.

- with megamoe-convert installed (its ``vllm.general_plugins`` entry point, loaded by vLLM's own
  ``load_general_plugins``): vLLM's real ``ModelConfig`` / config parser / model registry, and
  vLLM's own model loaders for ``auto`` (what ``vllm serve OUT`` uses), ``safetensors`` and
  ``megamoe``, each calling the model's ``load_weights``;
- without it (``bare_env``): vLLM's real ``ModelConfig`` refuses the marker architecture.
"""

from __future__ import annotations

import json
import re
import shutil
import types
from contextlib import contextmanager
from unittest import mock

import bare_env
import pytest
import torch
import vllm_harness as h
from model_classes_common import hub_repos, without_marker

from megamoe_convert.engines.vllm import model_classes
from megamoe_convert.errors import InstallError
from megamoe_convert.output import marker

if h.KERNEL_LAYOUT:  # Kimi-K3 and DeepSeek-V4.1 are proven from vLLM 0.33 on
    import models_harness as mh
    from test_vllm_models import kimi, v41  # noqa: F401  (module fixtures: converted checkpoints)

EP_SIZE, REDUNDANT = 4, 4


def plugins() -> None:
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # finds megamoe-convert's vllm.general_plugins entry point


def parsed(out):
    """vLLM's own ``get_config`` (``config_format="auto"``: the ``hf`` parser) on ``out``."""
    from vllm.transformers_utils.config import get_config

    plugins()
    return get_config(str(out), trust_remote_code=False)


def model_config(out) -> types.SimpleNamespace:
    """What vLLM's loaders read of its ``ModelConfig`` (``DefaultModelLoader``'s fields, and the weights
    override the Run:ai streamer's reads), with the config vLLM parsed (a full ``ModelConfig`` is built
    once, in the test below)."""
    return types.SimpleNamespace(model=str(out), revision=None, quantization="fp8", is_moe=True,
                                 multimodal_config=None, hf_config=parsed(out), model_weights="")


@contextmanager
def parent_load_weights(cls, seen: list[str]):
    """vLLM's ``load_weights`` of ``cls`` records what it is fed (the tree holds only the MoE
    layers, so non-expert tensors have nowhere to go) and runs vLLM's own code on the routed
    experts among them; 0.30-0.32 then finalize as their loading ends."""
    real = cls.load_weights

    def load_weights(self, weights):
        weights = list(weights)
        seen.extend(name for name, _ in weights)
        experts = [(n, t) for n, t in weights if ".experts." in n and ".shared_experts." not in n]
        if experts:  # (the MTP draft's own load_weights wants its whole layer once it is fed anything)
            real(self, experts)
        if not h.KERNEL_LAYOUT:
            for moe in (m for m in self.modules() if isinstance(m, h.model_py.DeepseekV4MoE)):
                if getattr(moe.experts, "_transformed_l1_weights", None) is None:
                    moe.finalize_mega_moe_weights()
        return set()

    with mock.patch.object(cls, "load_weights", load_weights):
        yield


def megamoe_model(model, conversion, draft=False):
    """``model`` (a tree of vLLM's class) as the plugin's registered subclass of that class, holding
    what its ``__init__`` reads off vLLM's config."""
    model.__class__ = model_classes.make_model_class(type(model), draft=draft)
    setattr(model, model_classes.CONVERSION_ATTR, conversion)
    return model


def main_model(ckpt, rank, config):
    """The main model of ``ckpt``'s shape for ``rank`` (EP_SIZE, REDUNDANT), as the class vLLM's
    registry hands out for ``config``: the plugin's subclass on a conversion."""
    return megamoe_model(h.build_main_model(h.hf_config(ckpt), rank, EP_SIZE, REDUNDANT),
                         model_classes.conversion_of(config))


def load(load_format, model, config) -> None:
    """vLLM's own loader for ``--load-format load_format``, as ``BaseModelLoader.load_model`` runs it."""
    from vllm.config import LoadConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    plugins()
    loader = get_model_loader(LoadConfig(load_format=load_format))
    with set_current_vllm_config(VllmConfig()):
        loader.load_weights(model, config)


def reference(ckpt, rank):
    config = h.hf_config(ckpt)
    main, mtp = (h.build_main_model(config, rank, EP_SIZE, REDUNDANT),
                 h.build_mtp_model(config, rank, EP_SIZE, REDUNDANT))
    h.vllm_load(main, mtp, ckpt)
    return {**h.experts_of(main), **h.experts_of(mtp)}


def assert_experts(model, want) -> None:
    got = h.experts_of(model)
    assert got and set(got) <= set(want)
    for prefix, module in got.items():
        h.assert_same_tensors(h.kernel_view(module), h.kernel_view(want[prefix]), prefix)


def test_vllm_reads_the_original_architecture_and_builds_megamoes_subclass(engine_converted, engine_ckpt):
    """``vllm serve OUT``: vLLM's real ``ModelConfig`` on the converted directory sees the source's
    architecture (so every architecture-keyed setting applies), and its registry hands out the
    plugin's subclass of vLLM's own class, which knows the conversion."""
    from vllm.config import ModelConfig
    from vllm.model_executor.models import ModelRegistry

    plugins()
    config = ModelConfig(model=str(engine_converted))
    assert config.architectures == ["DeepseekV4ForCausalLM"]
    assert config.hf_config.megamoe["architectures"] == ["DeepseekV4ForCausalLM"]
    cls, arch = ModelRegistry.resolve_model_cls(config.architectures, config)
    assert arch == "DeepseekV4ForCausalLM" and cls.__module__ == model_classes.__name__
    vllms_own = __import__("vllm.models.deepseek_v4", fromlist=["x"]).DeepseekV4ForCausalLM
    assert cls.__mro__[1] is vllms_own
    assert model_classes.conversion_of(config) == str(engine_converted)
    assert model_classes.conversion_of(types.SimpleNamespace(model=str(engine_ckpt), hf_config=parsed(engine_ckpt))) \
        is None


def without_section(config) -> dict:
    return {k: v for k, v in config.to_dict().items() if k not in (marker.SECTION, "_name_or_path")}


def test_every_reader_of_the_config_reads_the_source_s_model_type(engine_converted, engine_ckpt):
    """OUT's ``config.json`` names a marker model type; with the plugin loaded, transformers' own
    reading (what vLLM's ``hf`` parser, its speculative draft config, the weight-cache daemon and
    ``AutoTokenizer`` go through) gives back the source's, so vLLM's parsed config is the source's
    but for the ``megamoe`` section."""
    from transformers import AutoConfig
    from transformers.configuration_utils import PretrainedConfig

    assert json.loads((engine_converted / "config.json").read_bytes())["model_type"] == \
        marker.marker_model_type("deepseek_v4")
    plugins()
    assert PretrainedConfig.get_config_dict(str(engine_converted))[0]["model_type"] == "deepseek_v4"
    out, src = parsed(engine_converted), parsed(engine_ckpt)
    assert type(out) is type(src) and out.model_type == src.model_type == "deepseek_v4"
    assert without_section(out) == without_section(src)
    auto = [AutoConfig.from_pretrained(str(path)) for path in (engine_converted, engine_ckpt)]
    assert type(auto[0]) is type(auto[1]) and auto[0].model_type == auto[1].model_type


@pytest.mark.parametrize("load_format", ["auto", "safetensors", "megamoe"])
def test_every_load_format_serves_the_pre_baked_experts(engine_ckpt, engine_converted, load_format):
    config = model_config(engine_converted)
    assert model_classes.conversion_of(config) == str(engine_converted)
    seen: list[str] = []
    with h.patched(3, EP_SIZE):
        want = reference(engine_ckpt, 3)
        model = main_model(engine_ckpt, 3, config)
        with parent_load_weights(h.model_py.DeepseekV4ForCausalLM, seen):
            load(load_format, model, config)
        assert_experts(model, want)
    assert any(name.startswith("layers.0.attn.") for name in seen)  # the rest came from OUT's shards
    assert not any(".experts." in n and ".shared_experts." not in n for n in seen) and len(seen) == len(set(seen))


def test_the_mtp_draft_serves_its_experts_through_the_default_loader(engine_ckpt, engine_converted):
    """vLLM's speculative config builds the draft (``DeepSeekV4MTPModel``) from the same directory
    and loads it with the same load format."""
    config = model_config(engine_converted)
    with h.patched(1, EP_SIZE):
        want = reference(engine_ckpt, 1)
        mtp = megamoe_model(h.build_mtp_model(h.hf_config(engine_ckpt), 1, EP_SIZE, REDUNDANT),
                            model_classes.conversion_of(config), draft=True)
        with parent_load_weights(h.mtp_py.DeepSeekV4MTP, []):
            load("auto", mtp, config)
        assert len(h.experts_of(mtp)) == 1
        assert_experts(mtp, want)


def test_the_default_loader_refuses_a_model_of_another_ep_size_before_reading(engine_ckpt, engine_converted):
    config = model_config(engine_converted)
    seen: list[str] = []
    with h.patched(0, 2):
        model = megamoe_model(h.build_main_model(h.hf_config(engine_ckpt), 0, 2, 0), str(engine_converted))
        with parent_load_weights(h.model_py.DeepseekV4ForCausalLM, seen), \
                pytest.raises(InstallError, match="num_local_experts is 4 in the model but 3"):
            load("auto", model, config)
        assert not seen and all(torch.count_nonzero(p) == 0 for p in model.parameters())


def test_the_default_loader_refuses_an_experts_only_conversion(engine_ckpt, engine_experts_only):
    config = model_config(engine_experts_only)
    with h.patched(0, EP_SIZE):
        model = main_model(engine_ckpt, 0, config)
        with parent_load_weights(h.model_py.DeepseekV4ForCausalLM, []), \
                pytest.raises(InstallError, match="converted with --experts-only"):
            load("auto", model, config)


def test_a_hub_repo_is_served_by_repo_id(engine_ckpt, engine_converted, tmp_path, monkeypatch):
    """``vllm serve owner/conv``: vLLM's own config parsing reads the repo's ``config.json`` from the
    HF cache, whose marker says it is a conversion; vLLM's default loader then reads the cached
    weights and the subclass installs the experts from the repo's rank, pulled for it."""
    with hub_repos(tmp_path, monkeypatch, **{"owner/conv": engine_converted, "owner/src": engine_ckpt}) as hub:
        from vllm.transformers_utils.config import get_config

        plugins()
        hf_config = get_config("owner/conv", trust_remote_code=False)
        assert hf_config.architectures == ["DeepseekV4ForCausalLM"] and hasattr(hf_config, marker.SECTION)
        config = types.SimpleNamespace(model="owner/conv", revision=None, quantization="fp8", is_moe=True,
                                       multimodal_config=None, hf_config=hf_config)
        assert model_classes.conversion_of(config) == "owner/conv"
        source = types.SimpleNamespace(model="owner/src", revision=None, hf_config=get_config("owner/src", False))
        assert model_classes.conversion_of(source) is None
        with h.patched(2, EP_SIZE):
            want = reference(engine_ckpt, 2)
            model = main_model(engine_ckpt, 2, config)
            seen: list[str] = []
            with parent_load_weights(h.model_py.DeepseekV4ForCausalLM, seen):
                load("auto", model, config)
            assert_experts(model, want)
        assert any(name.startswith("layers.0.attn.") for name in seen) and "manifest.json" in hub.downloaded


def test_a_checkpoint_without_routed_experts_that_no_marker_names_is_refused(engine_ckpt, engine_converted,
                                                                              tmp_path):
    """A conversion whose ``config.json`` lost its marker: nothing says it is one, so vLLM's class
    loads it, and the subclass refuses once vLLM's default loader fed it a checkpoint without one
    routed-expert tensor: never the zeros."""
    lost = without_marker(engine_ckpt, engine_converted, tmp_path)
    config = model_config(lost)
    assert model_classes.conversion_of(config) is None
    with h.patched(0, EP_SIZE):
        model = megamoe_model(h.build_main_model(h.hf_config(engine_ckpt), 0, EP_SIZE, REDUNDANT), None)
        setattr(model, model_classes.MODEL_ATTR, str(lost))
        with parent_load_weights(h.model_py.DeepseekV4ForCausalLM, []), \
                pytest.raises(InstallError, match=re.escape(str(lost)) + r": vLLM read \d+ tensors and not one "
                                                  r"routed expert.*--load-format megamoe"):
            load("auto", model, config)


def test_a_model_that_is_no_conversion_loads_as_vllms_class(engine_ckpt):
    """On the source checkpoint the subclass is vLLM's class: its own loading, untouched."""
    config = model_config(engine_ckpt)
    assert json.loads((engine_ckpt / "config.json").read_text())["architectures"] == config.hf_config.architectures
    with h.patched(0, EP_SIZE):
        want = reference(engine_ckpt, 0)
        model = main_model(engine_ckpt, 0, config)
        with parent_load_weights(h.model_py.DeepseekV4ForCausalLM, []):
            load("auto", model, config)
        assert not hasattr(model, model_classes.INSTALLED_ATTR)
        assert_experts(model, want)  # vLLM's own loading of the source's experts


BARE_MODEL_CONFIG = """
from vllm.config import ModelConfig
for label, out in {dirs!r}:
    for impl in ("auto", "transformers"):
        try:
            ModelConfig(model=out, model_impl=impl)
        except Exception as e:
            print(f"WHOLE {{label}} {{impl}}:", " ".join(str(e).split()))
        else:
            print(f"ACCEPTED {{label}} {{impl}}")
"""


def bare_refusals(script: str, dirs: dict[str, object], tmp_path) -> dict[str, str]:
    """``script`` run in the engine's environment without megamoe-convert, on each of ``dirs``:
    ``{"LABEL IMPL": the whole refusal}``; a directory accepted fails the test."""
    proc = bare_env.run_bare(script.format(dirs=[(label, str(out)) for label, out in dirs.items()]), tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert not any(line.startswith("ACCEPTED") for line in lines), proc.stdout
    return {line.split(":", 1)[0].removeprefix("WHOLE "): line for line in lines if line.startswith("WHOLE")}


def architecture_marker_only(out, tmp_path):
    """A copy of ``out`` whose ``config.json`` has the source's model type back (the marker
    architectures stay): what the second line of defence faces."""
    copy = tmp_path / "architecture-marker-only"
    shutil.copytree(out, copy)
    config = json.loads((copy / "config.json").read_bytes())
    (copy / "config.json").write_text(json.dumps(marker.restore_model_type(config)))
    return copy


def test_vllm_without_megamoe_convert_refuses_the_converted_directory(engine_converted, tmp_path):
    """The serving image never installed megamoe-convert: vLLM's own ``ModelConfig`` refuses the
    converted directory when it reads its config, through transformers' ``AutoConfig``, which knows
    no marker model type (both implementations, before any model class is chosen), and the model
    type it prints says what to install. The marker architecture alone refuses it too."""
    whole = bare_refusals(BARE_MODEL_CONFIG, {"out": engine_converted,
                                              "arch": architecture_marker_only(engine_converted, tmp_path)}, tmp_path)
    assert set(whole) == {"out auto", "out transformers", "arch auto", "arch transformers"}
    model_type = marker.marker_model_type("deepseek_v4")
    for impl in ("auto", "transformers"):
        assert f"has model type `{model_type}`" in whole[f"out {impl}"], whole[f"out {impl}"]
        assert "does not recognize this architecture" in whole[f"out {impl}"]
        assert marker.marker_name("DeepseekV4ForCausalLM") in whole[f"arch {impl}"]
    assert "are not supported" in whole["arch auto"]


def test_the_transformers_backend_is_refused_for_a_conversion(engine_converted, engine_ckpt):
    """``--model-impl transformers``: vLLM's real ``ModelConfig`` picks its Transformers backend
    (Hugging Face's DeepSeek-V4 modeling: no MegaMoE experts) for the restored architecture; the
    plugin's registration of that class refuses the conversion before building anything."""
    from vllm.config import ModelConfig
    from vllm.model_executor.models import ModelRegistry

    plugins()
    config = ModelConfig(model=str(engine_converted), model_impl="transformers")
    cls, arch = ModelRegistry.resolve_model_cls(config.architectures, config)
    assert arch.startswith("Transformers") and cls.__module__ == model_classes.__name__
    with pytest.raises(InstallError, match="drop --model-impl transformers"):
        cls(vllm_config=types.SimpleNamespace(model_config=config))


def recording_parent(cls, seen: list[str]):
    """vLLM's ``load_weights`` of ``cls`` records what it is fed (the tree has nowhere to put it)."""
    return mock.patch.object(cls, "load_weights", lambda self, weights: seen.extend(n for n, _ in weights) or set())


@pytest.mark.only_kernel_layout
@pytest.mark.parametrize("family", ["kimi-k3", "deepseek-v4.1", "deepseek-v4.1-dspark"])
def test_kimi_k3_and_deepseek_v41_serve_their_experts_through_the_default_loader(family, request):
    """The plugin's subclasses of ``KimiK3ForConditionalGeneration``, ``DeepseekV41ForCausalLM`` and
    the DSpark draft, loaded by vLLM's default loader (``vllm serve OUT``), against vLLM's own loading."""
    ckpt, out = request.getfixturevalue("kimi" if family == "kimi-k3" else "v41")
    config = model_config(out)
    arch = {"kimi-k3": "KimiK3ForConditionalGeneration", "deepseek-v4.1": "DeepseekV41ForCausalLM",
            "deepseek-v4.1-dspark": "DSparkV41DraftModel"}[family]
    assert config.hf_config.architectures == [arch.replace("DSparkV41DraftModel", "DeepseekV41ForCausalLM")]
    seen: list[str] = []
    with mh.patched(1, EP_SIZE):
        if family == "kimi-k3":
            cfg = mh.kimi_config(ckpt)
            build = lambda: mh.build_kimi(cfg, 1, EP_SIZE)  # noqa: E731
        elif family == "deepseek-v4.1":
            cfg = mh.v41_config(ckpt)
            build = lambda: mh.build_v41(cfg, 1, EP_SIZE, 4)  # noqa: E731
        else:
            cfg = mh.v41_config(ckpt)
            build = lambda: mh.build_v41_dspark(cfg, 1, EP_SIZE, 4, True)  # noqa: E731
        reference = build()
        reference.load_weights(mh.weights(ckpt, shared=family != "kimi-k3"))
        model = build()
        vllms_class = type(model)
        megamoe_model(model, model_classes.conversion_of(config), draft=arch in model_classes.DRAFTS)
        with recording_parent(vllms_class, seen):
            load("auto", model, config)
        assert mh.experts_of(model)
        for prefix, module in mh.experts_of(model).items():
            want = mh.experts_of(reference)[prefix]
            h.assert_same_tensors(h.kernel_view(module), h.kernel_view(want), prefix)
    assert seen and not [n for n in seen if ".experts." in n and ".shared_experts." not in n]


def test_the_subclass_reads_its_own_model_config_target_or_draft(engine_converted, engine_ckpt):
    """What the subclass's ``__init__`` takes off vLLM's config: the target reads ``model_config``,
    a draft the speculative config's ``draft_model_config`` (vLLM hands drafts the target's
    ``VllmConfig``). vLLM's own ``__init__`` (GPU layers) is replaced by an empty one here."""
    converted, source = model_config(engine_converted), model_config(engine_ckpt)
    vllm_config = types.SimpleNamespace(model_config=source,
                                        speculative_config=types.SimpleNamespace(draft_model_config=converted))
    for base, draft, want in ((h.model_py.DeepseekV4ForCausalLM, False, None),
                              (h.mtp_py.DeepSeekV4MTP, True, str(engine_converted))):
        cls = model_classes.make_model_class(base, draft=draft)
        with mock.patch.object(base, "__init__", lambda self, **kwargs: torch.nn.Module.__init__(self)):
            model = cls(vllm_config=vllm_config, prefix="")
        assert getattr(model, model_classes.CONVERSION_ATTR) == want and type(model).__name__ == base.__name__
    arch_attr = "DeepSeekV4MTPModel" + model_classes._vllm_suffix()
    made = getattr(model_classes, arch_attr)  # what vLLM's registry imports
    assert made.__qualname__ == arch_attr and getattr(model_classes, arch_attr) is made
