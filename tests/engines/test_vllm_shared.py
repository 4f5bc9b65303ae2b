"""The fused shared expert against vLLM's own code, with vLLM's own fusion decision
(``DeepseekV4MoE._init_mega_moe_experts``): on (TP=1), off by ``VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION``,
and off because TP>1 without sequence parallel. vLLM 0.33 fuses at construction (``shared_l*``
parameters), 0.32 in ``finalize_weights``; in every case what ``install`` + ``--load-format
megamoe``'s filtered loading leave must be byte for byte what vLLM's own loading leaves."""

from __future__ import annotations

import pytest
import torch
import vllm_harness as h

from megamoe_convert.engines.load_formats import without_expert_tensors
from megamoe_convert.engines.vllm import install_layers

EP_SIZE, REDUNDANT, RANK = 4, 4, 1


def moe_blocks(model) -> dict[str, torch.nn.Module]:
    return {layer.ffn.prefix: layer.ffn for layer in model.model.layers}


@pytest.mark.since_032
@pytest.mark.parametrize("fusion", ["on", "off-by-env", "off-by-tp2"])
def test_shared_expert_install_leaves_what_vllms_own_loading_leaves(engine_ckpt, engine_converted, monkeypatch,
                                                                    fusion):
    if fusion == "off-by-env":
        monkeypatch.setenv("VLLM_DISABLE_DSV4_MEGAMOE_SHARED_EXPERT_FUSION", "1")
    tp_size = 2 if fusion == "off-by-tp2" else 1
    config = h.hf_config(engine_ckpt)
    with h.patched(RANK, EP_SIZE), h.fp8_linears(tp_size):
        reference = h.build_main_model_with_shared(config, RANK, EP_SIZE, REDUNDANT, tp_size)
        reference.load_weights(h.checkpoint_weights(engine_ckpt, shared=True))  # 0.32 finalizes in there
        model = h.build_main_model_with_shared(config, RANK, EP_SIZE, REDUNDANT, tp_size)
        installed = install_layers(model, engine_converted, rank=RANK)
        model.load_weights(without_expert_tensors(h.checkpoint_weights(engine_ckpt, shared=True), installed))
    fused = fusion == "on"
    assert installed.shared == (tuple(f"layers.{i}" for i in range(config.num_hidden_layers)) if fused else ())
    assert all(".shared_experts." in name for name in installed.skip) and bool(installed.skip) == fused
    want = moe_blocks(reference)
    for prefix, moe in moe_blocks(model).items():
        assert moe.experts.has_fused_shared_experts == fused == want[prefix].experts.has_fused_shared_experts
        got, expected = h.layer_state(moe), h.layer_state(want[prefix])
        assert sorted(got) == sorted(expected), prefix
        for name, w in expected.items():
            g = got[name]
            assert (g.dtype, tuple(g.shape), g.stride()) == (w.dtype, tuple(w.shape), w.stride()), f"{prefix} {name}"
            assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), f"{prefix} {name}"
        if fused and not h.KERNEL_LAYOUT:  # 0.32: the kernel's L1 weight is the shared MLP's own storage
            assert moe.experts._transformed_shared_l1_weights[0].data_ptr() == \
                moe.shared_experts.gate_up_proj.weight.data_ptr()
        if not fused:  # it loaded as usual: the checkpoint's bytes are in vLLM's MLP
            assert torch.count_nonzero(moe.shared_experts.down_proj.weight.view(torch.uint8)) > 0
