"""Every MegaMoE weight format, and the fused shared expert, against vLLM's own loading (0.33's
``DeepGemmMegaMoEExperts._load_weight`` / ``load_shared_expert_weight``; 0.32 refuses what it cannot take)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import vllm_harness as h

from megamoe_convert.convert.plan import ConvertOptions
from megamoe_convert.convert.run import convert
from megamoe_convert.engines.load_formats import without_expert_tensors
from megamoe_convert.engines.vllm import install, install_layers
from megamoe_convert.errors import InstallError
from megamoe_convert.synth.write import synthesize

EP_SIZE, REDUNDANT, RANK = 4, 4, 1


def synth_and_convert(root: Path, weight_format: str) -> tuple[Path, Path]:
    ckpt, out = root / weight_format, root / f"{weight_format}-ep{EP_SIZE}"
    synthesize(ckpt, "tiny", seed=7, weight_format=weight_format)
    convert(ckpt, out, ConvertOptions(ep_size=EP_SIZE, num_redundant_experts=REDUNDANT, fsync=False))
    return ckpt, out


def module_state(module) -> dict[str, torch.Tensor]:
    """Everything vLLM's loading leaves in a MegaMoE module: its parameters, and (NVFP4) the
    record of every logical expert's L2 input scale with the activation scale taken from it."""
    state = dict(module.named_parameters(recurse=False))
    if h.KERNEL_LAYOUT:
        state["_w2_input_scales"] = module._w2_input_scales
        state["l2_activation_scale"] = torch.tensor(module.l2_activation_scale)
    return state


def assert_same_state(got, want, where: str) -> None:
    g, w = module_state(got), module_state(want)
    assert sorted(g) == sorted(w), where
    for name in w:
        a, b = g[name], w[name]
        assert (a.dtype, tuple(a.shape), a.stride()) == (b.dtype, tuple(b.shape), b.stride()), f"{where}.{name}"
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), f"{where}.{name} bytes"


def build(config, **overrides):
    return (h.build_main_model(config, RANK, EP_SIZE, REDUNDANT, **overrides),
            h.build_mtp_model(config, RANK, EP_SIZE, REDUNDANT, **overrides))


@pytest.mark.only_kernel_layout
@pytest.mark.parametrize("weight_format", ["mxfp8", "nvfp4", "bf16"])
def test_each_weight_format_installs_what_vllms_load_weight_gives(tmp_path, weight_format):
    ckpt, out = synth_and_convert(tmp_path, weight_format)
    config = h.hf_config(ckpt)
    fmt = h.mega_py.MEGA_MOE_WEIGHT_FORMATS[weight_format]
    with h.patched(RANK, EP_SIZE):
        ref_main, ref_mtp = build(config, weight_format=fmt)
        h.vllm_load(ref_main, ref_mtp, ckpt)
        main, mtp = build(config, weight_format=fmt)
        assert install(main, out, rank=RANK) + install(mtp, out, rank=RANK) == 3
    want = {**h.experts_of(ref_main), **h.experts_of(ref_mtp)}
    for prefix, module in {**h.experts_of(main), **h.experts_of(mtp)}.items():
        assert_same_state(module, want[prefix], prefix)
        h.assert_same_tensors(h.kernel_view(module), h.kernel_view(want[prefix]), f"{prefix} kernel")
        h.assert_same_tensors(module.get_expert_weights(), want[prefix].get_expert_weights(), f"{prefix} EPLB")
    if weight_format == "nvfp4":  # the scales really came across (not two all-zero states)
        assert float(module._w2_input_scales.min()) > 0 and module.l2_activation_scale > 1
        assert float(module.w13_weight_scale_2.min()) > 0


@pytest.mark.only_kernel_layout
def test_the_fused_shared_expert_installs_what_vllms_load_shared_expert_weight_gives(tiny_ckpt, tiny_converted):
    config = h.hf_config(tiny_ckpt)
    with h.patched(RANK, EP_SIZE):
        ref_main, ref_mtp = build(config, shared_experts=h.fusable_shared_mlp(config))
        h.vllm_load(ref_main, ref_mtp, tiny_ckpt, shared=True)
        main, mtp = build(config, shared_experts=h.fusable_shared_mlp(config))
        before = {p: dict(m.named_parameters()) for p, m in {**h.experts_of(main), **h.experts_of(mtp)}.items()}
        install(main, tiny_converted, rank=RANK)
        install(mtp, tiny_converted, rank=RANK)
    want = {**h.experts_of(ref_main), **h.experts_of(ref_mtp)}
    for prefix, module in {**h.experts_of(main), **h.experts_of(mtp)}.items():
        assert module.has_fused_shared_experts and "shared_l1_weight_scale" in module_state(module)
        assert torch.count_nonzero(module.shared_l2_weight_scale) > 0
        assert_same_state(module, want[prefix], prefix)
        for name, param in module.named_parameters():  # the same Parameters, still loadable by vLLM
            assert param is before[prefix][name]
        assert module.shared_l1_weight.weight_loader.__func__ is type(module).shared_weight_loader


@pytest.mark.only_kernel_layout
def test_load_format_leaves_vllm_no_shared_expert_to_load_when_installed(tiny_ckpt, tiny_converted):
    config = h.hf_config(tiny_ckpt)
    weights = [(name, None) for name in ("layers.0.ffn.shared_experts.w1.weight", "mtp.0.ffn.shared_experts.w2.scale",
                                         "layers.1.attn.wkv.weight", "layers.1.ffn.experts.3.w1.weight")]
    with h.patched(RANK, EP_SIZE):
        fused, _ = build(config, shared_experts=h.fusable_shared_mlp(config))
        plain, _ = build(config)
        installed = install_layers(fused, tiny_converted, rank=RANK)
        assert installed.layers == installed.shared == ("layers.0", "layers.1")
        assert install_layers(plain, tiny_converted, rank=RANK).shared == ()
    kept = [n for n, _ in without_expert_tensors(weights, installed)]
    assert kept == ["mtp.0.ffn.shared_experts.w2.scale", "layers.1.attn.wkv.weight"]


@pytest.mark.only_finalize
def test_vllm_032_refuses_a_conversion_of_another_format_by_name(tmp_path):
    ckpt, out = synth_and_convert(tmp_path, "mxfp8")
    config = h.hf_config(ckpt)
    with h.patched(RANK, EP_SIZE):
        main, _ = build(config)
        with pytest.raises(InstallError, match=r"takes MXFP4 experts only, but .* holds mxfp8"):
            install(main, out, rank=RANK)
