"""``engines.sglang.install`` against SGLang 0.5.23's real modules, with SGLang's own loading and
``build_mega_moe_experts_weights`` as the oracle."""

from __future__ import annotations

import pytest
import sglang_harness as h
import torch

from megamoe_convert.engines.sglang import install
from megamoe_convert.engines.sglang.mega_moe import CONTRACT
from megamoe_convert.errors import InstallError

EP_SIZE, REDUNDANT = 4, 4


def reference(ckpt, config, rank):
    """What SGLang's own loading leaves in every MegaMoE module of rank ``rank``."""
    main, nextn = h.build_main_model(config, rank, REDUNDANT), h.build_nextn_model(config)
    h.sglang_load(main, ckpt)
    nextn.load_weights(h.checkpoint_weights(ckpt))
    h.post_process(nextn)
    return {**h.experts_of(main), **h.experts_of(nextn)}


@pytest.mark.parametrize("rank", range(EP_SIZE))
def test_install_leaves_every_module_as_sglangs_own_loading_does(sglang_ckpt, sglang_converted, rank):
    config = h.hf_config(sglang_ckpt)
    with h.patched(rank, EP_SIZE, REDUNDANT):
        want = reference(sglang_ckpt, config, rank)
        main, nextn = h.build_main_model(config, rank, REDUNDANT), h.build_nextn_model(config)
        params = {p: dict(m.named_parameters())
                  for p, m in {**h.experts_of(main), **h.experts_of(nextn)}.items()}
        assert install(main, sglang_converted, rank=rank) == config.num_hidden_layers
        assert install(nextn, sglang_converted, rank=rank) == 1
        got = {**h.experts_of(main), **h.experts_of(nextn)}
        assert sorted(got) == sorted(want) == ["model.decoder.mlp.experts", "model.layers.0.mlp.experts",
                                                "model.layers.1.mlp.experts"]
        for prefix, module in got.items():
            ref = want[prefix]
            assert module._mega_moe_weights_built and ref._mega_moe_weights_built
            for name, tensor in h.state(module).items():
                h.assert_same_tensor(tensor, h.state(ref)[name], f"{prefix}.{name}")
            assert [n for n, _ in module.named_parameters()] == [n for n, _ in ref.named_parameters()]
            for name in ("w13_weight", "w2_weight"):  # SGLang's own Parameters, still loadable
                assert getattr(module, name) is params[prefix][name]
            for gemm, scale in ((1, "w13"), (2, "w2")):  # EPLB moves parameters: the mega tensors go with them
                mega = getattr(module, f"mega_l{gemm}_weights")
                assert h.shares_storage(mega[0], getattr(module, f"{scale}_weight"))
                assert h.shares_storage(mega[1], getattr(module, f"mega_{scale}_weight_scale_utccp"))
                assert getattr(module, f"{scale}_weight_scale_inv").format_ue8m0 is True
            h.post_process(torch.nn.ModuleDict({"m": module}))  # SGLang's post-processing now skips its transform
            for name, tensor in h.state(module).items():
                h.assert_same_tensor(tensor, h.state(ref)[name], f"{prefix}.{name} after post-processing")


def test_the_mtp_layer_holds_two_experts_per_rank_as_sglang_builds_it(sglang_ckpt, sglang_converted):
    config = h.hf_config(sglang_ckpt)
    with h.patched(3, EP_SIZE, REDUNDANT):
        nextn = h.build_nextn_model(config)
        module = h.experts_of(nextn)["model.decoder.mlp.experts"]
        assert module.num_local_experts == 2 and not module.uses_expert_location
        install(nextn, sglang_converted, rank=3)
        assert module.w13_weight.shape[0] == 2


def test_a_vllm_placement_conversion_is_refused_before_any_module_changes(sglang_ckpt, tmp_path):
    from megamoe_convert.convert.plan import ConvertOptions
    from megamoe_convert.convert.run import convert

    out = tmp_path / "vllm"
    convert(sglang_ckpt, out, ConvertOptions(ep_size=4, num_redundant_experts=4, experts_only=True))
    config = h.hf_config(sglang_ckpt)
    with h.patched(0, EP_SIZE, REDUNDANT):
        main = h.build_main_model(config, 0, REDUNDANT)
        with pytest.raises(InstallError, match="converted for vllm's expert placement, not sglang's; convert with "
                                               "--engine sglang"):
            install(main, out, rank=0)


@pytest.mark.parametrize("change,message", [
    (dict(redundant=0), r"model.layers.0.mlp.experts: num_experts is 8 in the model but 12"),
    (dict(rank=2), r"moe_ep_rank is 2 in the model but 1"),
    (dict(init_expert_location='{"physical_to_logical_map": [[7, 6, 5, 4, 3, 2, 1, 0, 0, 1, 2, 3]]}'),
     r"SGLang places logical experts \[4, 3, 2\] on rank 1, but .* holds \[3, 4, 5\] for layers.0"),
    (dict(enable_w4a4_mxfp4_megamoe=True), "W4A4 MegaMoE"),
])
def test_what_sglang_would_build_differently_is_refused_with_one_line(sglang_ckpt, sglang_converted, change,
                                                                        message):
    config = h.hf_config(sglang_ckpt)
    redundant = change.pop("redundant", REDUNDANT)
    module_rank = change.pop("rank", 1)
    with h.patched(module_rank, EP_SIZE, redundant, **change):
        main = h.build_main_model(config, module_rank, redundant)
        before = {p: [t.clone() for t in m.parameters()] for p, m in h.experts_of(main).items()}
        with pytest.raises(InstallError, match=message) as info:
            install(main, sglang_converted, rank=1)
        assert "\n" not in str(info.value)
        for prefix, module in h.experts_of(main).items():
            assert not module._mega_moe_weights_built
            assert all(torch.equal(a, b) for a, b in zip(module.parameters(), before[prefix], strict=True))


def test_rank_none_takes_sglangs_moe_ep_rank(sglang_ckpt, sglang_converted):
    config = h.hf_config(sglang_ckpt)
    with h.patched(2, EP_SIZE, REDUNDANT):
        main = h.build_main_model(config, 2, REDUNDANT)
        assert install(main, sglang_converted) == config.num_hidden_layers


def test_contract_detects_sglangs_real_fused_moe(sglang_ckpt):
    config = h.hf_config(sglang_ckpt)
    with h.patched(0, EP_SIZE, REDUNDANT):
        experts = h.experts_of(h.build_main_model(config, 0, REDUNDANT))["model.layers.1.mlp.experts"]
    assert CONTRACT.detect(experts), CONTRACT.missing(experts)


def test_a_hidden_size_sglangs_megamoe_cannot_serve_is_refused(tiny_ckpt, tmp_path):
    from megamoe_convert.convert.plan import ConvertOptions
    from megamoe_convert.convert.run import convert

    out = tmp_path / "h256"
    convert(tiny_ckpt, out, ConvertOptions(ep_size=4, num_redundant_experts=4, engine="sglang", experts_only=True))
    with h.patched(0, EP_SIZE, REDUNDANT):
        main = h.build_main_model(h.hf_config(tiny_ckpt), 0, REDUNDANT)
        with pytest.raises(InstallError, match=r"model.layers.0.mlp.experts: SGLang's MegaMoE needs hidden_size % 512 "
                                               r"== 0 and moe_intermediate_size % 128 == 0; .* has 256 and 128"):
            install(main, out, rank=0)
