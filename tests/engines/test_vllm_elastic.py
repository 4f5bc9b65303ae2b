"""vLLM's elastic EP against a MegaMoE model (vLLM 0.33): the reason docs/elastic-ep.md gives for
megamoe-convert not hooking vLLM's scale-up. Its elastic execution collects the model's MoE layers
with ``vllm.utils.is_moe_layer`` before it moves any expert; that finds none of the MegaMoE modules.
A release whose elastic EP does find them fails this test: its scale-up then needs the store's hook."""

from __future__ import annotations

import pytest
import vllm_harness as h

from megamoe_convert.synth.write import synthesize

EP_SIZE, REDUNDANT, RANK = 4, 4, 1

pytestmark = pytest.mark.only_kernel_layout


def test_vllms_elastic_ep_finds_no_moe_layer_in_a_megamoe_model(tmp_path):
    import vllm.distributed.elastic_ep.elastic_execute as elastic

    synthesize(tmp_path / "ckpt", "tiny", seed=7)
    config = h.hf_config(tmp_path / "ckpt")
    with h.patched(RANK, EP_SIZE):
        model = h.build_main_model(config, RANK, EP_SIZE, REDUNDANT)
    mega = [m for m in model.modules() if type(m).__name__ == "DeepGemmMegaMoEExperts"]
    assert mega, "the harness built no MegaMoE module"
    assert [m for m in model.modules() if elastic.is_moe_layer(m)] == []
