"""``install()`` against vLLM's real modules and vLLM's own loading as the oracle (0.32 and 0.33)."""

from __future__ import annotations

import pytest
import torch
import vllm_harness as h
from torch import nn

from megamoe_convert.engines.vllm import CONTRACTS, install
from megamoe_convert.errors import InstallError

EP_SIZE, REDUNDANT = 4, 4


def build(config, rank, ep_size=EP_SIZE, redundant=REDUNDANT):
    return h.build_main_model(config, rank, ep_size, redundant), h.build_mtp_model(config, rank, ep_size, redundant)


@pytest.mark.parametrize("rank", range(EP_SIZE))
def test_install_gives_the_kernel_and_eplb_what_vllms_own_loading_gives(engine_ckpt, engine_converted, rank):
    config = h.hf_config(engine_ckpt)
    with h.patched(rank, EP_SIZE):
        ref_main, ref_mtp = build(config, rank)
        h.vllm_load(ref_main, ref_mtp, engine_ckpt)
        main, mtp = build(config, rank)
        params_before = {p: dict(m.named_parameters()) for p, m in {**h.experts_of(main), **h.experts_of(mtp)}.items()}
        assert install(main, engine_converted, rank=rank) == config.num_hidden_layers
        assert install(mtp, engine_converted, rank=rank) == config.num_nextn_predict_layers
        if not h.KERNEL_LAYOUT:  # vLLM 0.32 finalizes in load_weights / process_weights_after_loading
            for moe in (m for model in (main, mtp) for m in model.modules() if isinstance(m, h.model_py.DeepseekV4MoE)):
                moe.finalize_mega_moe_weights()
        want = {**h.experts_of(ref_main), **h.experts_of(ref_mtp)}
        got = {**h.experts_of(main), **h.experts_of(mtp)}
        assert sorted(got) == sorted(want) and len(got) == 3
        for prefix, module in got.items():
            h.assert_same_tensors(h.kernel_view(module), h.kernel_view(want[prefix]), f"{prefix} kernel")
            h.assert_same_tensors(module.get_expert_weights(), want[prefix].get_expert_weights(), f"{prefix} EPLB")
            if h.KERNEL_LAYOUT:  # the same Parameter objects, still loadable by vLLM
                now = dict(module.named_parameters())
                assert now.keys() == params_before[prefix].keys()
                for name, param in now.items():
                    assert param is params_before[prefix][name]
                    assert param.weight_loader.__func__ is type(module).weight_loader
                assert module.w13_weight_scale.quant_method == "block"
            else:
                assert module.w13_weight is None and not list(module.parameters())
                assert getattr(module, "_backend", "no backend cache") is not None


@pytest.mark.only_kernel_layout  # 0.30-0.32 release the loader-side parameters: nothing to reload into
def test_a_second_load_through_vllms_weight_loader_still_works_after_install(engine_ckpt, engine_converted):
    """Reloading (e.g. RL weight updates) goes through the same Parameters: they must still
    accept vLLM's own shard loading and end with the same bytes."""
    config = h.hf_config(engine_ckpt)
    with h.patched(2, EP_SIZE):
        main, mtp = build(config, 2)
        install(main, engine_converted, rank=2)
        installed = {p: [t.clone() for t in h.kernel_view(m)] for p, m in h.experts_of(main).items()}
        main.load_weights(h.checkpoint_weights(engine_ckpt))
        for prefix, module in h.experts_of(main).items():
            h.assert_same_tensors(h.kernel_view(module), installed[prefix], prefix)


@pytest.mark.parametrize("attribute,value,message", [
    ("experts_start_idx", 0, "experts_start_idx is 0 in the model but 3"),
    ("num_logical_experts", 12, "num_logical_experts is 12 in the model but 8"),
    ("hidden_size", 512, "hidden_size is 512 in the model but 256"),
])
def test_a_mismatched_module_is_refused_before_any_module_changes(engine_ckpt, engine_converted, attribute, value,
                                                                   message):
    config = h.hf_config(engine_ckpt)
    with h.patched(1, EP_SIZE):
        main, _ = build(config, 1)
        target = h.experts_of(main)["model.layers.1.ffn.experts"]
        setattr(target, attribute, value)
        before = {p: [t.clone() for t in m.parameters()] for p, m in h.experts_of(main).items()}
        with pytest.raises(InstallError, match=message) as info:
            install(main, engine_converted, rank=1)
        assert "model.layers.1.ffn.experts" in str(info.value)
        for prefix, module in h.experts_of(main).items():
            assert all(torch.equal(a, b) for a, b in zip(module.parameters(), before[prefix], strict=True))
            assert len(list(module.parameters())) == 4


def test_an_explicit_placement_is_refused_because_vllm_maps_slots_by_modulo(engine_ckpt, tmp_path):

    (tmp_path / "eplb.json").write_text("[3, 2, 1, 0, 7, 6, 5, 4, 0, 1, 2, 3]")
    from megamoe_convert.convert import ConvertOptions, convert

    out = tmp_path / "eplb"  # `convert` refuses this for vLLM; install's own refusal is the second line of defence
    convert(engine_ckpt, out, ConvertOptions(EP_SIZE, placement_file=tmp_path / "eplb.json", experts_only=True,
                                             check_serving=False))
    with h.patched(1, EP_SIZE):
        main, _ = build(h.hf_config(engine_ckpt), 1)
        with pytest.raises(InstallError, match="explicit expert placement"):
            install(main, out, rank=1)
        assert all(torch.count_nonzero(p) == 0 for p in main.parameters())


def test_a_model_built_for_another_ep_size_is_refused(engine_ckpt, engine_converted):
    config = h.hf_config(engine_ckpt)
    with h.patched(0, 2):
        main, _ = build(config, 0, ep_size=2, redundant=0)
        with pytest.raises(InstallError, match=r"num_local_experts is 4 in the model but 3"):
            install(main, engine_converted, rank=0)


@pytest.mark.only_kernel_layout  # 0.30-0.32 know one format
def test_a_module_of_another_weight_format_is_refused(engine_ckpt, engine_converted):
    config = h.hf_config(engine_ckpt)
    with h.patched(0, EP_SIZE):
        main = h.build_main_model(config, 0, EP_SIZE, REDUNDANT)
        main.model.layers[0].ffn.experts = h.make_experts(  # a real BF16-format module at layer 0
            config, "model.layers.0.ffn.experts", 0, EP_SIZE, REDUNDANT, weight_format=h.mega_py.MEGA_MOE_BF16,
            activation=h.mega_py.MegaMoEActivation("swiglu"))
        with pytest.raises(InstallError, match="weight_format is bf16 in the model but mxfp4"):
            install(main, engine_converted, rank=0)


def test_rank_none_takes_vllms_ep_rank(engine_ckpt, engine_converted):
    config = h.hf_config(engine_ckpt)
    with h.patched(3, EP_SIZE):
        main, _ = build(config, 3)
        assert install(main, engine_converted) == config.num_hidden_layers
        assert h.experts_of(main)["model.layers.0.ffn.experts"].experts_start_idx == 9


def test_a_module_of_no_known_contract_is_refused_by_name(engine_ckpt, engine_converted):
    """The XPU class (or a future vLLM) looks like MegaMoE experts but has neither contract."""
    xpu = __import__("vllm.models.deepseek_v4.xpu.model", fromlist=["x"]) if h.KERNEL_LAYOUT else None
    config = h.hf_config(engine_ckpt)
    with h.patched(0, EP_SIZE):
        main = h.build_main_model(config, 0, EP_SIZE, REDUNDANT)
        if xpu is not None:
            odd = h._bare(xpu.DeepseekV4MegaMoEExperts, **{a: getattr(main.model.layers[0].ffn.experts, a) for a in (
                "prefix", "experts_start_idx", "num_local_experts", "hidden_size", "intermediate_size")})
            odd.finalize_weights = lambda: None
            main.model.layers[0].ffn.experts = odd
        else:
            del main.model.layers[0].ffn.experts._transformed_l1_weights  # what an unknown class might lack
        with pytest.raises(InstallError, match="is of no MegaMoE contract") as info:
            install(main, engine_converted, rank=0)
        assert "model.layers.0.ffn.experts" in str(info.value)


def test_contract_detection_and_the_stand_in_match_the_real_class(engine_ckpt):
    """The package detects the real class as its release's contract, and the plain suite's
    stand-in has exactly the real class's attributes and parameters (so the next drift fails here)."""
    from vllm_stand_in import STAND_INS

    config = h.hf_config(engine_ckpt)
    with h.patched(1, EP_SIZE):
        real = h.make_experts(config, "model.layers.0.ffn.experts", 1, EP_SIZE, REDUNDANT)
    contract = CONTRACTS[0 if h.KERNEL_LAYOUT else 1]
    assert contract.detect(real), contract.missing(real)
    assert not CONTRACTS[1 if h.KERNEL_LAYOUT else 0].detect(real)
    stand_in = STAND_INS["kernel_layout" if h.KERNEL_LAYOUT else "finalize"](
        real.prefix, real.num_experts, real.num_local_experts, real.experts_start_idx, real.hidden_size,
        real.intermediate_size, real.num_logical_experts)
    assert contract.detect(stand_in)
    missing = [a for a in dir(stand_in) if not a.startswith("__") and not hasattr(real, a) and a != "_register"]
    assert not missing, f"the stand-in has attributes the real class lacks: {missing}"
    for marker in contract.missing(nn.Module()):
        assert hasattr(stand_in, marker) == hasattr(real, marker), marker

    def params(m):
        return {n: (p.dtype, tuple(p.shape), p.stride(), getattr(p, "quant_method", None))
                for n, p in m.named_parameters()}

    assert params(stand_in) == params(real)


@pytest.mark.only_finalize
def test_an_intermediate_size_vllm_would_pad_is_refused_or_served(tiny_ckpt, tiny_converted):
    """I = 128: vLLM 0.30 pads it to 512 in finalize (refused: not the converted layout);
    0.31-0.32 take it as it is (served)."""
    config = h.hf_config(tiny_ckpt)
    with h.patched(0, EP_SIZE):
        main, _ = build(config, 0)
        if h.VERSION < (0, 31):
            with pytest.raises(InstallError, match="pads intermediate_size 128 to a multiple of 512"):
                install(main, tiny_converted, rank=0)
        else:
            assert install(main, tiny_converted, rank=0) == config.num_hidden_layers


@pytest.mark.only_finalize
def test_the_flashinfer_megamoe_subclass_is_refused(engine_ckpt, engine_converted):
    """0.30-0.31's ``DeepseekV4MegaMoEExpertsFI`` keeps the loader-side parameters but runs
    FlashInfer's own layout: installing DeepGEMM's would be wrong."""
    fi_module = h.importlib.util.find_spec("vllm.models.deepseek_v4.nvidia.fi_moe")
    config = h.hf_config(engine_ckpt)
    with h.patched(0, EP_SIZE):
        main, _ = build(config, 0)
        real = main.model.layers[0].ffn.experts
        cls = h.importlib.import_module(fi_module.name).DeepseekV4MegaMoEExpertsFI if fi_module else None
        fi = h._bare(cls) if cls else h._bare(type(real))
        fi.__dict__.update(real.__dict__)
        fi._mega_layer = None  # what the FI class sets in __init__ (0.32 has no such class: the same state)
        main.model.layers[0].ffn.experts = fi
        with pytest.raises(InstallError, match="FlashInfer MegaMoE module runs its own layout"):
            install(main, engine_converted, rank=0)
