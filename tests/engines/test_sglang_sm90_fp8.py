"""SGLang 0.5.23's Hopper FP8 MegaMoE (DeepSeek-V3/R1, Qwen3-MoE): ``engines.sglang.install`` and
every load format, against SGLang's real model classes, their ``load_weights``, ``Fp8MoEMethod`` and its own
``build_sm90_mega_moe_experts_weights`` as the oracle (``sglang_fp8_harness``: the SM90 platform
check patched, nothing else)."""

from __future__ import annotations

import json
import types
from unittest import mock

import bare_env
import pytest
import sglang_fp8_harness as f
import sglang_harness as h
import torch
from sglang_model_classes_harness import hooked_load_weights, load, parsed, tree_config

from megamoe_convert.convert import ConvertOptions, convert
from megamoe_convert.engines.sglang import install
from megamoe_convert.engines.sglang.sm90_fp8 import CONTRACT
from megamoe_convert.errors import InstallError
from megamoe_convert.output import marker
from megamoe_convert.synth.write import synthesize

EP_SIZE, REDUNDANT = 4, 4
#: family -> (synth preset, SGLang's experts modules of a tiny conversion)
FAMILIES = {"deepseek_v3": ("deepseek-v3-tiny", ["model.decoder.mlp.experts", "model.layers.1.mlp.experts",
                                                 "model.layers.2.mlp.experts"]),
            "qwen3_moe": ("qwen3-moe-tiny", ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"])}


@pytest.fixture(scope="module")
def fp8(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Each family's tiny checkpoint, its conversion for SGLang (EP 4, 4 redundant experts) and its store."""
    out = {}
    for family, (preset, _) in FAMILIES.items():
        root = tmp_path_factory.mktemp(family)
        synthesize(root / "ckpt", preset, seed=4)
        convert(root / "ckpt", root / "ep4", ConvertOptions(ep_size=EP_SIZE, num_redundant_experts=REDUNDANT,
                                                            engine="sglang"))
        convert(root / "ckpt", root / "store", ConvertOptions(ep_size=None))
        out[family] = types.SimpleNamespace(ckpt=root / "ckpt", converted=root / "ep4", store=root / "store")
    return out


def models(family: str, config, rank: int) -> list:
    built = [f.build_main_model(family, config, rank, REDUNDANT)]
    if f.CLASSES[family][1] is not None:
        built.append(f.build_nextn_model(family, config, REDUNDANT))
    return built


def reference(family: str, ckpt, rank: int) -> dict:
    """What SGLang's own loading leaves in every MegaMoE module of rank ``rank``."""
    config = f.hf_config(ckpt)
    out = {}
    for model in models(family, config, rank):
        f.sglang_load(model, ckpt)
        out.update(f.experts_of(model))
    return out


def assert_as_sglang_builds(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for prefix, module in got.items():
        ref = want[prefix]
        assert module._mega_moe_weights_built and module._mega_moe_sm90_fp8_weights
        assert ref._mega_moe_weights_built and ref._mega_moe_sm90_fp8_weights
        for name, tensor in f.state(module).items():
            h.assert_same_tensor(tensor, f.state(ref)[name], f"{prefix}.{name}")
        for gemm, weight in ((1, "w13"), (2, "w2")):  # the tuples alias the parameters, as SGLang's build leaves them
            mega = getattr(module, f"mega_l{gemm}_weights")
            assert h.shares_storage(mega[0], getattr(module, f"{weight}_weight"))
            assert h.shares_storage(mega[1], getattr(module, f"{weight}_weight_scale_inv"))


@pytest.mark.parametrize("form", ["converted", "store"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rank", range(EP_SIZE))
def test_install_leaves_every_module_as_sglangs_own_sm90_build_does(fp8, family, rank, form):
    paths = fp8[family]
    config = f.hf_config(paths.ckpt)
    with f.patched(rank, EP_SIZE, REDUNDANT):
        want = reference(family, paths.ckpt, rank)
        built = models(family, config, rank)
        params = {p: dict(m.named_parameters()) for model in built for p, m in f.experts_of(model).items()}
        for model in built:
            install(model, getattr(paths, form), rank=rank)
        got = {p: m for model in built for p, m in f.experts_of(model).items()}
        assert sorted(got) == FAMILIES[family][1]
        assert_as_sglang_builds(got, want)
        for prefix, module in got.items():
            assert all(getattr(module, n) is params[prefix][n] for n in f.PARAMETERS)  # SGLang's own Parameters
            h.post_process(torch.nn.ModuleDict({"m": module}))  # SGLang's post-processing now has nothing to do
        assert_as_sglang_builds(got, want)


@pytest.mark.parametrize("scale_dtype", ["bfloat16", "float16"])
def test_block_scales_stored_in_16_bits_install_as_sglangs_loader_widens_them(tmp_path, scale_dtype):
    """SGLang's weight_loader copies 16-bit ``weight_scale_inv`` into its FP32 parameters; install gives the same."""
    synthesize(tmp_path / "ckpt", "qwen3-moe-tiny", scale_dtype=scale_dtype, seed=7)
    convert(tmp_path / "ckpt", tmp_path / "out", ConvertOptions(ep_size=EP_SIZE, num_redundant_experts=REDUNDANT,
                                                                engine="sglang"))
    with f.patched(2, EP_SIZE, REDUNDANT):
        want = reference("qwen3_moe", tmp_path / "ckpt", 2)
        model = f.build_main_model("qwen3_moe", f.hf_config(tmp_path / "ckpt"), 2, REDUNDANT)
        install(model, tmp_path / "out", rank=2)
        assert_as_sglang_builds(f.experts_of(model), want)


def test_the_nextn_layer_holds_redundant_slots_from_sglangs_expert_location(fp8):
    """DeepSeek-V3's NextN layer is built like a decoder layer (V4's is not): 12 physical slots."""
    config = f.hf_config(fp8["deepseek_v3"].ckpt)
    with f.patched(3, EP_SIZE, REDUNDANT):
        module = f.experts_of(f.build_nextn_model("deepseek_v3", config, REDUNDANT))["model.decoder.mlp.experts"]
        assert module.uses_expert_location and module.num_experts == 12 and module.num_local_experts == 3


def test_the_contract_detects_sglangs_fp8_fused_moe_and_leaves_mxfp4_to_the_sm100_build(fp8, sglang_ckpt):
    config = f.hf_config(fp8["qwen3_moe"].ckpt)
    with f.patched(0, EP_SIZE, REDUNDANT):
        fp8_module = f.experts_of(f.build_main_model("qwen3_moe", config, 0, REDUNDANT))["model.layers.0.mlp.experts"]
        assert CONTRACT.detect(fp8_module), CONTRACT.missing(fp8_module)
    with h.patched(0, EP_SIZE, REDUNDANT):
        mxfp4 = h.experts_of(h.build_main_model(h.hf_config(sglang_ckpt), 0, REDUNDANT))["model.layers.0.mlp.experts"]
        assert CONTRACT.missing(mxfp4) == ["w13_weight as float8_e4m3fn (FP8 block-quantized experts)"]


@pytest.mark.parametrize("change,message", [
    (dict(platform="sm100"), "SGLang builds the FP8 MegaMoE weights on Hopper \\(SM90\\) only"),
    (dict(moe_a2a_backend="none"), "SGLang builds MegaMoE weights only with --moe-a2a-backend megamoe"),
    (dict(redundant=0), "num_experts is 8 in the model but 12"),
    (dict(init_expert_location='{"physical_to_logical_map": [[7, 6, 5, 4, 3, 2, 1, 0, 0, 1, 2, 3]]}'),
     r"SGLang places logical experts \[4, 3, 2\] on rank 1, but .* holds \[3, 4, 5\] for layers.0"),
])
def test_what_sglang_would_build_differently_is_refused_with_one_line(fp8, change, message):
    paths = fp8["qwen3_moe"]
    config = f.hf_config(paths.ckpt)
    redundant = change.pop("redundant", REDUNDANT)
    platform = change.pop("platform", None)
    with f.patched(1, EP_SIZE, redundant, **change):
        main = f.build_main_model("qwen3_moe", config, 1, redundant)
        before = {p: [raw(t) for t in m.parameters()] for p, m in f.experts_of(main).items()}
        with mock.patch("sglang.srt.runtime_context.get_platform",
                        return_value=types.SimpleNamespace(is_sm90=False)) if platform else _nothing(), \
                pytest.raises(InstallError, match=message) as info:
            install(main, paths.converted, rank=1)
        assert "\n" not in str(info.value)
        for prefix, module in f.experts_of(main).items():
            assert not module._mega_moe_weights_built
            assert all(torch.equal(raw(a), b) for a, b in zip(module.parameters(), before[prefix], strict=True))


def raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (FP8 weights fresh from ``torch.empty`` may hold NaNs, unequal to themselves)."""
    return t.detach().contiguous().view(torch.uint8).clone()


def _nothing():
    import contextlib
    return contextlib.nullcontext()


def test_an_mxfp4_conversion_into_fp8_modules_is_refused(fp8, sglang_converted):
    config = f.hf_config(fp8["qwen3_moe"].ckpt)
    with f.patched(0, EP_SIZE, REDUNDANT):
        main = f.build_main_model("qwen3_moe", config, 0, REDUNDANT)
        with pytest.raises(InstallError, match="takes fp8_block experts, but .* holds mxfp4"):
            install(main, sglang_converted, rank=0)


# --------------------------------------------------------------------------------------
# Every load format serves the experts, or refuses
# --------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["converted", "store"])
def test_sglang_reads_the_original_architecture_of_each_family(fp8, form):
    """The per-rank form and the store alike: a store's placement is SGLang's own, read at install."""
    assert parsed(getattr(fp8["deepseek_v3"], form)).architectures == ["DeepseekV3ForCausalLM"]
    assert parsed(getattr(fp8["qwen3_moe"], form)).architectures == ["Qwen3MoeForCausalLM"]
    assert parsed(getattr(fp8["qwen3_moe"], form)).model_type == "qwen3_moe"


@pytest.mark.parametrize("form", ["converted", "store"])
@pytest.mark.parametrize("load_format", ["auto", "megamoe"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_load_format_serves_the_pre_baked_experts(fp8, family, load_format, form):
    paths = fp8[family]
    out = getattr(paths, form)
    seen: list[str] = []
    with f.patched(2, EP_SIZE, REDUNDANT):
        want = reference(family, paths.ckpt, 2)
        config = tree_config(paths.ckpt, out)
        got = {}
        for model in models(family, config, 2):
            with hooked_load_weights(type(model), seen):
                load(load_format, model, out, config)  # SGLang's post-processing runs here too
            got.update(f.experts_of(model))
        assert_as_sglang_builds(got, want)
    assert any(name.startswith("model.layers.0.self_attn.") for name in seen)
    assert not any(".mlp.experts." in n for n in seen)


def test_a_forgotten_megamoe_backend_is_refused_before_any_expert_is_read(fp8):
    """``--moe-a2a-backend megamoe`` left out: SGLang would not build MegaMoE weights, so the
    pre-baked layout would be served to its grouped GEMMs; refused before reading."""
    paths = fp8["deepseek_v3"]
    seen: list[str] = []
    with f.patched(0, EP_SIZE, REDUNDANT, moe_a2a_backend="none"):
        model = f.build_main_model("deepseek_v3", tree_config(paths.ckpt, paths.converted), 0, REDUNDANT)
        with hooked_load_weights(type(model), seen), \
                pytest.raises(InstallError, match="only with --moe-a2a-backend megamoe"):
            load("auto", model, paths.converted, model.config)
    assert not seen


def test_the_transformers_backend_is_refused_for_a_conversion(fp8):
    from sglang.srt.configs.model_config import ModelImpl
    from sglang.srt.model_loader import utils

    out = fp8["qwen3_moe"].converted
    hf_config = parsed(out)
    config = types.SimpleNamespace(model_path=str(out), revision=None, hf_config=hf_config, hf_text_config=hf_config,
                                   quantization=None, is_generation=True, is_multimodal=False,
                                   model_impl=ModelImpl.TRANSFORMERS)
    with pytest.raises(InstallError, match="drop --model-impl transformers"):
        utils.get_model_architecture(config)
    config.model_impl = ModelImpl.AUTO
    assert utils.get_model_architecture(config)[0] is f.Qwen3MoeForCausalLM


BARE_SGLANG = """
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader.utils import get_model_architecture
for out in {dirs!r}:
    try:
        print("ACCEPTED", get_model_architecture(ModelConfig(out)))
    except Exception as e:
        print("REFUSED", " ".join(str(e).split()))
"""


def test_sglang_without_megamoe_convert_refuses_each_familys_conversion(fp8, tmp_path):
    dirs = [str(fp8[family].converted) for family in FAMILIES]
    proc = bare_env.run_bare(h.TORCHVISION_STAND_IN + BARE_SGLANG.format(dirs=dirs), tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("REFUSED", "ACCEPTED"))]
    assert len(lines) == 2 and all(line.startswith("REFUSED") for line in lines), proc.stdout
    for line, family in zip(lines, FAMILIES, strict=True):
        assert marker.marker_model_type(family) in line


def test_the_rank_files_are_sglangs_tensors_byte_for_byte(fp8):
    """The per-rank form read back whole: the same bytes SGLang's build leaves, as stored."""
    from megamoe_convert.serve.loader import load_rank

    paths = fp8["deepseek_v3"]
    with f.patched(1, EP_SIZE, REDUNDANT):
        want = reference("deepseek_v3", paths.ckpt, 1)
    loaded = load_rank(paths.converted, 1)
    for prefix, key in (("model.layers.1.mlp.experts", "layers.1"), ("model.decoder.mlp.experts", "mtp.0")):
        layer = next(v for v in loaded.values() if v.key == key)
        ref = want[prefix]
        for got, name in ((layer.l1.weight, "w13_weight"), (layer.l1.sf, "w13_weight_scale_inv"),
                          (layer.l2.weight, "w2_weight"), (layer.l2.sf, "w2_weight_scale_inv")):
            assert torch.equal(got.contiguous().view(torch.uint8), getattr(ref, name).contiguous().view(torch.uint8))
    assert json.loads((paths.converted / "manifest.json").read_text())["family"] == "deepseek_v3"
